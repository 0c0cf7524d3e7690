"""Every eviction and quantization baseline as a configuration or a small policy over the two engines.

One budget definition and two cache engines serve every method. A baseline is a ranking and an allocation over
one engine, composed, not inherited:

- StreamingLLM: the window engine (``WindowMethod``) with W = 1, no Q tier and the ``RecentOnly`` allocation
  (sinks + the largest recent region that fits the budget).
- KIVI-2 / KIVI-4: the window engine with the ``KeepAll`` allocation (every 32-token window that leaves the
  128-token full-precision residual is quantized into the Q tier; nothing is evicted; the byte budget does
  not apply).
- H2O, TOVA, key-norm, SnapKV, PyramidKV, Ada-KV, CriticalKV, ReST-KV: the token-pool engine
  (``PoolMethod``): a pool of token slots per layer and row, each slot owned by one KV head, so that heads
  keep different tokens (uniform, layer-varying or head-adaptive budgets) and the memory is the pool itself.
  A policy is a ranking (``ranking``: a ``scoring`` ranking, the interface the window engine ranks its
  windows with, whose ``prefill_token_scores`` returns ``[B, Hkv, T]``, higher = keep, kvpress-style) and an
  allocation rule (``allocation``: ``pool.Allocation``, which does the top-k; the pool engine does the
  gather). Prompt-based methods compress once after prefill (``static``), decode-time methods (H2O, TOVA)
  re-rank every step with the ranking's ``update``.
- KVzip, expected attention: the token-pool engine too, question-agnostic, in ``methods.agnostic``.

Question-agnostic mode and later turns are the same for every method (``generate(question_starts=...)``,
``generate(past=...)``): the appended tokens go through the method's decode step, so a compress-once pool
keeps them uncompressed in its ring (sized for every token after the prompt).

Layer-varying budgets (PyramidKV): the decoder scans over layers, so every layer's cache slice has the same
shape. PyramidKV's pool is therefore sized for its *largest* layer (the per-layer counts are a static
``Capacities.layer_caps``; smaller layers leave slots empty) and the budget solver charges the padded pool:
at matched measured memory PyramidKV keeps fewer tokens on average than SnapKV (about 1/1.95 as many with
beta = 20). Saving the padding needs per-group caches (a scan over groups of layers with different shapes),
which the decoder does not offer.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from models.model import LayerContext
from qevict_jax.core.budget import KeepAll, RecentOnly, solve_pool_capacities
from qevict_jax.core.cache import PoolCache, SizedByCapacities
from qevict_jax.core.config import CacheConfig, Capacities
from qevict_jax.core.kv import CacheRequest
from qevict_jax.engines.pool import UNIFORM, Allocation, pool_decode_layer, pool_prefill_layer, route_pool_row
from qevict_jax.methods.full import Compressing
from qevict_jax.methods.qevict import WindowMethod
from qevict_jax.rankings.scoring import CumulativeAllRanking, KeyNormRanking, RestKVRanking, TokenRanking
from qevict_jax.rankings.token_rankings import CriticalKVRanking, SnapKVRanking, TOVARanking

# ---------------------------------------------------------------------------------------------- window layouts


def streaming_llm() -> WindowMethod:
    """StreamingLLM: attention sinks + a sliding window of recent tokens.

    Xiao et al., "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453.
    Parameters (``cache``): ``sink`` = 4 sink tokens; the recent region is as large as the byte budget allows
    (``RecentOnly``: ``budget.solve_local_capacities``); W = 1 and Ω = 1, so the oldest non-sink token
    leaves every step.
    """
    return WindowMethod(
        name="streamingllm",
        cache=CacheConfig(sink=4, window=1, omega=1, q_frac=0.0, recent=0),
        allocation=RecentOnly(),
        options=("sink", "prefill_chunk", "budget_bytes"),
        protects_recent=False,
    )


def kivi(*, bits: int) -> WindowMethod:
    """KIVI: tuning-free asymmetric 2/4-bit KV quantization, nothing evicted.

    Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", arXiv 2402.02750.
    Parameters (``cache``): ``bits`` 2 or 4; group = ``window`` = 32 tokens (keys: one grid per channel over
    the group; values: one grid per token); full-precision residual ``recent`` = 128 newest tokens; no sinks.
    Every group leaving the residual is quantized into the Q tier (``KeepAll``); the measured memory is what
    it is (no budget). Deviations: keys are quantized pre-RoPE (KVQuant-style, the shared ledger's format)
    where KIVI quantizes post-RoPE keys; a value grid spans one head's D channels (KIVI: groups of 32
    channels); the residual slides (R to R + Ω + W - 1 tokens, Ω = 8) where KIVI's fills up to R and is then
    flushed.
    """
    return WindowMethod(
        name=f"kivi{bits}",
        cache=CacheConfig(sink=0, window=32, recent=128, omega=8, q_frac=1.0, bits=bits, promotion=False),
        allocation=KeepAll(),
        options=("bits", "window", "recent", "prefill_chunk"),
        protects_recent=False,
    )


# ---------------------------------------------------------------------------------------------- head pool


@dataclasses.dataclass(frozen=True)
class PoolMethod(SizedByCapacities, Compressing, abc.ABC):
    """Shared base of the per-head token-pool baselines (the token-pool engine): sizing, prefill, decode.

    A policy is its ``ranking`` (token scores at the prompt end, their update at decode) and its
    ``allocation`` (how the slots go to the heads and the layers; uniform by default).
    """

    name: str = "pool"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=32, q_frac=0.0, static=True)
    uses_budget: ClassVar[bool] = True
    options: ClassVar[tuple[str, ...]] = ("sink", "recent", "prefill_chunk", "budget_bytes")
    protects_recent: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def ranking(self) -> TokenRanking:
        """The ranking of the pool's tokens (built from the method's options)."""

    @property
    def allocation(self) -> Allocation:
        """How the pool's slots go to the heads and the layers."""
        return UNIFORM

    def __post_init__(self) -> None:
        if self.cache.window != 1:
            raise ValueError(f"{self.name}: the token pool is token-level: window must be 1, got {self.cache.window}")
        if self.cache.deferred_head_mean:
            raise ValueError(f"{self.name}: deferred_head_mean applies to the window engine, not the token pool")

    def capacities(self, request: CacheRequest) -> Capacities:
        """Static sizes: the pool gets what the budget leaves after sinks and ring (``solve_pool_capacities``)."""
        r = request
        selectable = r.prompt_capacity if self.cache.static else r.max_tokens
        caps = solve_pool_capacities(
            self.cache,
            r.model_cfg,
            r.batch,
            r.budget_tokens,
            r.dtype,
            max_new_tokens=r.max_new_tokens,
            max_selectable=selectable,
        )
        prefix = max(1, r.budget_tokens - r.max_new_tokens - caps.recent - caps.sink)
        layer_caps = self.allocation.layer_caps(caps.pool_per_head, r.model_cfg.num_layers, prefix)
        return dataclasses.replace(caps, layer_caps=layer_caps)

    def route(self, cache: PoolCache, inv_freq: jax.Array, due: jax.Array | None = None) -> PoolCache:
        """A decode-time eviction event of every layer and row: now, or only when ``due`` [] holds, under a
        conditional (identity for compress-once pools)."""
        if not cache.caps.decode_routing:
            return cache
        ranking = self.ranking
        event = jax.vmap(jax.vmap(lambda row: route_pool_row(row, ranking)))
        return event(cache) if due is None else jax.lax.cond(due, event, lambda c: c, cache)

    def reserve(self, cache: PoolCache, total_tokens: int) -> PoolCache:
        """Decode-time pools hold any length; a compress-once pool keeps every later token in its ring and
        refuses a sequence that would overflow it."""
        caps = cache.caps
        if caps.decode_routing:
            return cache
        first_kept = caps.sink + int(jnp.min(cache.next_win))
        if total_tokens - first_kept > caps.ring:
            raise ValueError(
                f"{self.name} compresses once after the prompt and keeps every later token in its ring of "
                f"{caps.ring} tokens: {total_tokens - first_kept} would not fit (give the first call a larger "
                f"max_new_tokens to reserve room for later turns)"
            )
        return cache

    def prefill_attend(self, q, k, v, layer_cache: PoolCache, ctx: LayerContext):
        """q [B, T, H, D], k, v [B, T, Hkv, D] (post-RoPE, right-padded prompt) -> (out, layer cache)."""
        return pool_prefill_layer(
            q, k, v, layer_cache, ctx, ranking=self.ranking, allocation=self.allocation, chunk=self.cache.prefill_chunk
        )

    def decode_attend(self, q, k, v, layer_cache: PoolCache, ctx: LayerContext):
        """q [B, 1, H, D], k, v [B, 1, Hkv, D] (post-RoPE) -> (out [B, 1, H, D], layer cache)."""
        return pool_decode_layer(q, k, v, layer_cache, ctx, ranking=self.ranking)


