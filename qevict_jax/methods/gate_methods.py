"""KV methods over learned retention gates (TRIM-KV, arXiv 2512.03324; ``qevict_jax.rankings.gates``).

- "gates": a per-KV-head token pool (``pool``), compressed once after the prompt: every head keeps its top
  tokens by ``(t - pos_i) log beta_i`` at the prompt end t (as SnapKV keeps its top attention scores).
- "gates-global": the same scores, one ranking over all KV heads of a layer (the layer's ``Hkv * C`` slots
  go to the best (head, token) pairs, Ada-KV's allocation without its per-head safeguard). One ranking over
  *layers* too, as TRIM-KV allows, does not fit the pool layout: the decoder scans over layers and every
  layer's cache slice has the same static shape, so a layer cannot hold more slots than another.
- "qevict-gates": QEvict's three tiers ranked by the gates (``scoring.GateRanking``) instead of attention:
  the prompt's windows need no observation-window attention, and decode steps add no attention mass.

Every one takes the option ``gates``: a gate checkpoint folder written by ``qevict train-gates`` (the
latest step is read on the host once per folder and model, ``weights``, and enters the compiled programs as
an argument, ``LayerContext.weights``: other parameters of the same shapes reuse the programs), or
"untrained" for untrained gates, which keep every token alike and so rank by age only (smoke tests); none
given is a clear error.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from models.config import ModelConfig
from models.model import LayerContext
from qevict_jax.core.cache import TieredCache
from qevict_jax.core.config import CacheConfig
from qevict_jax.engines.pool import Allocation, pool_prefill_layer
from qevict_jax.engines.window import prefill_layer
from qevict_jax.methods.baselines import PoolMethod
from qevict_jax.methods.qevict import QEVICT_OPTIONS, WindowMethod
from qevict_jax.rankings.gates import GateParams, gate_params, log_beta
from qevict_jax.rankings.scoring import GateRanking
from qevict_jax.rankings.windows import window_ages


def layer_log_beta(ctx: LayerContext) -> jax.Array:
    """log beta [B, T, Hkv] of the current layer's tokens (``ctx.hidden`` [B, T, Dm]) by the gate parameters
    the program was given (``ctx.weights``: a gate method's ``weights``)."""
    if ctx.hidden is None:
        raise ValueError("learned gates need the layer's input (LayerContext.hidden)")
    if ctx.weights is None:
        raise ValueError("learned gates need their parameters (LayerContext.weights: the method's weights)")
    return log_beta(ctx.weights, ctx.layer, ctx.hidden)


# ---------------------------------------------------------------------------------------------- token pool


@dataclasses.dataclass(frozen=True)
class GatePool(PoolMethod):
    """TRIM-KV's inference rule over the token pool: each KV head keeps its top ``(t - pos) log beta``
    tokens, once after the prompt (t = the prompt end), plus the recent region. ``gates``: the gate folder.
    """

    name: str = "gates"
    cache: CacheConfig = CacheConfig(sink=0, window=1, recent=32, q_frac=0.0, static=True)
    gates: str = ""
    options: ClassVar[tuple[str, ...]] = (*PoolMethod.options, "gates")
    protects_recent: ClassVar[bool] = True

    @property
    def ranking(self) -> GateRanking:
        return GateRanking()

    def weights(self, model_cfg: ModelConfig) -> GateParams:
        """The gate parameters (host arrays) of the folder ``gates`` for this model."""
        return gate_params(self.gates, model_cfg)

    def prefill_attend(self, q, k, v, layer_cache, ctx: LayerContext):
        """q [B, T, H, D], k, v [B, T, Hkv, D] (post-RoPE, right-padded prompt) -> (out, layer cache): the
        gates ranking with the layer's log beta."""
        ranking = GateRanking(log_beta=layer_log_beta(ctx))
        return pool_prefill_layer(
            q, k, v, layer_cache, ctx, ranking=ranking, allocation=self.allocation, chunk=self.cache.prefill_chunk
        )


@dataclasses.dataclass(frozen=True)
class GatePoolGlobal(GatePool):
    """``GatePool`` with one ranking over every KV head of a layer (head-adaptive allocation, no
    safeguard): a head whose tokens have high retention gets more of the layer's slots."""

    name: str = "gates-global"

    @property
    def allocation(self) -> Allocation:
        return Allocation(adaptive=True, safeguard=0.0)


# ---------------------------------------------------------------------------------------------- QEvict


def ring_window_ids(next_win: jax.Array, ring_windows: int) -> jax.Array:
    """Window id [..., RW] held by each ring window slot (window w -> slot w % RW, ids >= next_win [...])."""
    slots = jnp.arange(ring_windows, dtype=jnp.int32)
    return next_win[..., None] + jnp.mod(slots - next_win[..., None], ring_windows)


def _rescale(cache: TieredCache, to_scores: bool) -> TieredCache:
    caps = cache.caps
    age = lambda win: window_ages(win, cache.length, caps.sink, caps.window)
    ring = ring_window_ids(cache.next_win, caps.ring_windows)
    f = (lambda x, a: x * a) if to_scores else (lambda x, a: x / a)
    return cache.replace(
        f_score=f(cache.f_score, age(cache.f_win)),
        ledger=cache.ledger.replace(score=f(cache.ledger.score, age(cache.ledger.win))),
        ring_score=f(cache.ring_score, age(ring)),
    )


def keys_to_scores(cache: TieredCache) -> TieredCache:
    """Window keys (max log beta) -> scores ``(t - centre) * key`` at t = length, every tier (any leading
    axes: one layer's slice or the stacked cache)."""
    return _rescale(cache, True)


def scores_to_keys(cache: TieredCache) -> TieredCache:
    """Inverse of ``keys_to_scores`` (same t: windows keep their ids, so each score meets its own age)."""
    return _rescale(cache, False)


GATE_QEVICT_OPTIONS = (
    *(o for o in QEVICT_OPTIONS if o not in ("ranking", "n_obs", "max_pool_width", "decay", "p")),
    "gates",
)


@dataclasses.dataclass(frozen=True)
class GateQEvict(WindowMethod):
    """QEvict ranked by learned retention gates (``scoring.GateRanking``).

    The scores in the cache are window keys (the largest head-mean log beta of the window's tokens); a
    routing event ranks ``(t - centre) * key`` at its time t. Prefill: keys from the prompt's hidden states,
    no observation-window attention. Decode: a new token's log beta is max-accumulated into its ring window
    (no attention mass is added). ``gates``: the gate folder.
    """

    name: str = "qevict-gates"
    cache: CacheConfig = CacheConfig(ranking="gates", spill=0)  # retention is per token: no spill
    gates: str = ""
    options: tuple[str, ...] = GATE_QEVICT_OPTIONS

    @property
    def ranking(self) -> GateRanking:
        return GateRanking(spill=self.spill_windows)

    def weights(self, model_cfg: ModelConfig) -> GateParams:
        """The gate parameters (host arrays) of the folder ``gates`` for this model."""
        return gate_params(self.gates, model_cfg)

    def prefill_attend(self, q, k, v, layer_cache: TieredCache, ctx: LayerContext):
        """q [B, T, H, D], k, v [B, T, Hkv, D] (post-RoPE, right-padded prompt) -> (out, layer cache)."""
        ranking = GateRanking(log_beta=layer_log_beta(ctx), spill=self.spill_windows)
        out, cache = prefill_layer(q, k, v, layer_cache, ctx, ranking=ranking, config=self.cache)
        return out, scores_to_keys(cache)

    def decode_attend(self, q, k, v, layer_cache: TieredCache, ctx: LayerContext):
        """q [B, 1, H, D], k, v [B, 1, Hkv, D] (post-RoPE) -> (out [B, 1, H, D], layer cache)."""
        out, cache = super().decode_attend(q, k, v, layer_cache, ctx)
        caps = cache.caps
        s, w = caps.sink, caps.window
        lb = layer_log_beta(ctx)[:, 0].mean(axis=-1)[:, None]  # [B, 1]
        pos = ctx.positions[:, 0]
        slot = jnp.mod(jnp.floor_divide(pos - s, w), caps.ring_windows)
        here = (jnp.arange(caps.ring_windows)[None] == slot[:, None]) & (pos >= s)[:, None]  # [B, RW]
        first = here & (jnp.mod(pos - s, w) == 0)[:, None]
        ring_score = jnp.where(here, jnp.maximum(cache.ring_score, lb), cache.ring_score)
        return out, cache.replace(ring_score=jnp.where(first, lb, ring_score))

    def route(self, cache: TieredCache, inv_freq: jax.Array, due: jax.Array | None = None) -> TieredCache:
        """A routing event at t = length: keys -> scores, the window engine's routing, scores -> keys. With
        ``due`` under a conditional: the key <-> score round trip is not exact, so it runs only at events."""
        if due is not None:
            return jax.lax.cond(due, lambda c: self.route(c, inv_freq), lambda c: c, cache)
        return scores_to_keys(super().route(keys_to_scores(cache), inv_freq))


GATE_METHODS = {"gates": GatePool(), "gates-global": GatePoolGlobal(), "qevict-gates": GateQEvict()}
"""Default instance of every gate method (``make_method`` sets β and ``gates``)."""
