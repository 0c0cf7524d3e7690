"""Static cache configuration and the budget solver (DESIGN §3).

``CacheConfig`` is frozen and hashable (a static ``jax.jit`` argument). ``solve_capacities`` turns it into
static buffer sizes (``Capacities``) such that the summed ``nbytes`` of every array of the cache pytree,
metadata, scores and counters included, is at most the byte budget. Sizes are measured on the abstract cache
(``jax.eval_shape`` of the real constructor), so the solver and the allocated cache cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from qevict_jax.kv import full_kv_bytes

RANKINGS = ("cumulative", "cumulative-all", "decayed", "pnorm", "keynorm", "restkv")
LAYOUTS = ("tiered", "pool", "local", "keep_all")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Configuration of the tiered cache (QEvict and every variant built on the same machinery).

    sink: first tokens always kept in full precision.
    window: W, tokens per window (the unit of ranking and migration).
    recent: R, tokens of the recent region kept in full precision; an int (a multiple of W), or a float in
        (0, 1) meaning that fraction of the budget's token capacity (rounded down to a multiple of W).
    omega: Ω, decode steps between routing events.
    q_frac: share of the historical bytes (budget minus sink, ring and fixed metadata) given to the Q tier
        (ledger, dormant entries included); the rest goes to F. 0 disables the Q tier.
    bits: 2 or 4, code width of the Q tier.
    budget: β, the byte budget as a fraction of the uncompressed cache of ``budget_tokens`` tokens.
    budget_bytes: when set, the byte budget per batch row (all layers), overriding ``budget``.
    ranking: "cumulative" (attention mass summed per window, initialized from the observation window: the
        default), "cumulative-all" (initialized from every prompt query, H2O-style: ablation), "decayed"
        (exponentially decayed attention), "pnorm" (sum over queries of window mass to the power ``p``),
        "keynorm" (low key norm = important), "restkv" (ReST-KV output-change score at prefill).
    n_obs: observation window: the last ``n_obs`` prompt queries whose attention initializes the scores.
    pool: max-pool kernel over neighbouring tokens of the observation rows (SnapKV-style; 0 = none).
    decay: per-query decay factor of the "decayed" ranking.
    p: exponent of the "pnorm" ranking.
    promotion: allow Q -> F promotions at routing.
    prefill_chunk: query chunk of the prefill attention.
    kernel: decode attention of the tiered layout through the Pallas kernels (``pallas_kernels``): None =
        only on a GPU, True = always (interpret mode off a GPU: slow, for tests), False = jnp reference.
    layout: which tiers hold the history (one cache pytree, ``tiered.TieredCache``, for every layout):
        "tiered": F + Q windows (QEvict, R1-R4); "pool": a per-KV-head token pool (W = 1; each slot records
        its owner KV head; the eviction baselines); "local": sinks + recent region only, the recent region
        grown to fill the budget (StreamingLLM); "keep_all": every window that leaves the recent region is
        quantized into the Q tier and nothing is evicted (KIVI; the budget does not apply).
    static: compress once after prefill (no decode-time routing; the ring is sized to also hold every
        token after the prompt: an appended question or turn, and the decoded tokens). Pool layout only.
    """

    sink: int = 5
    window: int = 8
    recent: int | float = 128
    omega: int = 8
    q_frac: float = 0.70
    bits: int = 2
    budget: float = 0.2
    budget_bytes: int | None = None
    ranking: str = "cumulative"
    n_obs: int = 32
    pool: int = 0
    decay: float = 0.98
    p: float = 3.0
    promotion: bool = True
    prefill_chunk: int = 512
    layout: str = "tiered"
    kernel: bool | None = None
    static: bool = False

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; available: {', '.join(LAYOUTS)}")
        if self.layout == "pool" and self.window != 1:
            raise ValueError("the pool layout is token-level: window must be 1")
        if self.static and self.layout != "pool":
            raise ValueError("static (compress-once) caches need the pool layout")
        if self.bits not in (2, 4):
            raise ValueError(f"bits must be 2 or 4, got {self.bits}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0, got {self.sink}")
        if self.omega < 1:
            raise ValueError(f"omega must be >= 1, got {self.omega}")
        if not 0.0 <= self.q_frac <= 1.0:
            raise ValueError(f"q_frac must be in [0, 1], got {self.q_frac}")
        per_byte = 8 // self.bits
        if self.q_frac > 0 and self.window % per_byte:
            raise ValueError(
                f"window W={self.window} must be a multiple of {per_byte} for INT{self.bits} codes "
                f"(codes of one channel are packed {per_byte} per byte along the window); "
                f"use q_frac=0 to run without the Q tier"
            )
        if isinstance(self.recent, float):
            if not 0.0 < self.recent < 1.0:
                raise ValueError(
                    f"a float recent is a fraction of the budget and must be in (0, 1), got {self.recent}"
                )
        elif self.recent < 0 or self.recent % self.window:
            raise ValueError(
                f"recent={self.recent} must be a non-negative multiple of the window W={self.window}"
            )
        if self.budget_bytes is None and not self.budget > 0:
            raise ValueError(f"budget must be > 0, got {self.budget}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {self.budget_bytes}")
        if self.ranking not in RANKINGS:
            raise ValueError(f"unknown ranking {self.ranking!r}; available: {', '.join(RANKINGS)}")
        if self.n_obs < 1:
            raise ValueError(f"n_obs must be >= 1, got {self.n_obs}")
        if self.pool < 0:
            raise ValueError(f"pool must be >= 0 (0 = no pooling), got {self.pool}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")


