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
# Ahead-of-time compiled executables, keyed by function, static arguments and dynamic shapes/dtypes.
_EXECUTABLES: dict[Any, Any] = {}


def _run_compiled(jitted, static: dict[int, Any], *args) -> tuple[Any, float]:
    """Call ``jitted(*args)`` through a cached AOT executable; returns (outputs, seconds spent compiling).

    Compiling ahead of time keeps compilation out of the measured time to first token.
    """
    dynamic = [a for i, a in enumerate(args) if i not in static]
    leaves, treedef = jax.tree.flatten(dynamic)
    key = (jitted, tuple(sorted(static.items())), treedef, tuple((x.shape, x.dtype) for x in leaves))
    compile_s = 0.0
    if key not in _EXECUTABLES:
        t0 = time.perf_counter()
        _EXECUTABLES[key] = jitted.lower(*args).compile()
        compile_s = time.perf_counter() - t0
    return _EXECUTABLES[key](*dynamic), compile_s


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


def _prefill_logits(
    model: Transformer,
    tokens,
    lengths,
    method: KVMethod,
    max_new_tokens: int,
    budget_tokens: int,
    context_lengths,
):
    """tokens [B, P] right-padded, lengths [B] -> (logits at each row's last prompt token [B, V], cache).

    context_lengths [B] (question-agnostic methods only, else None): where each row's question starts.
    """
    b, p = tokens.shape
    extra = {} if context_lengths is None else {"context_lengths": context_lengths}
    cache = method.init_cache(model.cfg, lengths, p, max_new_tokens, model.dtype, budget_tokens, **extra)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    return model(tokens, positions, cache, attend=method.prefill_attend, logit_index=lengths - 1)


def _prefill(
    graphdef,
    state,
    tokens,
    lengths,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    budget_tokens: int,
    ctx_lens,
):
    """tokens [B, P] right-padded, lengths [B] -> (first token [B], cache)."""
    TRACE_COUNTS["prefill"] += 1
    model: Transformer = nnx.merge(graphdef, state)
    logits, cache = _prefill_logits(
        model, tokens, lengths, method, sampler.max_new_tokens, budget_tokens, ctx_lens
    )
    return sample(logits, rng, sampler), cache


def _teacher_forced(
    graphdef, state, tokens, lengths, targets, method: KVMethod, budget_tokens: int, ctx_lens
):
    """Prefill, then feed ``targets`` [B, T] one token per step (teacher forcing).

    Returns (log-probabilities [B, T, V] of each target position given everything before it, cache).
    """
    TRACE_COUNTS["teacher_forced"] += 1
    model: Transformer = nnx.merge(graphdef, state)
    t = targets.shape[1]
    logits0, cache = _prefill_logits(model, tokens, lengths, method, t, budget_tokens, ctx_lens)

    def body(cache, xs):
        token, step = xs
        logits, cache = model(token[:, None], (lengths + step)[:, None], cache, attend=method.decode_attend)
        return cache, jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)

    steps = jnp.arange(t - 1, dtype=jnp.int32)
    cache, rest = jax.lax.scan(body, cache, (targets[:, :-1].T, steps))
    first = jax.nn.log_softmax(logits0.astype(jnp.float32), axis=-1)
    return jnp.concatenate([first[:, None], rest.swapaxes(0, 1)], axis=1), cache


_teacher_forced_jit = jax.jit(_teacher_forced, static_argnums=(0, 5, 6))


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
    ttft_s: float  # prefill + first token, compilation excluded
    decode_s: float  # the decode loop, compilation excluded
    cache: Any
    cache_bytes: int
    full_kv_bytes: int  # uncompressed cache of every row's final length
    compile_s: float = 0.0  # ahead-of-time compilation in this call (0 when cached)

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
    question_starts: Sequence[int] | None = None,
) -> GenerationResult:
    """Generate for a batch of token prompts of different lengths.

    budget_rounding: "bucket" sizes a budgeted cache for the shortest prompt of the length bucket (one
    compilation per bucket, the budget holds for every prompt in it); "exact" sizes it for the shortest
    prompt of this batch (may compile once per distinct length).
    question_starts: per prompt, the index of its first question token; required by question-agnostic
    methods (the context before it is compressed, the question kept), ignored by the others.
    """
    method = method or FullKV()
    cfg = model.cfg
    check_prompts(prompts, cfg, sampler)
    tokens, lengths = _pad_prompts(prompts)
    budget_tokens = _budget_tokens(method, lengths, sampler.max_new_tokens, budget_rounding)
    graphdef, state = nnx.split(model)
    rng = jax.random.key(seed)
    k_prefill, k_decode = jax.random.split(rng)
    lengths_j = jnp.asarray(lengths)

    t0 = time.perf_counter()
    (first, cache), compile_prefill = _run_compiled(
        _prefill_jit,
        {0: graphdef, 5: method, 6: sampler, 7: budget_tokens},
        graphdef,
        state,
        jnp.asarray(tokens),
        lengths_j,
        k_prefill,
        method,
        sampler,
        budget_tokens,
        _context_lengths(method, prompts, question_starts),
    )
    first.block_until_ready()
    t1 = time.perf_counter()
    (out, counts, cache), compile_decode = _run_compiled(
        _decode_jit,
        {0: graphdef, 6: method, 7: sampler},
        graphdef,
        state,
        cache,
        first,
        lengths_j,
        k_decode,
        method,
        sampler,
    )
    out = np.asarray(out)
    t2 = time.perf_counter()
    counts = np.asarray(counts)
    compile_s = compile_prefill + compile_decode
    rows = [out[i, : counts[i]].tolist() for i in range(len(prompts))]
    final_tokens = int(sum(lengths[i] + counts[i] - 1 for i in range(len(prompts))))
    dtype = model.dtype
    return GenerationResult(
        tokens=rows,
        prompt_lengths=lengths.tolist(),
        ttft_s=t1 - t0 - compile_prefill,
        decode_s=t2 - t1 - compile_decode,
        compile_s=compile_s,
        cache=cache,
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(cfg, final_tokens, dtype),
    )