@dataclasses.dataclass(frozen=True)
class DecodeEviction(PoolMethod, abc.ABC):
    """A pool policy that evicts during decode, every Ω steps (``omega``), by a ranking with no options of its
    own (``ranking_type``)."""

    options: ClassVar[tuple[str, ...]] = (*PoolMethod.options, "omega")
    ranking_type: ClassVar[type[TokenRanking]]

    @property
    def ranking(self) -> TokenRanking:
        return self.ranking_type()


@dataclasses.dataclass(frozen=True)
class H2O(DecodeEviction):
    """H2O: heavy hitters by cumulative attention + recent tokens, evicted at decode time.

    Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs", arXiv 2306.14048.
    Score of a token per KV head = attention it received from every query so far (prefill rows included),
    mean over the group's query heads (GQA; the ranking "cumulative-all"); ``recent`` = 0.5 of the budget's
    tokens (heavy = recent ratio); token-level (W = 1), one eviction per decode step (Ω = 1), per-head
    selection.
    """

    name: str = "h2o"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=0.5, omega=1, q_frac=0.0)
    ranking_type: ClassVar[type[TokenRanking]] = CumulativeAllRanking


@dataclasses.dataclass(frozen=True)
class TOVA(DecodeEviction):
    """TOVA: evict the token with the lowest attention from the current query, averaged over heads.

    Oren et al., "Transformers are Multi-State RNNs", arXiv 2401.06104. After the prompt the cache keeps the
    tokens the last prompt query attends to most (head mean); at every decode step the score is replaced by
    the current query's head-mean attention and the lowest token is dropped (Ω = 1, no recent region, no
    sinks). All heads keep the same tokens (one head-averaged score, stored per KV head: the ranking "tova").
    """

    name: str = "tova"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=0, omega=1, q_frac=0.0)
    ranking_type: ClassVar[type[TokenRanking]] = TOVARanking


