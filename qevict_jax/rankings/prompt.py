"""What the rankings' prompt-time scores read (``scoring``): one layer's prompt pass (``PromptPass``, built
inside the traced prefill) and the token scores a method computed before that pass (``TokenPrior``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from models.model import LayerContext


class TokenPrior(struct.PyTreeNode):
    """Token scores computed before a method's prompt pass, handed to it as its traced ``weights``
    (``LayerContext.weights``): scores [L, B, Hkv, T] f32, higher = keep (KVzip's reconstruction scores,
    ``qevict_jax.rankings.reconstruction``)."""

    scores: jax.Array


@dataclasses.dataclass(frozen=True)
class PromptPass:
    """One layer's prompt pass: what the rankings' prompt-time scores read (built inside the traced prefill).

    q [B, T, H, D], k, v [B, T, Hkv, D]: post-RoPE, rows right-padded (v may be None for rankings that do
    not read it); lengths [B]: each row's valid tokens, the context end; column_mass [B, Hkv, G, T]: the
    attention each key received from every valid query (None where it was not computed); sliding_window:
    the layer's (None: none); wo [H*D, Dm]: the layer's output projection (ReST-KV, CriticalKV);
    token_positions [B, T]: absolute positions (None: 0..T-1, a prompt that starts the sequence);
    prior [B, Hkv, T]: this layer's scores from before the pass (``TokenPrior``), or None; inv_freq [D/2]: the
    layer's RoPE frequencies (None: unknown).
    """

    q: jax.Array
    k: jax.Array
    v: jax.Array | None
    lengths: jax.Array
    column_mass: jax.Array | None = None
    sliding_window: int | None = None
    wo: jax.Array | None = None
    token_positions: jax.Array | None = None
    prior: jax.Array | None = None
    inv_freq: jax.Array | None = None

    @classmethod
    def of_layer(
        cls, q: jax.Array, k: jax.Array, v: jax.Array, *, lengths: jax.Array, column_mass: jax.Array, ctx: LayerContext
    ) -> PromptPass:
        """The pass of the layer ``ctx`` (its sliding window, W_O, positions, ``TokenPrior`` slice, RoPE)."""
        prior = ctx.weights.scores[ctx.layer] if isinstance(ctx.weights, TokenPrior) else None
        return cls(q, k, v, lengths, column_mass, ctx.cfg.sliding_window, ctx.wo, ctx.positions, prior, ctx.inv_freq)

    @property
    def positions(self) -> jax.Array:
        """[B, T] (or [1, T]) int32 absolute positions of the prompt's tokens."""
        if self.token_positions is not None:
            return self.token_positions
        return jnp.arange(self.q.shape[1], dtype=jnp.int32)[None]
