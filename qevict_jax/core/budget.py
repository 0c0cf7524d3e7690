"""The budget solver (docs/design.md §3): static buffer sizes (``config.Capacities``) such that the summed ``nbytes`` of
every array of the cache pytree, metadata, scores and counters included, is at most the byte budget.

Sizes are measured on the abstract cache (``jax.eval_shape`` of the real constructor), so the solver and the
allocated cache cannot disagree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax.numpy as jnp

from models.config import ModelConfig
from qevict_jax.core.cache import abstract_cache
from qevict_jax.core.config import CacheConfig, Capacities, num_windows, ring_capacity
from qevict_jax.core.kv import CacheRequest, cache_nbytes, full_kv_bytes
from qevict_jax.core.q_keys import q_key


def sized(cache_cfg: CacheConfig, *, window: int | None = None, **sizes: Any) -> Capacities:
    """``Capacities`` with the configuration's sink, window (unless given), code width and Ω, and ``sizes``
    (the F, Q and ledger slots and the window ids default to none)."""
    w = cache_cfg.window if window is None else window
    sizes = {"nf": 0, "nq": 0, "nl": 0, "nw_max": 0, **sizes}
    return Capacities(sink=cache_cfg.sink, window=w, bits=cache_cfg.bits, omega=cache_cfg.omega, **sizes)


def resolve_recent(cfg: CacheConfig, budget_tokens_capacity: float) -> int:
    """R in tokens: the int as given, or the fraction of the budget's token capacity (a multiple of W)."""
    if isinstance(cfg.recent, float):
        return int(cfg.recent * budget_tokens_capacity) // cfg.window * cfg.window
    return int(cfg.recent)


def _cache_bytes(caps: Capacities, model_cfg: ModelConfig, batch: int, dtype: Any) -> int:
    return cache_nbytes(abstract_cache(caps, model_cfg, batch, dtype))


def solve_capacities(
    cache_cfg: CacheConfig,
    model_cfg: ModelConfig,
    batch: int,
    budget_tokens: int,
    dtype: Any,
    max_windows: int | None = None,
) -> Capacities:
    """Choose NF, NQ, NL (and R, ring) so the whole cache pytree fits the byte budget.

    budget = ``cache_cfg.budget_bytes * batch`` when set, else ``β * full_kv_bytes(budget_tokens)`` (batch
    included). The fixed part (sinks, ring, ring scores, per-row counters) is subtracted first; ``q_frac`` of
    the rest buys ledger slots, the remainder F slots. Nothing else depends on ``budget_tokens``, so at a
    fixed ``budget_bytes`` NF and NQ do not change with the sequence length (unless ``max_windows`` caps
    them: more slots than windows that can exist would be allocated and never used).
    Raises ``BudgetTooSmallError`` (a ValueError naming the minimum β) when sink + recent + one window
    do not fit.
    """
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    itemsize = jnp.dtype(dtype).itemsize
    full = full_kv_bytes(model_cfg, budget_tokens, dtype, batch)
    if cache_cfg.budget_bytes is not None:
        budget = int(cache_cfg.budget_bytes) * batch
    else:
        budget = int(math.floor(cache_cfg.budget * full))
    token_capacity = budget / (batch * model_cfg.kv_bytes_per_token(itemsize))
    w = cache_cfg.window
    recent = resolve_recent(cache_cfg, token_capacity)
    ring = ring_capacity(recent, w, cache_cfg.omega)
    nw = num_windows(budget_tokens, cache_cfg.sink, w) if max_windows is None else max_windows

    def caps(nf: int, nq: int, nl: int) -> Capacities:
        return sized(
            cache_cfg,
            recent=recent,
            ring=ring,
            nf=nf,
            nq=nq,
            nl=nl,
            nw_max=nw,
            quant=cache_cfg.quant,
            deferred_head_mean=cache_cfg.deferred_head_mean,
            q_rank=q_key(cache_cfg.q_rank),
            q_logit_bias=cache_cfg.q_logit_bias,
            q_biased_mass=cache_cfg.q_biased_mass,
            q_bias_gate=cache_cfg.q_bias_gate,
        )

    fixed = _cache_bytes(caps(0, 0, 0), model_cfg, batch, dtype)
    per_f = _cache_bytes(caps(1, 0, 0), model_cfg, batch, dtype) - fixed
    per_l = _cache_bytes(caps(0, 1, 1), model_cfg, batch, dtype) - fixed
    q = cache_cfg.q_frac
    # the least historical budget that buys one window in F or in Q
    need = min(per_f / (1 - q) if q < 1 else math.inf, per_l / q if q > 0 else math.inf)
    hist = budget - fixed
    if hist < need:
        raise BudgetTooSmallError(
            budget_bytes=budget,
            min_bytes=int(math.ceil(fixed + need)),
            full_bytes=full,
            holds=f"{cache_cfg.sink} sink tokens, the recent region (ring of {ring} tokens for R={recent}) "
            f"and one window of W={w}",
        )
    q_bytes = int(q * hist)
    nf = (hist - q_bytes) // per_f
    nl = q_bytes // per_l
    nf = min(nf, nw)
    # one window never has more than one ledger entry: every slot can serve Q while no dormant copy needs it
    nl = nq = min(nl, nw)
    result = caps(nf, nq, nl)
    total = _cache_bytes(result, model_cfg, batch, dtype)
    if total > budget:  # the cache is linear in nf and nl, so this cannot happen
        raise AssertionError(f"solver overshoot: {total} > {budget} bytes for {result}")
    return result


