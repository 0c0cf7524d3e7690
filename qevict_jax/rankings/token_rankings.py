"""The token pool's own rankings (docs/design.md §8): TOVA's current-query attention, SnapKV's pooled observation
attention and CriticalKV's value-aware two-stage selection over it. Per KV head and token only
(``scoring.TokenRanking``); the rankings both engines share are in ``scoring``."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from qevict_jax.rankings.attention_scores import (
    criticalkv_scores,
    observation_attention,
    snapkv_scores,
)
from qevict_jax.rankings.scoring import PromptPass, Ranking, ScoreDynamics


@dataclasses.dataclass(frozen=True)
class TOVARanking(Ranking):
    """TOVA (arXiv 2401.06104): the attention of the current query, averaged over every head, replaces the
    score at each step (``update``). At the prompt end: the last ``n_obs`` (= 1, TOVA's rule) queries' rows.
    Every KV head ranks by the same head-mean statistic (``shared_heads``)."""

    n_obs: int = 1
    shared_heads: ClassVar[bool] = True
    name: ClassVar[str] = "tova"

    def update(self, score, mass):
        return mass

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        """The head-mean attention rows of the last ``n_obs`` queries, summed, the same for every KV head."""
        probs = observation_attention(prompt.q, prompt.k, prompt.lengths, self.n_obs, prompt.sliding_window)
        rows = probs.sum(axis=3).mean(axis=(1, 2))  # [B, T]; probs [B, Hkv, G, n, T]
        b, t, hkv = prompt.k.shape[:3]
        return jnp.broadcast_to(rows[:, None], (b, hkv, t))


@dataclasses.dataclass(frozen=True)
class SnapKVRanking(ScoreDynamics):
    """SnapKV's scores (``snapkv_scores``): the observation window's attention to the prefix, average-pooled
    (``avg_pool_width``), group mean per KV head. Token pool only (SnapKV, PyramidKV, Ada-KV)."""

    n_obs: int = 32
    avg_pool_width: int = 5

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        return snapkv_scores(
            prompt.q, prompt.k, prompt.lengths, self.n_obs, self.avg_pool_width, prompt.sliding_window
        )


@dataclasses.dataclass(frozen=True)
class CriticalKVRanking(SnapKVRanking):
    """CriticalKV over SnapKV (``criticalkv_scores``): each head's top ``first_stage_ratio`` of its
    ``caps.pool_per_head`` slots by SnapKV score, then ``(score + epsilon) * ||v W_O,h||_1`` over the tokens
    that compete for the pool (past the sinks, before the recent region). Token pool only."""

    first_stage_ratio: float = 0.5
    epsilon: float = 1e-4

    def prefill_token_scores(self, prompt: PromptPass, caps: Any) -> jax.Array:
        base = super().prefill_token_scores(prompt, caps)
        positions = prompt.positions
        eligible = (positions >= caps.sink) & (positions < (prompt.lengths - caps.recent)[:, None])
        return criticalkv_scores(
            base, prompt.v, prompt.wo, eligible, caps.pool_per_head, first_stage_ratio=self.first_stage_ratio, epsilon=self.epsilon
        )
