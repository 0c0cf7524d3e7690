"""Sampling of the next token: a static configuration and the jittable sampler."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


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
