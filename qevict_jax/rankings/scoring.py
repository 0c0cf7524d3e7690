"""Rankings behind one interface, shared by both cache engines (docs/design.md §8; QEvict Appendix J).

A ranking says how important a kept entry is (higher = keep) and how that changes while decoding. Every
ranking (``ScoreDynamics``) provides:

- ``update(score, mass)``: one decode step, ``mass`` = the attention mass the entry received this step;
- ``candidate_score(ring_score, k_window)``: the score of an entry when it leaves the recent region;
- ``shared_heads``: whether every KV head ranks by one head-averaged statistic (TOVA);

and one or both of the prompt-time scores:

- ``prefill_window_scores(prompt, sink=, window=, num_windows=)`` [B, NW]: head-mean score of every prompt window, for the window engine
  (``qevict_jax.engines.window``: QEvict and its variants) — every ``Ranking``;
- ``prefill_token_scores(prompt, caps)`` [B, Hkv, T]: per-KV-head score of every prompt token, for the token pool
  (``qevict_jax.engines.pool``: the per-head eviction baselines, whose policy is one of these rankings plus an
  allocation rule, ``pool.Allocation``) — the rankings marked *token* below (``TokenRanking``).

Rankings (``RANKINGS``; each class says what it scores, *token* marks those the pool ranks with too):
"cumulative" (the default), "cumulative-all" (H2O), "decayed", "pnorm", "headmax", "restkv" (ReST-KV),
"keynorm" (key-norm), "gates" (TRIM-KV); question-agnostic, each in its own module: "kvzip" (KVzip,
``reconstruction``), "expected-attention" (``expected_attention``). Token only, in ``token_rankings``:
TOVA, SnapKV, CriticalKV.

A ranking is one class in one module of this package, registered where it is defined (``@register``):
``make_ranking`` imports every module of the package before it looks a name up, so a new ranking needs no
edit anywhere else.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp

from qevict_jax.rankings.attention_scores import observation_attention, observation_mass, restkv_scores
from qevict_jax.rankings.prompt import PromptPass
from qevict_jax.rankings.windows import (
    GATE_FLOOR,
    key_norm_score,
    key_norms,
    prompt_windows,
    window_ages,
    window_max,
    window_sums,
)

RANKINGS: dict[str, type[Ranking]] = {}
"""The rankings by name (``CacheConfig.ranking``, ``--set ranking=NAME``), filled by ``register`` as their
modules are imported; ``available_rankings`` imports them all."""


def register(cls: type[Ranking]) -> type[Ranking]:
    """Class decorator: ``cls`` is the ranking named ``cls.name``."""
    if RANKINGS.get(cls.name, cls) is not cls:
        raise ValueError(f"two rankings are named {cls.name!r}: {RANKINGS[cls.name].__qualname__}, {cls.__qualname__}")
    RANKINGS[cls.name] = cls
    return cls


def available_rankings() -> dict[str, type[Ranking]]:
    """Every ranking by name, after importing each module of this package (once; later calls are lookups)."""
    package = sys.modules[__name__.rpartition(".")[0]]
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")
    return RANKINGS


@dataclasses.dataclass(frozen=True)
class ScoreDynamics:
    """How a kept entry's score evolves while decoding, in both engines (cumulative here; a ranking
    overrides what differs). Static and hashable.

    An entry is a window (window engine: masses are head means) or one KV head's token (token pool: a token
    is a window of W = 1 of one head, masses are the head's group mean, or the mean over every head when
    ``shared_heads``).
    """

    shared_heads: ClassVar[bool] = False
    # ``update`` is linear in (score, mass): update(s, m) = update(s, 0) + update(0, m), and scaling m scales
    # update(0, m). Then a head mean of per-head running masses equals the running mass of the head means,
    # so the window engine may take that mean at routing events only (``CacheConfig.deferred_head_mean``).
    linear_in_mass: ClassVar[bool] = True
    # the prompt pass must also reconstruct the context (KVzip: ``reconstruction``) for this ranking's scores
    reconstructs: ClassVar[bool] = False

    def update(self, score: jax.Array, mass: jax.Array) -> jax.Array:
        """One decode step: score [...] f32, mass [...] this step's attention mass of each entry -> new score."""
        return score + mass

    def candidate_score(self, ring_score: jax.Array, k_window: jax.Array) -> jax.Array:
        """Score of an entry leaving the ring: ring_score [...], k_window [..., Hkv, W, D] -> [...]."""
        return ring_score


