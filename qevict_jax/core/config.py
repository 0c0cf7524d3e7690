"""Static cache configuration (docs/design.md §4): ``CacheConfig`` (what a method asks for) and ``Capacities`` (the
static buffer sizes ``qevict_jax.core.budget`` solves for). Both are frozen and hashable (static ``jax.jit``
arguments).
"""

from __future__ import annotations

import dataclasses

from pallas_kernels.formats import QUANT_NAMES, ChannelKeys, QuantFormat, quant_format
from qevict_jax.core.bounds import Bound, check_bounds
from qevict_jax.core.q_keys import BY_SCORE, QKey, available_q_keys, q_key

CACHE_BOUNDS = (
    Bound("bits", lambda v: v in (2, 4), "2 or 4"),
    Bound("window", lambda v: v >= 1, ">= 1"),
    Bound("sink", lambda v: v >= 0, ">= 0"),
    Bound("omega", lambda v: v >= 1, ">= 1"),
    Bound("q_frac", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    Bound("budget_bytes", lambda v: v is None or v > 0, "> 0"),
    Bound("n_obs", lambda v: v >= 1, ">= 1"),
    Bound("max_pool_width", lambda v: v >= 0, ">= 0 (0 = no pooling)"),
    Bound("spill", lambda v: v >= 0, ">= 0 (0 = none)"),
    Bound("q_spill", lambda v: v is None or v >= 0, ">= 0 (0 = none) or None (= spill)"),
    Bound("q_logit_bias", lambda v: -1e4 <= v <= 0.0, "in [-1e4, 0] (0 = none)"),
    Bound("q_bias_gate", lambda v: v is None or v >= 0.0, ">= 0 or None (the discount on every head)"),
    Bound("decay", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    Bound("prefill_chunk", lambda v: v >= 1, ">= 1"),
)
"""The ranges of ``CacheConfig``'s numeric fields (the checks across fields are in its ``__post_init__``)."""


def cache_option_rule(name: str) -> str:
    """The valid values of ``CacheConfig`` field ``name`` in words (its range or choices; "" when free)."""
    choices = {"q_rank": available_q_keys(), "quant": QUANT_NAMES}
    if name in choices:
        return "one of " + ", ".join(choices[name])
    if name == "budget":
        return "in (0, 1]"
    return next((b.rule for b in CACHE_BOUNDS if b.field == name), "")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """What a method asks of its cache, for either engine (the method chooses the engine and how the budget
    is allocated: ``methods``; options a method's engine does not read are left at their defaults).

    sink: first tokens always kept in full precision.
    window: W, tokens per window (the unit of ranking and migration).
    recent: R, tokens of the recent region kept in full precision; an int (a multiple of W), or a float in
        (0, 1) meaning that fraction of the budget's token capacity (rounded down to a multiple of W).
    omega: Ω, decode steps between routing events.
    q_frac: share of the historical bytes (budget minus sink, ring and fixed metadata) given to the Q tier
        (ledger, dormant entries included); the rest goes to F. 0 disables the Q tier.
    bits: 2 or 4, code width of the Q tier in the "channel" format.
    quant: the Q tier's format (``pallas_kernels.formats.quant_format``): "channel" (pre-RoPE keys with a grid
        per channel over the window, values per token, ``bits`` wide: KIVI's), "kch2-rotvY" (those keys at 2
        bits, values rotated by a fixed Hadamard matrix, a grid per token, Y bits), "rot-kXvY" (post-RoPE
        keys and values rotated, a grid per token, X / Y bits) or "crot-kXvY" (the same, with each window's
        pre-RoPE key mean kept in f16 and taken out of its keys first).
    budget: β, the byte budget as a fraction of the uncompressed cache of ``budget_tokens`` tokens.
    budget_bytes: when set, the byte budget per batch row (all layers), overriding ``budget``.
    ranking: "cumulative" (attention mass summed per window, initialized from the observation window: the
        default), "cumulative-all" (initialized from every prompt query, H2O-style: ablation), "decayed"
        (exponentially decayed attention), "pnorm" (sum over queries of window mass to the power ``p``),
        "headmax" (the observation mass of the window's most attentive query head),
        "keynorm" (low key norm = important), "restkv" (ReST-KV output-change score at prefill); any name of
        ``rankings.scoring.available_rankings``, checked by the window method that reads it.
    q_rank: how the windows that do not make F compete for the Q tier (F is always the top NF by the
        ranking): "score" (by the ranking's key, as F), "keynorm" (by minus the window's mean key norm,
        which no query changes, spilled as the score is: a context compressed before its question keeps
        in Q what key norm keeps),
        "blend" (by the better of the two percentiles among the competitors: a window in the top of either
        stays). Not "score": each ledger entry keeps its window's key-norm score (``Ledger.norm_score``).
    n_obs: observation window: the last ``n_obs`` prompt queries whose attention initializes the scores.
    max_pool_width: max-pool width over neighbouring tokens of the observation rows (SnapKV-style; 0 = none).
    spill: tokens after a window whose windows are ranked with its score when it is higher (the
        ``ceil(spill / W)`` windows covering them; 0 = none), at prefill placement and at every routing
        event (``windows.spilled_key``): attention points at where an answer starts, and the continuation
        read next stays in the same tier. The stored scores stay each window's own.
    q_spill: the spill of the Q tier's key (``q_rank``) among the windows that miss F, in tokens; None: the
        same as ``spill``. F can then keep a longer continuation of what attention points at without
        spreading the Q tier's key-norm ranking over more windows.
    q_logit_bias: added to the attention logits of every Q-tier key at decode (<= 0; 0 = none): the Q
        tier's share of each softmax is scaled by ``exp(q_logit_bias)``, so the low-bit windows, chosen
        because F could not hold them, sway the output only where their keys clearly match better than the
        full-precision tiers'. The bytes are unchanged.
    q_biased_mass: the scores take the attention mass of the biased softmax (True), or of the softmax
        without ``q_logit_bias`` (False: a Q window's promotion is judged by how its keys match alone).
    q_bias_gate: None: ``q_logit_bias`` applies to every query head at every step; a margin g >= 0: only
        to the heads whose best F-tier logit exceeds their best Q-tier logit by more than g. A head whose best
        historical match is a Q key (a question about a window F could not hold) reads the Q tier
        undiscounted. Needs ``q_logit_bias`` < 0.
    decay: per-query decay factor of the "decayed" ranking.
    p: exponent of the "pnorm" ranking.
    promotion: allow Q -> F promotions at routing.
    prefill_chunk: query chunk of the prefill attention.
    pallas: decode attention of the window engine through the Pallas kernels (``pallas_kernels``): None =
        only on a GPU, True = always (interpret mode off a GPU: slow, for tests), False = jnp reference.
    static: compress once after prefill (no decode-time routing; the ring is sized to also hold every
        token after the prompt: an appended question or turn, and the decoded tokens). Token pool only.
    deferred_head_mean: keep each decode step's attention masses per KV head (running masses of Hkv f32
        per scored entry, in the cache and its bytes) and take their head mean at the next routing event
        instead of every step. The scores at each routing event are the same (up to float rounding) for a
        ranking linear in the mass (``ScoreDynamics.linear_in_mass``); on a mesh that splits the KV heads
        over "model", a decode step without a routing event then moves no mass between devices
        (docs/multi-device.md). Window engine only.
    """

    sink: int = 5
    window: int = 8
    recent: int | float = 128
    omega: int = 8
    q_frac: float = 0.70
    bits: int = 2
    quant: str = "channel"
    budget: float = 0.2
    budget_bytes: int | None = None
    ranking: str = "cumulative"
    q_rank: str = "score"
    n_obs: int = 32
    max_pool_width: int = 0
    spill: int = 8
    q_spill: int | None = None
    q_logit_bias: float = 0.0
    q_biased_mass: bool = True
    q_bias_gate: float | None = None
    decay: float = 0.98
    p: float = 3.0
    promotion: bool = True
    prefill_chunk: int = 512
    pallas: bool | None = None
    static: bool = False
    deferred_head_mean: bool = False

    def __post_init__(self) -> None:
        check_bounds(self, CACHE_BOUNDS)
        fmt = quant_format(self.quant, self.bits)
        per_byte = 8 // fmt.bits if isinstance(fmt, ChannelKeys) else 1
        if self.q_frac > 0 and isinstance(fmt, ChannelKeys) and self.window % per_byte:
            raise ValueError(
                f"window W={self.window} must be a multiple of {per_byte} for INT{fmt.bits} codes "
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
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(
                f"budget β is a fraction of the uncompressed cache's bytes and must be in (0, 1], got "
                f"{self.budget} (β = 1 keeps as many bytes as Full-KV; to size a cache in bytes set budget_bytes)"
            )
        if self.q_bias_gate is not None and not self.q_logit_bias:
            raise ValueError(
                f"q_bias_gate={self.q_bias_gate} gates the Q tier's discount, but q_logit_bias is 0 "
                f"(no discount): set q_logit_bias < 0 too, or leave q_bias_gate unset"
            )
        q_key(self.q_rank)  # an unknown name is a ValueError listing the Q keys


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capacities:
    """Static buffer sizes of one layer's tiered cache (hashable; stored as a static field of the cache).

    sink: S sink slots. window: W. recent: R tokens. ring: ring slots (a multiple of W).
    nf: F slots. nl: ledger slots, shared by the active Q entries and the dormant copies of promoted
    windows (an F window's first-demotion codes, kept while it is in F). nq: the most active Q windows;
    the Q tier holds ``min(nq, nl - dormant entries)`` at a routing event (``routing.plan_routing``).
    nw_max: number of window ids a sequence of the sized length can have (caps nf and nq).
    bits: code width of the "channel" format. omega: routing interval. quant: the Q tier's format name
        (``format`` is the object).
    pool_per_head: token slots per KV head of the head pool (token pool; 0 otherwise); the pool has
        ``Hkv * pool_per_head`` slots per layer and row.
    pool_scores: the pool keeps per-slot and per-ring-token scores (decode-time eviction).
    decode_routing: route at decode time (False: compressed once after prefill).
    layer_caps: per-layer number of pool slots per head actually filled at prefill (PyramidKV); empty =
        ``pool_per_head`` for every layer.
    pool: the cache is the token pool's (``cache.PoolCache``), else the window engine's (``TieredCache``).
    deferred_head_mean: the cache keeps per-KV-head running masses, folded into the scores at routing
        events (``CacheConfig.deferred_head_mean``).
    q_rank: how windows compete for the Q tier (``q_keys``; named by ``CacheConfig.q_rank``).
    q_logit_bias, q_biased_mass, q_bias_gate: the Q tier's logit offset at decode, whether the scores see
        it, and which heads it applies to (``CacheConfig``).
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
    pool: bool = False
    quant: str = "channel"
    deferred_head_mean: bool = False
    q_rank: QKey = BY_SCORE
    q_logit_bias: float = 0.0
    q_biased_mass: bool = True
    q_bias_gate: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.q_rank, QKey):
            raise TypeError(f"Capacities.q_rank is a Q key object (q_keys.q_key(name)), got {self.q_rank!r}")

    @property
    def norm_scored(self) -> bool:
        """The ledger keeps each window's key-norm score (the Q key reads it)."""
        return self.q_rank.reads_key_norm

    @property
    def format(self) -> QuantFormat:
        """The Q tier's format (``pallas_kernels.formats``)."""
        return quant_format(self.quant, self.bits)

    @property
    def ring_windows(self) -> int:
        """Window slots of the ring (each holds the running score of one window id)."""
        return self.ring // self.window

    @property
    def max_candidates(self) -> int:
        """Upper bound on the windows that can leave the recent region between two routing events."""
        return (self.ring - self.recent) // self.window


def ring_capacity(recent: int, window: int, omega: int) -> int:
    """Slots of the ring: ``R + W * ceil((Ω + W - 1) / W)``.

    Right after routing the ring holds fewer than R + W tokens (every window that ended at least R tokens
    ago has left it); the next Ω decode tokens arrive before the next routing event, so the ring must hold
    ``R + W - 1 + Ω`` tokens without overwriting an unrouted window. It is a multiple of W so that a window
    never wraps around the end of the ring.
    """
    return recent + window * (-(-(omega + window - 1) // window))


def num_windows(num_tokens: int, sink: int, window: int) -> int:
    """Window ids that a sequence of ``num_tokens`` tokens can touch: ceil((T - S) / W), at least 0."""
    return max(0, -(-(num_tokens - sink) // window))