@dataclasses.dataclass(frozen=True)
class Capacities:
    """Static buffer sizes of one layer's tiered cache (hashable; stored as a static field of the cache).

    sink: S sink slots. window: W. recent: R tokens. ring: local ring slots (a multiple of W).
    nf: F slots. nl: ledger slots, shared by the active Q entries and the dormant copies of promoted
    windows (an F window's first-demotion codes, kept while it is in F). nq: the most active Q windows;
    the Q tier holds ``min(nq, nl - dormant entries)`` at a routing event (``routing.plan_routing``).
    nw_max: number of window ids a sequence of the sized length can have (caps nf and nq).
    bits: code width. omega: routing interval.
    pool_per_head: token slots per KV head of the head pool (pool layout; 0 otherwise); the pool has
        ``Hkv * pool_per_head`` slots per layer and row.
    pool_scores: the pool keeps per-slot and per-ring-token scores (decode-time eviction).
    decode_routing: route at decode time (False: compressed once after prefill).
    layer_caps: per-layer number of pool slots per head actually filled at prefill (PyramidKV); empty =
        ``pool_per_head`` for every layer.
    """

    sink: int
    window: int
    recent: int
    ring: int
    nf: int
    nq: int
    nl: int
    nw_max: int
    bits: int
    omega: int
    pool_per_head: int = 0
    pool_scores: bool = False
    decode_routing: bool = True
    layer_caps: tuple[int, ...] = ()

    @property
    def ring_windows(self) -> int:
        """Window slots of the ring (each holds the running score of one window id)."""
        return self.ring // self.window

    @property
    def max_candidates(self) -> int:
        """Upper bound on the windows that can leave the recent region between two routing events."""
        return (self.ring - self.recent) // self.window