class TokenRanking(Protocol):
    """What the token pool (``qevict_jax.engines.pool``) needs of a ranking: its dynamics and per-head token scores."""

    shared_heads: ClassVar[bool]

    def update(self, score: jax.Array, mass: jax.Array) -> jax.Array: ...

    def candidate_score(self, ring_score: jax.Array, k_window: jax.Array) -> jax.Array: ...

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        """Token scores [B, Hkv, T] (higher = keep) of a prompt pass (``PromptPass``), given the pool's
        ``Capacities`` (``caps``: sinks, recent region, slots per head)."""
        ...


@register
@dataclasses.dataclass(frozen=True)
class Ranking(ScoreDynamics):
    """Cumulative attention (the default ranking): the mass of the observation window's rows, then one decode
    query row per step. Every window-engine ranking is a subclass overriding what differs.

    n_obs: observation window (the last prompt queries) that initializes the attention-based scores;
    max_pool_width: max-pool width over neighbouring tokens of the observation rows (0 or 1 = none); spill: windows after a
    window that are ranked with its score when it is higher (``spilled_key``, at prefill placement and at
    every routing event; the stored scores stay each window's own); q_spill: the spill of the Q tier's key
    among the windows that miss F (None: ``spill``).
    """

    n_obs: int = 32
    max_pool_width: int = 0
    spill: int = 0
    q_spill: int | None = None
    name: ClassVar[str] = "cumulative"

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        """Scores [B, NW] of the prompt windows after the prompt pass (docs/design.md §6); window w covers
        positions [S + wW, S + (w+1)W).

        Here: the observation rows (``observation_mass``) summed, per window, so that prefill and decode add
        mass in the same units (one query row = one decode step).
        """
        return window_sums(self.rows(prompt).sum(axis=1), sink, window, num_windows)

    def rows(self, prompt: PromptPass) -> jax.Array:
        """The observation window's head-mean attention rows [B, n_obs, T] (``observation_mass``)."""
        return observation_mass(
            prompt.q, prompt.k, prompt.lengths, self.n_obs, prompt.sliding_window, self.max_pool_width
        )


@register
@dataclasses.dataclass(frozen=True)
class CumulativeAllRanking(Ranking):
    """Cumulative attention initialized from *every* prompt query (H2O-style). Early tokens collect mass
    from every later query, so the prompt's first windows win: kept as the ablation of the observation
    window."""

    name: ClassVar[str] = "cumulative-all"

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        return window_sums(prompt.column_mass.mean(axis=(1, 2)), sink, window, num_windows)

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        """H2O: the mass every query gave each token, group mean per KV head."""
        return prompt.column_mass.mean(axis=2)


@register
@dataclasses.dataclass(frozen=True)
class DecayedRanking(Ranking):
    """Exponentially decayed attention: score <- decay * score + mass, per decode step; observation row i
    weighs ``decay^(n_obs - 1 - i)``."""

    decay: float = 0.98
    name: ClassVar[str] = "decayed"

    def update(self, score, mass):
        return self.decay * score + mass

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        rows = self.rows(prompt)  # [B, n, T], n = n_obs clipped to the prompt
        weights = jnp.power(self.decay, jnp.arange(rows.shape[1] - 1, -1, -1, dtype=jnp.float32))
        return window_sums(jnp.einsum("bnt,n->bt", rows, weights), sink, window, num_windows)