def budget_bytes_of(
    cache_cfg: CacheConfig, model_cfg: ModelConfig, batch: int, budget_tokens: int, dtype
) -> int:
    """The byte budget: ``budget_bytes * batch`` when set, else ``floor(β * full_kv_bytes(budget_tokens))``."""
    if cache_cfg.budget_bytes is not None:
        return int(cache_cfg.budget_bytes) * batch
    return int(math.floor(cache_cfg.budget * full_kv_bytes(model_cfg, budget_tokens, dtype, batch)))


def keep_all_capacities(cache_cfg: CacheConfig, max_windows: int | None) -> Capacities:
    """KIVI-style keep-everything mode: the Q tier has a slot for every window the sequence can have, no F
    tier, no dormant reserve; the byte budget does not apply (the measured size is what it is)."""
    if max_windows is None:
        raise ValueError("keep_all capacities need max_windows (the windows of prompt + new tokens)")
    recent = int(cache_cfg.recent) if not isinstance(cache_cfg.recent, float) else 0
    if isinstance(cache_cfg.recent, float):
        raise ValueError("keep_all needs an integer recent region")
    ring = ring_capacity(recent, cache_cfg.window, cache_cfg.omega)
    n = max_windows
    return sized(cache_cfg, recent=recent, ring=ring, nq=n, nl=n, nw_max=n, quant=cache_cfg.quant)


class BudgetTooSmallError(ValueError):
    """The byte budget cannot hold a method's fixed part (sinks, the recent region) and one unit of history.

    budget_bytes: the budget (batch included); min_bytes: the least budget that fits; full_bytes: the
    uncompressed cache of the tokens the budget was computed for; holds: what the least budget holds.
    """

    def __init__(self, *, budget_bytes: int, min_bytes: int, full_bytes: int, holds: str):
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        self.full_bytes = full_bytes
        self.holds = holds
        super().__init__(
            f"budget too small: {budget_bytes} bytes cannot hold {holds}; the minimum budget for this model, "
            f"batch and length is beta >= {self.min_beta:.4f} ({min_bytes} bytes)"
        )

    @property
    def min_beta(self) -> float:
        """The least β that fits, rounded up to 4 decimals."""
        return math.ceil(self.min_bytes / self.full_bytes * 1e4) / 1e4


def _fixed_and_unit_bytes(
    caps: Callable[[int], Capacities],
    *,
    unit: int,
    bytes_of: Callable[[Capacities], int],
    budget: int,
    full: int,
    holds: str,
) -> tuple[int, int]:
    """(bytes of ``caps(0)``, bytes one more ``unit`` adds) of a cache whose size is linear in its one free
    capacity; ``BudgetTooSmallError`` (naming what the smallest cache ``holds``) when not even one unit fits."""
    fixed = bytes_of(caps(0))
    per = bytes_of(caps(unit)) - fixed
    if fixed + per > budget:
        raise BudgetTooSmallError(budget_bytes=budget, min_bytes=fixed + per, full_bytes=full, holds=holds)
    return fixed, per


def solve_local_capacities(
    cache_cfg: CacheConfig, model_cfg: ModelConfig, batch: int, budget_tokens: int, dtype: Any
) -> Capacities:
    """Sinks + the largest recent region that fits the budget (StreamingLLM): no F, Q or pool slots.

    R is the largest multiple of W for which the whole pytree (sinks, ring of ``ring_capacity(R)`` slots,
    scores, counters) fits; the ring holds R to R + Ω + W - 1 tokens between routing events.
    """
    budget = budget_bytes_of(cache_cfg, model_cfg, batch, budget_tokens, dtype)
    full = full_kv_bytes(model_cfg, budget_tokens, dtype, batch)
    w = cache_cfg.window

    def caps(r: int) -> Capacities:
        ring = ring_capacity(r, w, cache_cfg.omega)
        return sized(cache_cfg, recent=r, ring=ring, quant=cache_cfg.quant)

    bytes_of = functools.partial(_cache_bytes, model_cfg=model_cfg, batch=batch, dtype=dtype)
    fixed, per_w = _fixed_and_unit_bytes(
        caps,
        unit=w,
        bytes_of=bytes_of,
        budget=budget,
        full=full,
        holds=f"{cache_cfg.sink} sinks and one window",
    )
    r = (budget - fixed) // per_w * w
    while r > 0 and bytes_of(caps(r)) > budget:
        r -= w
    return caps(r)