@dataclasses.dataclass(frozen=True)
class KeyNorm(PoolMethod):
    """Key-norm: keep the keys with the lowest L2 norm, per head, once after the prompt.

    Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", arXiv
    2406.11430 (kvpress ``KnormPress``). No sinks and no protected window: every prompt token competes.
    """

    name: str = "keynorm"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=0, q_frac=0.0, static=True)

    @property
    def ranking(self) -> KeyNormRanking:
        return KeyNormRanking()


@dataclasses.dataclass(frozen=True)
class SnapKV(PoolMethod):
    """SnapKV: observation-window attention, pooled, top-k per KV head, once after the prompt.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv 2404.14469.
    n_obs: observation window (last prompt queries, kept in full as the recent region); avg_pool_width:
    average-pooling width. GQA-aware: scores are averaged over the query heads of each KV group.
    """

    name: str = "snapkv"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=32, q_frac=0.0, static=True)
    n_obs: int = 32
    avg_pool_width: int = 5
    options: ClassVar[tuple[str, ...]] = (*PoolMethod.options, "n_obs", "avg_pool_width")
    protects_recent: ClassVar[bool] = True

    @property
    def ranking(self) -> SnapKVRanking:
        return SnapKVRanking(n_obs=self.n_obs, avg_pool_width=self.avg_pool_width)