@register
@dataclasses.dataclass(frozen=True)
class PNormRanking(Ranking):
    """Attention p-norm: the sum over queries of each window's mass to the power ``p`` (rank-equivalent to
    the p-norm of the window's mass over queries)."""

    p: float = 3.0
    name: ClassVar[str] = "pnorm"
    linear_in_mass: ClassVar[bool] = False  # the head mean is raised to the power p

    def update(self, score, mass):
        return score + jnp.power(jnp.maximum(mass, 0.0), self.p)

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        rows = self.rows(prompt)
        per_row = jax.vmap(lambda x: window_sums(x, sink, window, num_windows), in_axes=1, out_axes=1)(rows)
        return jnp.sum(jnp.power(per_row, self.p), axis=1)


@register
@dataclasses.dataclass(frozen=True)
class HeadMaxRanking(Ranking):
    """Cumulative attention whose prompt-time score is the largest over query heads rather than their mean:
    each head sums its observation rows per window, and a window scores what its most attentive head gave it.
    A head that retrieves (one sharp peak) is not averaged away by the heads that spread their mass; the
    decode steps then add head-mean mass, as the cumulative ranking does. ``max_pool_width`` is not applied."""

    name: ClassVar[str] = "headmax"

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        b = prompt.q.shape[0]
        per_head = observation_attention(  # [B, Hkv, G, T]: each head's observation rows summed
            prompt.q, prompt.k, prompt.lengths, self.n_obs, prompt.sliding_window, lambda p: p.sum(axis=3)
        )
        heads = per_head.reshape(b, -1, per_head.shape[-1])  # [B, H, T]
        sums = jax.vmap(lambda x: window_sums(x, sink, window, num_windows), in_axes=1, out_axes=1)(heads)
        return sums.max(axis=1)  # [B, NW]


@register
@dataclasses.dataclass(frozen=True)
class KeyNormRanking(Ranking):
    """Minus the mean key norm of the window (low key norm = important); independent of attention."""

    name: ClassVar[str] = "keynorm"

    def update(self, score, mass):
        return score

    def candidate_score(self, ring_score, k_window):
        return key_norm_score(k_window)

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        kw = prompt_windows(prompt.k, sink, window, num_windows)  # [B, NW, W, Hkv, D]
        return key_norm_score(kw.swapaxes(2, 3))

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        """Key-norm (kvpress ``KnormPress``): minus each key's norm, per KV head."""
        return -key_norms(prompt.k).swapaxes(1, 2)


@register
@dataclasses.dataclass(frozen=True)
class RestKVRanking(Ranking):
    """ReST-KV's output-change score at prefill (``restkv_scores``, width-5 average pooling), head-mean,
    summed per window, for the windows that end before the observation window, rescaled per row so that
    these windows' total equals their observation-window mass; later windows keep their observation mass.
    Cumulative at decode. ``alpha``: EMA factor over the observation rows; ``avg_pool_width``: the (smallest)
    average-pooling width; ``scale``: positions per width step of the token pool's adaptive pooling."""

    alpha: float = 0.3
    avg_pool_width: int = 5
    scale: float = 200.0
    name: ClassVar[str] = "restkv"

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        if prompt.v is None or prompt.wo is None:
            raise ValueError("the restkv ranking needs the values and the layer's W_O (LayerContext.wo)")
        obs_w = super().prefill_window_scores(prompt, sink=sink, window=window, num_windows=num_windows)
        tok = self.token_scores(prompt, None).mean(1)
        lengths = prompt.lengths
        rest_w = window_sums(tok, sink, window, num_windows)
        win_end = sink + (jnp.arange(num_windows) + 1) * window
        early = win_end[None] <= (lengths - self.n_obs)[:, None]
        num = jnp.sum(jnp.where(early, obs_w, 0.0), axis=1, keepdims=True)
        den = jnp.sum(jnp.where(early, rest_w, 0.0), axis=1, keepdims=True)
        scale = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)
        return jnp.where(early, rest_w * scale, obs_w)

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        """ReST-KV per KV head with its adaptive pooling window for the pool's ``caps.pool_per_head`` slots."""
        return self.token_scores(prompt, caps.pool_per_head)

    def token_scores(self, prompt: PromptPass, slots: int | None) -> jax.Array:
        """``restkv_scores`` [B, Hkv, T] of the prompt; ``slots``: the pool's slots per head, for the adaptive
        pooling width (None: the fixed ``avg_pool_width``)."""
        return restkv_scores(
            prompt.q,
            prompt.k,
            prompt.v,
            prompt.lengths,
            prompt.wo,
            n_obs=self.n_obs,
            alpha=self.alpha,
            sliding_window=prompt.sliding_window,
            capacity=slots,
            min_kernel=self.avg_pool_width,
            scale=self.scale,
        )


