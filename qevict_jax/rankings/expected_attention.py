"""Expected attention (Devoto et al., arXiv 2510.00636; kvpress 0.5.5 ``ExpectedAttentionPress``): a
question-agnostic score for every KV pair of a prompt, in closed form from the prompt's own queries.

The prompt's queries before RoPE (all of them past the ``n_sink`` sinks) are summarized by their mean and
covariance per query head. A future query at position p is that distribution rotated by RoPE at p; averaged
over the next ``n_future_positions`` positions the rotation is one matrix R (the mean of the per-position
rotations, not a rotation itself). If q ~ N(R mu, R S R^T), then E[exp(q . k / sqrt(d))] is
``exp(k . R mu / sqrt(d) + k^T R S R^T k / (2 d))``: these logits, softmaxed over the prompt's keys past the
sinks and averaged over the query heads of each KV head, are each key's expected attention. Each is then
weighted by its value's norm, ``(score + epsilon) * ||v||``, and the sinks score above every other token.

Our keys and queries are post-RoPE (``models.model``), as kvpress's cached keys are; kvpress projects its
pre-RoPE queries again from the hidden states, here they are the post-RoPE queries rotated back (RoPE at the
negated positions undoes it: ``models.attention.apply_rope``). Differences from kvpress 0.5.5, by design:
padded rows are supported (each row's statistics and softmax use its own valid tokens, and the future
positions start after its own last token, at its absolute position); the statistics are computed in
float32 whatever the model's dtype; the sinks score one above their row's largest score (kvpress: one above
the largest over the whole batch), which changes no kept set. As in kvpress, a sliding-window layer is scored
as if it attended to the whole prompt, and the logits are scaled by 1/sqrt(D) whatever the model's own scale.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from models.attention import apply_rope, rope_cos_sin, rotate_half
from qevict_jax.rankings.prompt import PromptPass
from qevict_jax.rankings.scoring import PriorRanking, register

N_FUTURE_POSITIONS = 512
"""Future positions the RoPE rotation is averaged over (kvpress's default)."""
N_SINK = 4
"""Leading tokens left out of the query statistics and the softmax, and always kept (kvpress's default)."""


def query_statistics(
    q: jax.Array, positions: jax.Array, lengths: jax.Array, inv_freq: jax.Array, *, n_sink: int
) -> tuple[jax.Array, jax.Array]:
    """Mean [B, H, D] and covariance [B, H, D, D] (biased: divided by the count) of the pre-RoPE queries of
    each row's tokens ``n_sink <= i < lengths``; q [B, T, H, D] post-RoPE at ``positions`` [B or 1, T]."""
    t = q.shape[1]
    pre = apply_rope(q.astype(jnp.float32), -positions, inv_freq)  # RoPE at -p undoes RoPE at p
    idx = jnp.arange(t)[None]
    rows = ((idx >= n_sink) & (idx < lengths[:, None])).astype(jnp.float32)[:, :, None, None]  # [B, T, 1, 1]
    count = jnp.maximum(lengths - n_sink, 1).astype(jnp.float32)[:, None, None]  # [B, 1, 1]
    mean = jnp.sum(pre * rows, axis=1) / count  # [B, H, D]
    centered = (pre - mean[:, None]) * rows
    cov = jnp.einsum("bthi,bthj->bhij", centered, centered) / count[..., None]
    return mean, cov


def average_rope(
    mean: jax.Array, cov: jax.Array, start: jax.Array, inv_freq: jax.Array, *, n_future_positions: int
) -> tuple[jax.Array, jax.Array]:
    """(R mean [B, H, D], R cov R^T [B, H, D, D]) with R the mean of the RoPE rotations at positions
    ``start .. start + n_future_positions - 1`` (start [B]): R = [[diag c, -diag s], [diag s, diag c]] in the
    rotate-half layout, c and s the mean cosines and sines of each frequency's angles."""
    future = start[:, None] + jnp.arange(n_future_positions, dtype=jnp.int32)[None]  # [B, N]
    cos, sin = rope_cos_sin(future, inv_freq)  # [B, N, D/2]
    c, s = cos.mean(axis=1)[:, None], sin.mean(axis=1)[:, None]  # [B, 1, D/2], broadcast over heads
    mean = rotate_half(mean, c, s)  # R mean
    cov = rotate_half(cov, c[:, :, None], s[:, :, None])  # rows of cov rotated: cov R^T
    cov = rotate_half(cov.swapaxes(-1, -2), c[:, :, None], s[:, :, None]).swapaxes(-1, -2)  # R (cov R^T)
    return mean, cov


def expected_attention_scores(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    positions: jax.Array,
    lengths: jax.Array,
    inv_freq: jax.Array,
    n_future_positions: int = N_FUTURE_POSITIONS,
    n_sink: int = N_SINK,
    use_covariance: bool = True,
    use_vnorm: bool = True,
    epsilon: float = 0.0,
) -> jax.Array:
    """Expected-attention scores [B, Hkv, T] f32 (higher = keep) of one layer's prompt pass.

    q [B, T, H, D], k, v [B, T, Hkv, D]: post-RoPE q and k, rows right-padded (row b: tokens < lengths[b]);
    positions [B or 1, T]: the tokens' absolute positions; inv_freq [D/2]: the layer's RoPE frequencies.
    The options are ``ExpectedAttentionPress``'s, with its defaults. Sinks score their row's largest score
    plus one; padding scores 0.
    """
    if n_future_positions < 1 or n_sink < 0:
        raise ValueError(
            f"n_future_positions must be >= 1 and n_sink >= 0, got {n_future_positions}, {n_sink}"
        )
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    positions = jnp.broadcast_to(positions, (b, t))
    mean, cov = query_statistics(q, positions, lengths, inv_freq, n_sink=n_sink)
    last = jnp.take_along_axis(positions, jnp.clip(lengths - 1, 0, t - 1)[:, None], axis=1)[:, 0]
    mean, cov = average_rope(mean, cov, last + 1, inv_freq, n_future_positions=n_future_positions)

    kf = k.astype(jnp.float32)
    logits = jnp.einsum("bkgd,btkd->bkgt", mean.reshape(b, hkv, g, d), kf) / jnp.sqrt(jnp.float32(d))
    if use_covariance:
        kc = jnp.einsum("btkd,bkgde->bkgte", kf, cov.reshape(b, hkv, g, d, d))
        logits = logits + jnp.einsum("bkgte,btke->bkgt", kc, kf) / (2.0 * d)
    idx = jnp.arange(t)[None]
    valid = idx < lengths[:, None]  # [B, T]
    scored = (valid & (idx >= n_sink))[:, None, None]  # [B, 1, 1, T]: the keys the softmax runs over
    top = jnp.max(jnp.where(scored, logits, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(scored, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    probs = e / jnp.maximum(e.sum(axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    scores = probs.mean(axis=2)  # [B, Hkv, T]: the group's mean
    if use_vnorm:
        norms = jnp.linalg.norm(v.astype(jnp.float32), axis=-1).swapaxes(1, 2)  # [B, Hkv, T]
        scores = jnp.where(scored[:, 0], (scores + epsilon) * norms, 0.0)
    best = jnp.max(scores, axis=(1, 2), keepdims=True)
    sink = (valid & (idx < n_sink))[:, None]
    return jnp.where(sink, best + 1.0, jnp.where(valid[:, None], scores, 0.0))


@register
@dataclasses.dataclass(frozen=True)
class ExpectedAttentionRanking(PriorRanking):
    """Expected attention (arXiv 2510.00636; kvpress ``ExpectedAttentionPress``): a token's score is
    ``expected_attention_scores`` of the prompt pass (the press's defaults but ``epsilon``: kvpress's
    leaderboard runs 0.01, the press's own default is 0). Question-agnostic."""

    epsilon: float = 0.01
    n_future_positions: int = N_FUTURE_POSITIONS
    name: ClassVar[str] = "expected-attention"

    def token_prior(self, prompt: PromptPass) -> jax.Array:
        if prompt.v is None or prompt.inv_freq is None:
            raise ValueError(
                "the expected-attention ranking needs the values and the layer's RoPE frequencies"
            )
        return expected_attention_scores(
            prompt.q,
            prompt.k,
            prompt.v,
            positions=prompt.positions,
            lengths=prompt.lengths,
            inv_freq=prompt.inv_freq,
            n_future_positions=self.n_future_positions,
            epsilon=self.epsilon,
        )