def ring_capacity(recent: int, window: int, omega: int) -> int:
    """Slots of the local ring: ``R + W * ceil((Ω + W - 1) / W)``.

    Right after routing the ring holds fewer than R + W tokens (every window that ended at least R tokens
    ago has left it); the next Ω decode tokens arrive before the next routing event, so the ring must hold
    ``R + W - 1 + Ω`` tokens without overwriting an unrouted window. It is a multiple of W so that a window
    never wraps around the end of the ring.
    """
    return recent + window * (-(-(omega + window - 1) // window))


def num_windows(num_tokens: int, sink: int, window: int) -> int:
    """Window ids that a sequence of ``num_tokens`` tokens can touch: ceil((T - S) / W), at least 0."""
    return max(0, -(-(num_tokens - sink) // window))


def resolve_recent(cfg: CacheConfig, budget_tokens_capacity: float) -> int:
    """R in tokens: the int as given, or the fraction of the budget's token capacity (a multiple of W)."""
    if isinstance(cfg.recent, float):
        return int(cfg.recent * budget_tokens_capacity) // cfg.window * cfg.window
    return int(cfg.recent)


def _cache_bytes(caps: Capacities, model_cfg: ModelConfig, batch: int, dtype: Any) -> int:
    from qevict_jax.tiered import abstract_cache  # tiered imports this module

    leaves = jax.tree.leaves(abstract_cache(caps, model_cfg, batch, dtype))
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))


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
    Raises ValueError naming the minimum β when sink + recent + one window do not fit.
    """
    if cache_cfg.layout == "keep_all":
        return keep_all_capacities(cache_cfg, max_windows)
    if budget_tokens < 1:
        raise ValueError(f"budget_tokens must be >= 1, got {budget_tokens}")
    if cache_cfg.layout != "tiered":
        raise ValueError(
            f"use solve_pool_capacities / solve_local_capacities for layout {cache_cfg.layout!r}"
        )
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
        return Capacities(cache_cfg.sink, w, recent, ring, nf, nq, nl, nw, cache_cfg.bits, cache_cfg.omega)

    fixed = _cache_bytes(caps(0, 0, 0), model_cfg, batch, dtype)
    per_f = _cache_bytes(caps(1, 0, 0), model_cfg, batch, dtype) - fixed
    per_l = _cache_bytes(caps(0, 1, 1), model_cfg, batch, dtype) - fixed
    q = cache_cfg.q_frac
    # the least historical budget that buys one window in F or in Q
    need = min(per_f / (1 - q) if q < 1 else math.inf, per_l / q if q > 0 else math.inf)
    hist = budget - fixed
    if hist < need:
        min_beta = (fixed + need) / full
        min_beta = math.ceil(min_beta * 1e4) / 1e4
        raise ValueError(
            f"budget too small: {budget} bytes cannot hold {cache_cfg.sink} sink tokens, the recent region "
            f"(ring of {ring} tokens for R={recent}) and one window of W={w}; the minimum budget for this "
            f"model, batch and length is beta >= {min_beta:.4f} ({int(math.ceil(fixed + need))} bytes)"
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
    return Capacities(
        cache_cfg.sink,
        cache_cfg.window,
        recent,
        ring,
        0,
        max_windows,
        max_windows,
        max_windows,
        cache_cfg.bits,
        cache_cfg.omega,
    )


def _fit_error(cache_cfg, budget: int, fixed: int, need: int, full: int, what: str) -> ValueError:
    min_beta = math.ceil((fixed + need) / full * 1e4) / 1e4
    return ValueError(
        f"budget too small: {budget} bytes cannot hold {what}; the minimum budget for this model, batch and "
        f"length is beta >= {min_beta:.4f} ({int(math.ceil(fixed + need))} bytes)"
    )


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
        return Capacities(cache_cfg.sink, w, r, ring, 0, 0, 0, 0, cache_cfg.bits, cache_cfg.omega)

    fixed = _cache_bytes(caps(0), model_cfg, batch, dtype)
    per_w = _cache_bytes(caps(w), model_cfg, batch, dtype) - fixed
    if fixed + per_w > budget:
        raise _fit_error(cache_cfg, budget, fixed, per_w, full, f"{cache_cfg.sink} sinks and one window")
    r = (budget - fixed) // per_w * w
    while r > 0 and _cache_bytes(caps(r), model_cfg, batch, dtype) > budget:
        r -= w
    return caps(r)


def solve_pool_capacities(
    cache_cfg: CacheConfig,
    model_cfg: ModelConfig,
    batch: int,
    budget_tokens: int,
    dtype: Any,
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

    def caps(pph: int) -> Capacities:
        return Capacities(
            cache_cfg.sink,
            1,
            recent,
            ring,
            0,
            0,
            0,
            0,
            cache_cfg.bits,
            cache_cfg.omega,
            pool_per_head=pph,
            pool_scores=not cache_cfg.static,
            decode_routing=not cache_cfg.static,
        )

    fixed = _cache_bytes(caps(0), model_cfg, batch, dtype)
    per = _cache_bytes(caps(1), model_cfg, batch, dtype) - fixed
    if fixed + per > budget:
        raise _fit_error(
            cache_cfg,
            budget,
            fixed,
            per,
            full,
            f"{cache_cfg.sink} sinks, the ring of {ring} tokens (R={recent}) and one pool slot per head",
        )
    pph = min((budget - fixed) // per, max(1, max_selectable))
    result = caps(pph)
    if _cache_bytes(result, model_cfg, batch, dtype) > budget:  # linear in pph: cannot happen
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