@register
@dataclasses.dataclass(frozen=True)
class GateRanking(Ranking):
    """Learned retention gates (TRIM-KV, arXiv 2512.03324; ``qevict_jax.rankings.gates``): no attention at all.

    A token's retention at time t is ``beta^(t - pos)``; a window's *key* is the largest, over its tokens,
    of the head-mean log beta (a window is worth its best token; the tiers are shared by the KV heads), and
    its score at time t is ``(t - centre) * key`` (the log retention of that token, with the window's centre
    for its position: exact up to W/2 positions of age). The scores in the cache hold the keys, which do
    not change with t (``update`` adds nothing); the method (``gate_methods.GateQEvict``) turns them into
    scores at the current t around a routing event and max-accumulates a new token's log beta into its ring
    window. In the token pool (TRIM-KV's own rule, the methods "gates" and "gates-global") a KV head's token
    scores ``(t - pos) log beta`` at the prompt end t. ``log_beta`` [B, T, Hkv]: the prompt's log beta per
    token and KV head, set by the method inside the traced prefill; None elsewhere.
    """

    log_beta: Any = dataclasses.field(default=None, compare=False, hash=False)
    name: ClassVar[str] = "gates"

    def update(self, score, mass):
        return score

    def gates(self) -> jax.Array:
        """log beta [B, T, Hkv] of the prompt (a clear error without learned gates)."""
        if self.log_beta is None:
            raise ValueError("the gates ranking needs learned gates: use the method qevict-gates (gates=DIR)")
        return self.log_beta

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        lengths = prompt.lengths
        lb = jnp.where(prompt.positions < lengths[:, None], self.gates().mean(axis=-1), GATE_FLOOR)  # [B, T]
        keys = window_max(lb, sink, window, num_windows)  # [B, NW]
        wins = jnp.arange(num_windows, dtype=jnp.int32)[None]
        return window_ages(wins, lengths, sink, window) * keys

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        """TRIM-KV's inference score ``(t - pos) log beta`` per KV head at the prompt end t."""
        age = (prompt.lengths[:, None] - prompt.positions).astype(jnp.float32)
        return age[:, None, :] * self.gates().transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class PriorRanking(Ranking):
    """A ranking from token scores known once the prompt pass has run (``token_prior``, [B, Hkv, T], higher =
    keep): the pool ranks each head's tokens by them, the window engine a window by its best token over every
    KV head (the windows are shared by the heads, so a window stays when any head would read one of its
    tokens); decoding adds mass as "cumulative"."""

    def token_prior(self, prompt: PromptPass) -> jax.Array:
        raise NotImplementedError

    def prefill_window_scores(self, prompt: PromptPass, *, sink: int, window: int, num_windows: int) -> jax.Array:
        valid = prompt.positions < prompt.lengths[:, None]
        best = jnp.where(valid, self.token_prior(prompt).max(axis=1), GATE_FLOOR)  # [B, T]
        return window_max(best, sink, window, num_windows)

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        return self.token_prior(prompt)


def make_ranking(name: str, **params) -> Ranking:
    """The ranking ``name`` with those of ``params`` (n_obs, max_pool_width, spill, q_spill, decay, p) that it
    has."""
    rankings = available_rankings()
    if name not in rankings:
        raise ValueError(f"unknown ranking {name!r}; available: {', '.join(rankings)}")
    cls = rankings[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in fields})


