"""Sampling of the next token: a static configuration and the jittable sampler."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from qevict_jax.core.bounds import Bound, check_bounds

SAMPLER_BOUNDS = (
    Bound("max_new_tokens", lambda v: v >= 1, ">= 1"),
    Bound("temperature", lambda v: v >= 0, ">= 0"),
    Bound("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
)

@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Static sampling configuration (hashable: a static jit argument).

    temperature 0 means greedy; top_p < 1 keeps the smallest set of tokens whose mass reaches top_p.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_bounds(self, SAMPLER_BOUNDS)


def sample(logits: jax.Array, rng: jax.Array, sampler: SamplerConfig) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V] (greedy, temperature, top-p)."""
    if sampler.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampler.temperature
    if sampler.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep a token while the mass before it is < top_p (the top token is always kept)
        keep = (cum - probs) < sampler.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