def _context_lengths(
    method: KVMethod, prompts: Sequence[Sequence[int]], question_starts: Sequence[int] | None
) -> jax.Array | None:
    """[B] int32 question starts for a question-agnostic method (checked), else None."""
    if not getattr(method, "question_agnostic", False):
        return None
    if question_starts is None or len(question_starts) != len(prompts):
        raise ValueError(f"{method.name} is question-agnostic: give question_starts, one per prompt")
    capacity = method.cache.question_capacity
    for i, (p, qs) in enumerate(zip(prompts, question_starts, strict=True)):
        if not 0 < qs <= len(p):
            raise ValueError(f"prompt {i}: question start {qs} is outside (0, {len(p)}]")
        if len(p) - qs > capacity:
            raise ValueError(
                f"prompt {i}: the question has {len(p) - qs} tokens, more than the {capacity} the cache reserves"
            )
    return jnp.asarray(question_starts, jnp.int32)


def _budget_tokens(method: KVMethod, lengths: np.ndarray, max_new_tokens: int, budget_rounding: str) -> int:
    """Tokens per row a budgeted method sizes its cache for (0 for methods without a budget)."""
    if not getattr(method, "uses_budget", False):
        return 0
    if budget_rounding not in ("bucket", "exact"):
        raise ValueError(f"budget_rounding must be 'bucket' or 'exact', got {budget_rounding!r}")
    shortest = int(lengths.min())
    base = bucket_floor(shortest) if budget_rounding == "bucket" else shortest
    return base + max_new_tokens


def _pad_prompts(prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad prompts to their length bucket: (tokens [B, P] int32, lengths [B] int32)."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), bucket_length(int(lengths.max()))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


@dataclasses.dataclass
class TeacherForcedResult:
    logprobs: np.ndarray  # [B, T, V] float32 log-probabilities at each target position
    cache_bytes: int
    full_kv_bytes: int

    @property
    def memory_ratio(self) -> float:
        return self.cache_bytes / self.full_kv_bytes


def teacher_forced(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    targets: np.ndarray,
    method: KVMethod | None = None,
    budget_rounding: str = "bucket",
    question_starts: Sequence[int] | None = None,
) -> TeacherForcedResult:
    """Log-probabilities of the next token at every position of ``targets`` [B, T] after each prompt.

    The method's cache is built from the prompt and then updated by every target token, exactly as in
    decoding, so its next-token distributions can be compared with Full-KV's (fidelity).
    """
    method = method or FullKV()
    targets = np.asarray(targets, np.int32)
    if targets.ndim != 2 or targets.shape[0] != len(prompts):
        raise ValueError(f"targets must be [B={len(prompts)}, T], got shape {targets.shape}")
    check_prompts(prompts, model.cfg, SamplerConfig(max_new_tokens=targets.shape[1]))
    tokens, lengths = _pad_prompts(prompts)
    budget_tokens = _budget_tokens(method, lengths, targets.shape[1], budget_rounding)
    graphdef, state = nnx.split(model)
    (logprobs, cache), _ = _run_compiled(
        _teacher_forced_jit,
        {0: graphdef, 5: method, 6: budget_tokens},
        graphdef,
        state,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        jnp.asarray(targets),
        method,
        budget_tokens,
        _context_lengths(method, prompts, question_starts),
    )
    final_tokens = int(lengths.sum()) + len(prompts) * (targets.shape[1] - 1)
    return TeacherForcedResult(
        logprobs=np.asarray(logprobs),
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(model.cfg, final_tokens, model.dtype),
    )
