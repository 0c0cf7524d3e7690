"""The registry of KV methods the CLI, the evaluation and the tests read, and their options.

Full-KV (``qevict_jax.core.kv``), QEvict and its variants (``qevict_jax.methods.qevict``), every baseline
(``qevict_jax.methods.baselines``) and the learned-gate methods (``qevict_jax.methods.gate_methods``);
``make_method(name, budget, **options)`` is the one way to build one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qevict_jax.core.bounds import typed_value
from qevict_jax.core.cache import SinkRingCache, TieredCache
from qevict_jax.core.config import CacheConfig, cache_option_rule
from qevict_jax.core.kv import KVMethod
from qevict_jax.core.sharding import to_host
from qevict_jax.methods.agnostic import AGNOSTIC_BASELINES
from qevict_jax.methods.baselines import BASELINES
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.gate_methods import GATE_METHODS
from qevict_jax.methods.qevict import VARIANTS, WindowMethod
from qevict_jax.rankings.reconstruction import repeat_prompt
from qevict_jax.rankings.scoring import available_rankings


def available_methods() -> list[str]:
    """Names accepted by ``make_method``: Full-KV, QEvict and its variants, every baseline, the gates."""
    return ["full", *VARIANTS, *BASELINES, *AGNOSTIC_BASELINES, *GATE_METHODS]


def default_method(name: str) -> KVMethod:
    """The named method with its defaults (β = the ``CacheConfig`` default)."""
    if name == "full":
        return FullKV()
    if name in VARIANTS:
        return WindowMethod(name=name, cache=CacheConfig(**VARIANTS[name]))
    if name in BASELINES:
        return BASELINES[name]
    if name in AGNOSTIC_BASELINES:
        return AGNOSTIC_BASELINES[name]
    if name in GATE_METHODS:
        return GATE_METHODS[name]
    raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")


RENAMED_OPTIONS: dict[str, str] = {
    "kernel": "'pallas' (decode attention through the Pallas kernels) or 'avg_pool_width' (SnapKV's, CriticalKV's "
    "and ReST-KV's average-pooling width)",
    "pool": "'max_pool_width' (the max-pool width over neighbouring tokens of the observation rows)",
}
"""Option names of the previous release, each with the name(s) that replaced it: a clear error, not a silent
no-op, for scripts that still use them."""


STRUCTURE = ("allocation", "options", "protects_recent")
"""Fields of a method that say what it is, not options: never set by ``configure`` (no method lists them in its
``options``)."""


def configure(method: KVMethod, budget: float | None = None, **options: Any) -> KVMethod:
    """``method`` with byte budget ``budget`` (fraction of Full-KV; None keeps it) and ``options`` set.

    An option is any name in ``method.options``: a field of the method itself (``n_obs`` of SnapKV) or of
    its ``CacheConfig`` (``recent``, ``window``, ``n_obs`` of QEvict, ...). A name the method lacks is a
    ValueError listing the ones it has; a renamed one names its replacement (``RENAMED_OPTIONS``). A value is
    typed by its field (``bounds.typed_value``: a command-line string is parsed, ``window=1.5`` is
    refused), so a wrong one is a ValueError naming the option, the value and the range or choices it takes.
    """
    for old in sorted(set(options) & set(RENAMED_OPTIONS)):
        raise ValueError(f"option {old!r} was renamed: use {RENAMED_OPTIONS[old]}")
    unknown = sorted(set(options) - set(method.options))
    if unknown:
        raise ValueError(
            f"method {method.name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(sorted(method.options))}"
        )
    structure = {"name", "cache", *STRUCTURE}
    own_fields = {f.name: f for f in dataclasses.fields(method) if f.name not in structure}
    cache_fields = {f.name: f for f in dataclasses.fields(CacheConfig)}
    own = {k: _typed(k, v, own_fields[k], "") for k, v in options.items() if k in own_fields}
    cfg = {
        k: _typed(k, v, cache_fields.get(k), _option_rule(k))
        for k, v in options.items()
        if k not in own_fields
    }
    if "cache" in {f.name for f in dataclasses.fields(method)}:
        cache = method.cache
        if budget is not None:
            cfg["budget"] = _typed("budget", budget, cache_fields["budget"], cache_option_rule("budget"))
        own["cache"] = dataclasses.replace(cache, **cfg)
    return dataclasses.replace(method, **own)


def _option_rule(name: str) -> str:
    """The valid values of ``CacheConfig`` field ``name`` in words; the rankings are named here, at the edge,
    because the configuration sits below them (``scoring.available_rankings``)."""
    if name == "ranking":
        return "one of " + ", ".join(available_rankings())
    return cache_option_rule(name)


def _typed(name: str, value: Any, field: dataclasses.Field | None, rule: str) -> Any:
    """``value`` of option ``name`` typed by its dataclass ``field`` (``bounds.typed_value``); ``rule``: the
    values it takes, in words, for the error."""
    if field is None:
        return value
    annotation = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    return typed_value(name, value, annotation, rule)


def make_method(name: str, budget: float = 0.2, **options: Any) -> KVMethod:
    """The named method at byte budget ``budget`` (fraction of Full-KV) with ``options`` set (``configure``):
    ``make_method("qevict", 0.1, window=16, ranking="decayed")``, ``make_method("snapkv", 0.2, n_obs=64)``.
    Question-agnostic compression is a way of calling ``generate`` (``question_starts``), for every method.
    """
    return configure(default_method(name), budget, **options)


def bind_tokenizer(method: KVMethod, tokenizer: Any) -> KVMethod:
    """``method`` with what it needs of the tokenizer (``models.tokenizer.Tokenizer``): the kvzip ranking's
    repeat prompt (``reconstruction.repeat_prompt``) where it has none yet; any other method as it is."""
    recon = method.reconstruction
    if recon is None or recon.prompt:
        return method
    return dataclasses.replace(method, repeat_prompt=repeat_prompt(tokenizer))  # type: ignore[type-var]


def method_option(method: KVMethod, name: str) -> Any:
    """The current value of option ``name`` of ``method`` (its own field, else its cache's)."""
    if name not in method.options:
        raise ValueError(f"method {method.name!r} has no option {name!r}")
    own = {f.name for f in dataclasses.fields(method)} - {"name", "cache", *STRUCTURE}
    return getattr(method, name) if name in own else getattr(method.cache, name)


def cache_stats(cache: Any) -> dict[str, Any]:
    """Routing counters and tier fill of a stacked cache (leading [L] axis); only zero counters for a cache
    that never routes (Full-KV's).

    routing_events: per row, decode routing events (every layer routes together: layer 0's count).
    promotions, demotions, evictions: per row, summed over layers (windows, or pool tokens; prefill
    evictions included; a pool never promotes or demotes). f_fill, q_fill: occupied F slots / NF and active
    Q windows / NQ, mean over layers and rows (nan when the tier has no slot). dormant: dormant ledger
    entries, summed over layers and rows. ring_tokens: per row, tokens in the ring not yet routed (layer 0).
    """
    if not isinstance(cache, SinkRingCache):
        zeros = [0] * int(cache.length.shape[-1])
        return {"routing_events": zeros, "promotions": zeros, "demotions": zeros, "evictions": zeros}
    caps = cache.caps
    # to_host: a cache on a mesh across processes is gathered (every process calls cache_stats)
    per_row = lambda x: to_host(x).sum(axis=0).tolist()
    length = to_host(cache.length)[0]
    routed_end = caps.sink + to_host(cache.next_win)[0] * caps.window
    stats = {
        "routing_events": to_host(cache.routing_events)[0].tolist(),
        "evictions": per_row(cache.evictions),
        "ring_tokens": np.maximum(0, length - np.maximum(routed_end, caps.sink)).tolist(),
        "nf": caps.nf,
        "nq": caps.nq,
        "nl": caps.nl,
    }
    if not isinstance(cache, TieredCache):
        zeros = [0] * len(length)
        return stats | {"promotions": zeros, "demotions": zeros, "dormant": 0}
    f_win = to_host(cache.f_win)
    ledger_win = to_host(cache.ledger.win)
    active = to_host(cache.ledger.active)
    return stats | {
        "promotions": per_row(cache.promotions),
        "demotions": per_row(cache.demotions),
        "f_fill": float((f_win >= 0).mean()) if caps.nf else float("nan"),
        "q_fill": float(active.sum(-1).mean() / caps.nq) if caps.nq else float("nan"),
        "dormant": int(((ledger_win >= 0) & ~active).sum()),
    }