def solve_pool_capacities(
    cache_cfg: CacheConfig,
    model_cfg: ModelConfig,
    batch: int,
    budget_tokens: int,
    dtype: Any,
    *,
    max_new_tokens: int,
    max_selectable: int,
) -> Capacities:
    """Capacities of the per-KV-head token pool (eviction baselines, W = 1).

    Fixed part: sinks, the ring (recent R + Ω for decode-time eviction; R + every token after the prompt
    for compress-once caches), ring scores and counters. The rest of the byte budget buys
    pool slots, ``Hkv`` at a time (one per KV head: K and V of one head, position, owner head, score), at
    most ``max_selectable`` per head (more could never be filled).
    """
    budget = budget_bytes_of(cache_cfg, model_cfg, batch, budget_tokens, dtype)
    full = full_kv_bytes(model_cfg, budget_tokens, dtype, batch)
    itemsize = jnp.dtype(dtype).itemsize
    recent = resolve_recent(cache_cfg, budget / (batch * model_cfg.kv_bytes_per_token(itemsize)))
    ring = recent + max_new_tokens if cache_cfg.static else ring_capacity(recent, 1, cache_cfg.omega)

    def caps(slots_per_head: int) -> Capacities:
        return sized(
            cache_cfg,
            window=1,
            recent=recent,
            ring=ring,
            pool_per_head=slots_per_head,
            pool_scores=not cache_cfg.static,
            decode_routing=not cache_cfg.static,
            pool=True,
        )

    bytes_of = functools.partial(_cache_bytes, model_cfg=model_cfg, batch=batch, dtype=dtype)
    holds = f"{cache_cfg.sink} sinks, the ring of {ring} tokens (R={recent}) and one pool slot per head"
    fixed, per = _fixed_and_unit_bytes(caps, unit=1, bytes_of=bytes_of, budget=budget, full=full, holds=holds)
    slots_per_head = min((budget - fixed) // per, max(1, max_selectable))
    result = caps(slots_per_head)
    if bytes_of(result) > budget:  # linear in slots_per_head: cannot happen
        raise AssertionError(f"solver overshoot for {result}")
    return result


def pyramid_layer_caps(mean: float, num_layers: int, prefix: int, beta: float) -> tuple[int, ...]:
    """PyramidKV per-layer budgets (arXiv 2406.02069; kvpress ``PyramidKVPress.get_layer_budget``).

    ``mean`` selected tokens per head and layer on average over a prefix of ``prefix`` tokens (observation
    window excluded): ``min = mean / beta``, ``max = 2 mean - min`` (clipped to the prefix, then
    ``min = 2 mean - max``), layer l gets ``round(max - l (max - min) / (L - 1))``. Falls back to the
    uniform ``round(mean)`` when ``max < min``.
    """
    lo = mean / beta
    hi = 2 * mean - lo
    if hi >= prefix:
        hi = prefix
        lo = 2 * mean - hi
    if not hi >= lo >= 0 or num_layers < 2:
        return tuple(int(round(mean)) for _ in range(num_layers))
    steps = (hi - lo) / (num_layers - 1)
    return tuple(int(round(hi - layer * steps)) for layer in range(num_layers))


# ------------------------------------------------------------------------------------ window-engine allocations


class WindowAllocation(Protocol):
    """How a window-engine method turns its byte budget into static capacities (``Capacities``).

    uses_budget: the capacities depend on the budget (False: the method keeps what it keeps, and its
    measured memory is reported as it is).
    """

    uses_budget: ClassVar[bool]

    def capacities(self, cache_cfg: CacheConfig, request: CacheRequest) -> Capacities: ...


@dataclasses.dataclass(frozen=True)
class BudgetedTiers:
    """F and Q windows bought with what the budget leaves after sinks and ring (``solve_capacities``):
    QEvict and R1-R4. The slots are capped at the windows a row of ``request.max_tokens`` can have."""

    uses_budget: ClassVar[bool] = True

    def capacities(self, cache_cfg: CacheConfig, request: CacheRequest) -> Capacities:
        r = request
        max_windows = num_windows(r.max_tokens, cache_cfg.sink, cache_cfg.window)
        return solve_capacities(
            cache_cfg, r.model_cfg, r.batch, r.budget_tokens, r.dtype, max_windows=max_windows
        )


@dataclasses.dataclass(frozen=True)
class RecentOnly:
    """Sinks and the largest recent region the budget holds, no F or Q slots (``solve_local_capacities``):
    StreamingLLM."""

    uses_budget: ClassVar[bool] = True

    def capacities(self, cache_cfg: CacheConfig, request: CacheRequest) -> Capacities:
        r = request
        return solve_local_capacities(cache_cfg, r.model_cfg, r.batch, r.budget_tokens, r.dtype)


@dataclasses.dataclass(frozen=True)
class KeepAll:
    """A Q slot for every window the sequence can have, nothing evicted, no budget
    (``keep_all_capacities``): KIVI."""

    uses_budget: ClassVar[bool] = False

    def capacities(self, cache_cfg: CacheConfig, request: CacheRequest) -> Capacities:
        return keep_all_capacities(
            cache_cfg, num_windows(request.max_tokens, cache_cfg.sink, cache_cfg.window)
        )
