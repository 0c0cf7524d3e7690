"""Jitted generation: chunked prefill, then one ``lax.while_loop`` decode loop (no host round trip per token).

Prompts are right-padded to a length bucket; the KV cache is a pytree handed from prefill to the decode loop
and returned. One compilation per (bucket, batch size, method, sampler config).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.model import Transformer
from qevict_jax.kv import FullKV, KVMethod, cache_nbytes, full_kv_bytes

# How many times each jitted function has been traced (one trace = one compilation); read by tests.
TRACE_COUNTS: collections.Counter[str] = collections.Counter()


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


def bucket_length(n: int) -> int:
    """Round a prompt length up to its bucket: multiples of max(64, 2^floor(log2 n) / 16).

    The bucket granularity is at most 1/16 of the length, so a whole bucket shares one compilation and
    padding wastes little prefill compute.
    """
    if n < 1:
        raise ValueError("empty prompt")
    step = max(64, (1 << (n.bit_length() - 1)) // 16)
    return -(-n // step) * step


def bucket_floor(n: int) -> int:
    """Smallest prompt length that falls in the same bucket as ``n``."""
    top = bucket_length(n)
    lo = n
    while lo > 1 and bucket_length(lo - 1) == top:
        lo -= 1
    return lo


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


def _prefill(graphdef, state, tokens, lengths, rng, method: KVMethod, sampler: SamplerConfig, budget_tokens: int):
    """tokens [B, P] right-padded, lengths [B] -> (first token [B], cache)."""
    TRACE_COUNTS["prefill"] += 1
    model: Transformer = nnx.merge(graphdef, state)
    b, p = tokens.shape
    cache = method.init_cache(model.cfg, lengths, p, sampler.max_new_tokens, model.dtype, budget_tokens)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = model(tokens, positions, cache, attend=method.prefill_attend, logit_index=lengths - 1)
    return sample(logits, rng, sampler), cache


def _decode(graphdef, state, cache, first, lengths, rng, method: KVMethod, sampler: SamplerConfig):
    """Decode loop: first [B] token from prefill -> (tokens [B, G], num_tokens [B], cache)."""
    TRACE_COUNTS["decode"] += 1
    model: Transformer = nnx.merge(graphdef, state)
    b = first.shape[0]
    g = sampler.max_new_tokens
    eos = jnp.asarray(sampler.eos_ids or (-1,), jnp.int32)
    out = jnp.zeros((b, g), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos)

    def cond(carry):
        step, _, _, done, _ = carry
        return (step + 1 < g) & ~jnp.all(done)

    def body(carry):
        step, cache, out, done, rng = carry
        rng, key = jax.random.split(rng)
        token = out[:, step]
        pos = (lengths + step)[:, None]
        logits, cache = model(token[:, None], pos, cache, attend=method.decode_attend)
        nxt = sample(logits[:, 0], key, sampler)
        nxt = jnp.where(done, eos[0], nxt)
        out = out.at[:, step + 1].set(nxt)
        return step + 1, cache, out, done | jnp.isin(nxt, eos), rng

    step, cache, out, done, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, out, done, rng))
    # a row's output ends at its first EOS (inclusive) or at the last step taken
    is_eos = jnp.isin(out, eos) & (jnp.arange(g) <= step)
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), step)
    return out, first_eos + 1, cache


_prefill_jit = jax.jit(_prefill, static_argnums=(0, 5, 6, 7))
_decode_jit = jax.jit(_decode, static_argnums=(0, 6, 7), donate_argnums=(2,))


@dataclasses.dataclass
class GenerationResult:
    """Generated tokens per row (EOS included when hit), timings and the final cache."""

    tokens: list[list[int]]
    prompt_lengths: list[int]
    ttft_s: float
    decode_s: float
    cache: Any
    cache_bytes: int
    full_kv_bytes: int  # uncompressed cache of every row's final length

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def memory_ratio(self) -> float:
        return self.cache_bytes / self.full_kv_bytes

    @property
    def decode_tokens_per_s(self) -> float:
        steps = max(len(t) for t in self.tokens) - 1
        return steps * len(self.tokens) / self.decode_s if self.decode_s > 0 and steps > 0 else float("nan")


def check_prompts(prompts: Sequence[Sequence[int]], model_cfg, sampler: SamplerConfig) -> None:
    """Raise a clear error for empty prompts or prompts that do not fit the model's context."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        total = len(p) + sampler.max_new_tokens
        if total > model_cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens + {sampler.max_new_tokens} new tokens = {total}, more than the "
                f"model's context capacity of {model_cfg.max_position_embeddings} tokens"
            )
        bad = [t for t in p if not 0 <= t < model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {model_cfg.vocab_size}): {bad[:5]}")


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    method: KVMethod | None = None,
    seed: int = 0,
    budget_rounding: str = "bucket",
) -> GenerationResult:
    """Generate for a batch of token prompts of different lengths.

    budget_rounding: "bucket" sizes a budgeted cache for the shortest prompt of the length bucket (one
    compilation per bucket, the budget holds for every prompt in it); "exact" sizes it for the shortest
    prompt of this batch (may compile once per distinct length).
    """
    method = method or FullKV()
    cfg = model.cfg
    check_prompts(prompts, cfg, sampler)
    lengths = np.array([len(p) for p in prompts], np.int32)
    p_cap = bucket_length(int(lengths.max()))
    tokens = np.zeros((len(prompts), p_cap), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    if getattr(method, "uses_budget", False):
        shortest = int(lengths.min())
        base = bucket_floor(shortest) if budget_rounding == "bucket" else shortest
        budget_tokens = base + sampler.max_new_tokens
    else:
        budget_tokens = 0
    graphdef, state = nnx.split(model)
    rng = jax.random.key(seed)
    k_prefill, k_decode = jax.random.split(rng)
    lengths_j = jnp.asarray(lengths)

    t0 = time.perf_counter()
    first, cache = _prefill_jit(graphdef, state, jnp.asarray(tokens), lengths_j, k_prefill, method, sampler, budget_tokens)
    first.block_until_ready()
    t1 = time.perf_counter()
    out, counts, cache = _decode_jit(graphdef, state, cache, first, lengths_j, k_decode, method, sampler)
    out = np.asarray(out)
    t2 = time.perf_counter()
    counts = np.asarray(counts)
    rows = [out[i, : counts[i]].tolist() for i in range(len(prompts))]
    final_tokens = int(sum(lengths[i] + counts[i] - 1 for i in range(len(prompts))))
    dtype = model.dtype
    return GenerationResult(
        tokens=rows,
        prompt_lengths=lengths.tolist(),
        ttft_s=t1 - t0,
        decode_s=t2 - t1,
        cache=cache,
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(cfg, final_tokens, dtype),
    )
