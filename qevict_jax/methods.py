"""The QEvict KV method and its named configurations (the registry the CLI, evaluation and tests read).

Every variant is a ``CacheConfig`` over the same tiered machinery: the paper's diagnostic variants R1-R4
differ in window size and in whether the Q tier exists; "qevict-restkv" ranks the prompt's windows with the
ReST-KV output-change score. The baselines (StreamingLLM, H2O, TOVA, key-norm, SnapKV, PyramidKV, Ada-KV,
CriticalKV, ReST-KV, KIVI-2/4) are configurations and small policies over the same cache, in
``qevict_jax.baselines``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import numpy as np

from models.config import ModelConfig
from models.model import LayerContext
from pallas_kernels.dispatch import use_pallas
from qevict_jax.config import CacheConfig, Capacities, num_windows, solve_capacities
from qevict_jax.kv import FullKV, KVMethod
from qevict_jax.scoring import Ranking
from qevict_jax.tiered import TieredCache, decode_layer, init_cache, prefill_layer


@dataclasses.dataclass(frozen=True)
class QEvict:
    """Three-tier window cache (F full precision, Q packed low-bit with a persistent ledger, evicted).

    QEvict, arXiv 2608.05326. ``cache``: the static configuration (budget, window, tiers, ranking).
    """

    name: str = "qevict"
    cache: CacheConfig = CacheConfig()
    uses_budget: ClassVar[bool] = True

    @property
    def ranking(self) -> Ranking:
        return Ranking(self.cache.ranking, self.cache.decay, self.cache.p)

    def capacities(
        self,
        model_cfg: ModelConfig,
        batch: int,
        prompt_capacity: int,
        max_new_tokens: int,
        dtype: Any,
        budget_tokens: int,
    ) -> Capacities:
        """Static buffer sizes for a batch (see ``config.solve_capacities``)."""
        max_windows = num_windows(prompt_capacity + max_new_tokens, self.cache.sink, self.cache.window)
        return solve_capacities(self.cache, model_cfg, batch, budget_tokens, dtype, max_windows=max_windows)

    def init_cache(
        self,
        model_cfg: ModelConfig,
        prompt_lengths: jax.Array,
        prompt_capacity: int,
        max_new_tokens: int,
        dtype: Any,
        budget_tokens: int,
        context_lengths: jax.Array | None = None,
    ) -> TieredCache:
        """Empty stacked cache sized for ``budget_tokens`` tokens per row; ``prompt_lengths`` [B] int32.

        ``context_lengths`` (question-agnostic compression) is not supported by the window tiers."""
        if context_lengths is not None:
            raise ValueError(
                f"{self.name} compresses the whole prompt; question-agnostic mode is unsupported"
            )
        b = prompt_lengths.shape[0]
        caps = self.capacities(model_cfg, b, prompt_capacity, max_new_tokens, dtype, budget_tokens)
        return init_cache(caps, model_cfg, b, dtype, prompt_lengths)

    def prefill_attend(self, q, k, v, layer_cache: TieredCache, ctx: LayerContext):
        """q [B, T, H, D], k, v [B, T, Hkv, D] (post-RoPE, right-padded prompt) -> (out, layer cache)."""
        return prefill_layer(
            q, k, v, layer_cache, ctx, self.ranking, self.cache.promotion, self.cache.prefill_chunk
        )

    def decode_attend(self, q, k, v, layer_cache: TieredCache, ctx: LayerContext):
        """q [B, 1, H, D], k, v [B, 1, Hkv, D] (post-RoPE) -> (out [B, 1, H, D], layer cache)."""
        return decode_layer(
            q, k, v, layer_cache, ctx, self.ranking, self.cache.promotion, use_pallas(self.cache.kernel)
        )


_VARIANTS: dict[str, dict[str, Any]] = {
    "qevict": {},  # = R3
    "r1": {"window": 1, "q_frac": 0.0},  # token-level eviction
    "r2": {"window": 8, "q_frac": 0.0},  # two-tier window eviction
    "r3": {"window": 8},
    "r4": {"window": 32},
    "qevict-nopromo": {"promotion": False},
    "qevict-restkv": {"ranking": "restkv"},  # ReST-KV output-change ranking of the prompt's windows
}


def available_methods() -> list[str]:
    """Names accepted by ``make_method``: Full-KV, QEvict and its variants, every baseline."""
    from qevict_jax.baselines import BASELINES

    return ["full", *_VARIANTS, *BASELINES]


def make_method(
    name: str, budget: float = 0.2, question_agnostic: bool = False, **overrides: Any
) -> KVMethod:
    """The named method at byte budget ``budget`` (fraction of Full-KV); ``overrides`` replace any
    ``CacheConfig`` field (e.g. ``window=16, ranking="decayed"``).

    question_agnostic: prompt-based baselines (``baselines.PROMPT_METHODS``) compress the context only and
    append the question uncompressed; the cache then reserves ``question_capacity`` (default 256) tokens
    for it and ``init_cache`` needs ``context_lengths``.
    """
    from qevict_jax.baselines import BASELINES, PROMPT_METHODS

    if name == "full":
        return FullKV()
    if name not in _VARIANTS and name not in BASELINES:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    fields = {f.name for f in dataclasses.fields(CacheConfig)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"unknown cache option(s) {sorted(unknown)}; known: {sorted(fields)}")
    if question_agnostic and name not in PROMPT_METHODS:
        raise ValueError(
            f"question-agnostic mode is for the prompt-compressing methods {', '.join(PROMPT_METHODS)}, not {name!r}"
        )
    if name in BASELINES:
        base = BASELINES[name]
        extra = {"question_capacity": 256} if question_agnostic else {}
        cfg = dataclasses.replace(base.cache, budget=budget, **{**extra, **overrides})
        method = dataclasses.replace(base, cache=cfg)
        return dataclasses.replace(method, question_agnostic=True) if question_agnostic else method
    cfg = CacheConfig(**{**_VARIANTS[name], "budget": budget, **overrides})
    return QEvict(name=name, cache=cfg)


def cache_stats(cache: TieredCache) -> dict[str, Any]:
    """Routing counters and tier fill of a stacked cache (leading [L] axis).

    routing_events: per row, decode routing events (every layer routes together: layer 0's count).
    promotions, demotions, evictions: per row, summed over layers (windows; prefill evictions included).
    f_fill, q_fill: occupied F slots / NF and active Q windows / NQ, mean over layers and rows (nan when
    the tier has no slot). dormant: dormant ledger entries, summed over layers and rows.
    local_tokens: per row, tokens in the ring not yet routed (layer 0).
    """
    caps = cache.caps
    fp_win = np.asarray(cache.fp_win)
    led_win = np.asarray(cache.led_win)
    active = np.asarray(cache.led_active)
    per_row = lambda x: np.asarray(x).sum(axis=0).tolist()
    length = np.asarray(cache.length[0])
    routed_end = caps.sink + np.asarray(cache.next_win[0]) * caps.window
    return {
        "routing_events": np.asarray(cache.routing_events[0]).tolist(),
        "promotions": per_row(cache.promotions),
        "demotions": per_row(cache.demotions),
        "evictions": per_row(cache.evictions),
        "f_fill": float((fp_win >= 0).mean()) if caps.nf else float("nan"),
        "q_fill": float(active.sum(-1).mean() / caps.nq) if caps.nq else float("nan"),
        "dormant": int(((led_win >= 0) & ~active).sum()),
        "local_tokens": np.maximum(0, length - np.maximum(routed_end, caps.sink)).tolist(),
        "nf": caps.nf,
        "nq": caps.nq,
        "nl": caps.nl,
    }