@dataclasses.dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV: SnapKV scores with layer-varying budgets (more tokens in lower layers).

    Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling", arXiv
    2406.02069. beta: pyramid steepness (``budget.pyramid_layer_caps``). The pool is sized for the largest
    layer and charged in full (see the module docstring): the mean per-layer budget is the largest one whose
    pyramid fits the pool.
    """

    name: str = "pyramidkv"
    beta: float = 20.0
    options: ClassVar[tuple[str, ...]] = (*SnapKV.options, "beta")

    @property
    def allocation(self) -> Allocation:
        return Allocation(pyramid_beta=self.beta)


@dataclasses.dataclass(frozen=True)
class AdaKV(SnapKV):
    """Ada-KV (Ada-SnapKV): SnapKV scores with head-adaptive budgets over a shared per-layer slot pool.

    Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation", arXiv 2407.11550
    (kvpress ``AdaKVPress``). The layer's ``Hkv * C`` slots go to the top scores over all heads, after each
    head has secured its top ``int(0.2 * C)`` (``Allocation.safeguard``); each slot records its owner head,
    attention reads only a head's own slots (real per-head storage, no masking of a dense cache).
    """

    name: str = "adakv"

    @property
    def allocation(self) -> Allocation:
        return Allocation(adaptive=True, safeguard=0.2)


@dataclasses.dataclass(frozen=True)
class CriticalKV(SnapKV):
    """CriticalKV over SnapKV: value-aware two-stage selection.

    Feng et al., "Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective",
    arXiv 2502.03805 (kvpress ``CriticalKVPress``). Stage 1 keeps each head's top
    ``int(first_stage_ratio * C)`` tokens by SnapKV score; stage 2 ranks the rest by
    ``(score + epsilon) * ||v W_O,h||_1`` (mean over the group's query heads), with the layer's real W_O
    (``LayerContext.wo``).
    """

    name: str = "criticalkv"
    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4
    options: ClassVar[tuple[str, ...]] = (*SnapKV.options, "first_stage_ratio", "epsilon")

    @property
    def ranking(self) -> CriticalKVRanking:
        return CriticalKVRanking(
            n_obs=self.n_obs,
            avg_pool_width=self.avg_pool_width,
            first_stage_ratio=self.first_stage_ratio,
            epsilon=self.epsilon,
        )


@dataclasses.dataclass(frozen=True)
class ReSTKV(PoolMethod):
    """ReST-KV: layer-wise output-reconstruction score with spatial-temporal smoothing.

    An et al., "ReST-KV: Robust KV Cache Eviction with Layer-wise Output Reconstruction and Spatial-Temporal
    Smoothing", arXiv 2605.08840 (reference code: ``restkv_utils.RestKVCluster``). EMA (alpha) over the
    last ``n_obs`` prompt queries' attention rows, score ``a/(1-a) * ||W_O,h (o - v_j)||_2`` with the layer's
    real W_O, adaptive-window average pooling (width >= ``avg_pool_width``, ``scale`` positions per width step),
    GQA-aware (mean over the group), top-k per KV head once after the prompt.
    """

    name: str = "restkv"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=32, q_frac=0.0, static=True)
    n_obs: int = 32
    alpha: float = 0.3
    avg_pool_width: int = 5
    scale: float = 200.0
    options: ClassVar[tuple[str, ...]] = (*PoolMethod.options, "n_obs", "alpha", "avg_pool_width", "scale")
    protects_recent: ClassVar[bool] = True

    @property
    def ranking(self) -> RestKVRanking:
        return RestKVRanking(
            n_obs=self.n_obs, alpha=self.alpha, avg_pool_width=self.avg_pool_width, scale=self.scale
        )


BASELINES: dict[str, Any] = {
    "streamingllm": streaming_llm(),
    "h2o": H2O(),
    "tova": TOVA(),
    "keynorm": KeyNorm(),
    "snapkv": SnapKV(),
    "pyramidkv": PyramidKV(),
    "adakv": AdaKV(),
    "criticalkv": CriticalKV(),
    "restkv": ReSTKV(),
    "kivi2": kivi(bits=2),
    "kivi4": kivi(bits=4),
}
"""Default instance of every baseline (their ``cache`` carries the defaults; ``make_method`` sets β)."""
