"""Jitted generation: chunked prefill, then one ``lax.while_loop`` decode loop (no host round trip per token).

Prompts are right-padded to a length bucket; the KV cache is a pytree handed from prefill to the decode loop
and returned. One compilation per (bucket, batch size, method, sampler config).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.attention import prompt_attention
from models.model import Transformer
from qevict_jax.compiled import EXECUTABLES, bucket_floor, bucket_length, chunk_capacity
from qevict_jax.kv import FullKV, KVMethod, cache_nbytes, full_kv_bytes
from qevict_jax.sampling import SamplerConfig, sample
from qevict_jax.sharding import (
    Mesh,
    check_batch,
    constrain_cache,
    constrain_rows,
    place_replicated,
    place_rows,
    shard_state,
)


def _prefill_logits(
    model: Transformer,
    tokens,
    lengths,
    method: KVMethod,
    max_new_tokens: int,
    budget_tokens: int,
    kv_dtype,
    mesh: Mesh | None = None,
):
    """tokens [B, P] right-padded, lengths [B] -> (logits at each row's last prompt token [B, V], cache).

    The cache is sized for ``max_new_tokens`` more tokens per row and stores K/V in ``kv_dtype``; on a
    ``mesh`` it is constrained to its sharding (``sharding.cache_shardings``) before and after the layer scan.
    """
    b, p = tokens.shape
    cache = method.init_cache(model.cfg, lengths, p, max_new_tokens, kv_dtype, budget_tokens)
    cache = constrain_cache(cache, mesh)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = model(tokens, positions, cache, attend=method.prefill_attend, logit_index=lengths - 1)
    return logits, constrain_cache(cache, mesh)


def _prefill(
    graphdef,
    state,
    tokens,
    lengths,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    budget_tokens: int,
    capacity_new: int,
    kv_dtype,
    mesh: Mesh | None = None,
):
    """tokens [B, P] right-padded, lengths [B] -> (first token [B], cache with room for ``capacity_new``)."""
    model: Transformer = nnx.merge(graphdef, state)
    logits, cache = _prefill_logits(
        model, tokens, lengths, method, capacity_new, budget_tokens, kv_dtype, mesh
    )
    return sample(logits, rng, sampler), cache


def _select_rows(active: jax.Array, new: Any, old: Any) -> Any:
    """Per batch row, ``new`` where active [B] else ``old`` (every cache leaf is [L, B, ...])."""

    def pick(n, o):
        return jnp.where(active.reshape((1, -1) + (1,) * (n.ndim - 2)), n, o)

    return jax.tree.map(pick, new, old)


def _append(
    graphdef,
    state,
    cache,
    tokens,
    start,
    count,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    mesh: Mesh | None = None,
):
    """Append a chunk of tokens to a (compressed) cache, then run one routing event (DESIGN §5).

    tokens [B, Q] right-padded: row b feeds its first ``count[b]`` (>= 1) tokens at positions ``start[b]``,
    ``start[b] + 1``, ... through the method's decode attention (each attends over the cache's tiers and
    adds its attention mass to the window scores, exactly as a decode step). Then ``method.route`` runs a
    routing event, so windows the new tokens need are promoted before decoding.
    Returns (next token [B] sampled from the logits at each row's last token, cache).
    """
    model: Transformer = nnx.merge(graphdef, state)
    b, q = tokens.shape
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)

    def body(carry, xs):
        cache, last = carry
        token, i = xs
        active = i < count
        logits, new = model(token[:, None], (start + i)[:, None], cache, attend=method.decode_attend)
        new = method.decode_route(new, inv_freq)
        new = jax.lax.cond(jnp.all(active), lambda: new, lambda: _select_rows(active, new, cache))
        return (constrain_cache(new, mesh), jnp.where(active[:, None], logits[:, 0], last)), None

    last0 = jnp.zeros((b, model.cfg.vocab_size), jnp.float32)
    (cache, last), _ = jax.lax.scan(body, (cache, last0), (tokens.T, jnp.arange(q, dtype=jnp.int32)))
    cache = constrain_cache(method.route(cache, inv_freq), mesh)
    return sample(last, rng, sampler), cache


def _teacher_forced(
    graphdef, state, tokens, lengths, targets, method: KVMethod, budget_tokens: int, kv_dtype
):
    """Prefill, then feed ``targets`` [B, T] one token per step (teacher forcing).

    Returns (log-probabilities [B, T, V] of each target position given everything before it, cache).
    """
    model: Transformer = nnx.merge(graphdef, state)
    t = targets.shape[1]
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)
    logits0, cache = _prefill_logits(model, tokens, lengths, method, t, budget_tokens, kv_dtype)

    def body(cache, xs):
        token, step = xs
        logits, cache = model(token[:, None], (lengths + step)[:, None], cache, attend=method.decode_attend)
        cache = method.decode_route(cache, inv_freq)
        return cache, jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)

    steps = jnp.arange(t - 1, dtype=jnp.int32)
    cache, rest = jax.lax.scan(body, cache, (targets[:, :-1].T, steps))
    first = jax.nn.log_softmax(logits0.astype(jnp.float32), axis=-1)
    return jnp.concatenate([first[:, None], rest.swapaxes(0, 1)], axis=1), cache


_teacher_forced_jit = jax.jit(_teacher_forced, static_argnums=(0, 5, 6, 7))


@struct.dataclass
class DecodeState:
    """The carry of the decode loop: step [] int32 (tokens[:, step] is the last sampled token, not yet in the
    cache), the cache pytree, tokens [B, G] int32 sampled so far, done [B] bool (row hit EOS), rng key."""

    step: jax.Array
    cache: Any
    tokens: jax.Array
    done: jax.Array
    rng: jax.Array


def _decode(
    graphdef,
    state,
    cache,
    first,
    lengths,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    mesh: Mesh | None = None,
):
    """Decode loop: first [B] token (at positions ``lengths``) -> (tokens [B, G], num_tokens [B], steps
    taken [], cache). After it, each row's cache holds ``lengths + steps`` tokens and ``tokens[:, steps]``
    is the last sampled token, not yet in the cache. On a ``mesh`` the loop carry's cache is constrained to
    its sharding every step (and the token buffer [B, G] to the batch split), so it never moves."""
    model: Transformer = nnx.merge(graphdef, state)
    b = first.shape[0]
    g = sampler.max_new_tokens
    eos = jnp.asarray(sampler.eos_ids or (-1,), jnp.int32)
    out = constrain_rows(jnp.zeros((b, g), jnp.int32).at[:, 0].set(first), mesh)
    done = jnp.isin(first, eos)
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)

    def more(state: DecodeState) -> jax.Array:
        return (state.step + 1 < g) & ~jnp.all(state.done)

    def step(state: DecodeState) -> DecodeState:
        rng, key = jax.random.split(state.rng)
        token = state.tokens[:, state.step]
        pos = (lengths + state.step)[:, None]
        logits, cache = model(token[:, None], pos, state.cache, attend=method.decode_attend)
        cache = constrain_cache(method.decode_route(cache, inv_freq), mesh)
        nxt = sample(logits[:, 0], key, sampler)
        nxt = jnp.where(state.done, eos[0], nxt)
        return DecodeState(
            step=state.step + 1,
            cache=cache,
            tokens=constrain_rows(state.tokens.at[:, state.step + 1].set(nxt), mesh),
            done=state.done | jnp.isin(nxt, eos),
            rng=rng,
        )

    start = DecodeState(step=jnp.int32(0), cache=constrain_cache(cache, mesh), tokens=out, done=done, rng=rng)
    final = jax.lax.while_loop(more, step, start)
    steps, cache, out = final.step, final.cache, final.tokens
    # a row's output ends at its first EOS (inclusive) or at the last step taken
    is_eos = jnp.isin(out, eos) & (jnp.arange(g) <= steps)
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), steps)
    return out, first_eos + 1, steps, cache


_prefill_jit = jax.jit(_prefill, static_argnums=(0, 5, 6, 7, 8, 9, 10))
_append_jit = jax.jit(_append, static_argnums=(0, 7, 8, 9), donate_argnums=(2,))
_decode_jit = jax.jit(_decode, static_argnums=(0, 6, 7, 8), donate_argnums=(2,))


DEFAULT_KV_DTYPE = jnp.bfloat16
"""The KV cache is stored in a 16-bit dtype whatever the compute dtype (DESIGN §3), as deployments do."""


@dataclasses.dataclass
class GenerationResult:
    """Generated tokens per row (EOS included when hit), timings and the final cache.

    ``generate(..., past=result)`` continues the conversation: ``next_positions`` [B] are the tokens each
    row's cache holds and ``pending`` [B] the last sampled token of each row, not yet in the cache (a row
    that hit EOS before the others has been fed EOS while they finished).
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    ttft_s: float  # prefill (+ appended chunk) + first token, compilation excluded
    decode_s: float  # the decode loop, compilation excluded
    cache: Any
    cache_bytes: int
    full_kv_bytes: int  # uncompressed cache (same 16-bit dtype) of every row's final length
    compile_s: float = 0.0  # ahead-of-time compilation in this call (0 when cached)
    method: Any = None
    next_positions: list[int] = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)
    kv_dtype: Any = DEFAULT_KV_DTYPE

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


def check_prompts(
    prompts: Sequence[Sequence[int]], model_cfg, sampler: SamplerConfig, offsets: Sequence[int] | None = None
) -> None:
    """Raise a clear error for empty prompts or prompts that do not fit the model's context (``offsets``:
    tokens already in each row's cache, for a continued conversation)."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        before = offsets[i] if offsets is not None else 0
        total = before + len(p) + sampler.max_new_tokens
        if total > model_cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {before} + {len(p)} tokens + {sampler.max_new_tokens} new tokens = {total}, "
                f"more than the model's context capacity of {model_cfg.max_position_embeddings} tokens"
            )
        bad = [t for t in p if not 0 <= t < model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {model_cfg.vocab_size}): {bad[:5]}")


def _split_questions(
    prompts: Sequence[Sequence[int]], question_starts: Sequence[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """(contexts, questions): each prompt cut at its question start (checked: 0 < start < len)."""
    if len(question_starts) != len(prompts):
        raise ValueError(f"give one question start per prompt: {len(question_starts)} for {len(prompts)}")
    for i, (p, qs) in enumerate(zip(prompts, question_starts, strict=True)):
        if not 0 < qs < len(p):
            raise ValueError(
                f"prompt {i}: question start {qs} is outside (0, {len(p)}): no context or no question"
            )
    return [list(p[:qs]) for p, qs in zip(prompts, question_starts, strict=True)], [
        list(p[qs:]) for p, qs in zip(prompts, question_starts, strict=True)
    ]


@dataclasses.dataclass(frozen=True)
class Fanout:
    """Several methods' caches built by one prompt pass.

    A method only decides what its cache keeps: the prompt pass's outputs (hence the first token) are the
    same for every method, so an evaluation of many methods on one prompt needs one prefill, not one per
    method. The layer scan hands every member its layer's slice (a stacked-cache method such as Full-KV
    prefills through its ``prefill_attend_slice``). The cache is the tuple of the members' caches;
    ``budget_tokens`` is per member.
    """

    methods: tuple[Any, ...]
    name: str = "fanout"
    chunk: int = 512
    stacked_cache: ClassVar[bool] = False  # its members' caches are handed one layer's slice each

    def init_cache(self, model_cfg, prompt_lengths, prompt_capacity, max_new_tokens, dtype, budget_tokens):
        return tuple(
            m.init_cache(model_cfg, prompt_lengths, prompt_capacity, max_new_tokens, dtype, bt)
            for m, bt in zip(self.methods, budget_tokens, strict=True)
        )

    def prefill_attend(self, q, k, v, caches, ctx):
        """The prompt attention once (``LayerContext.prompt_attention``), then every member's compression."""
        lengths = caches[0].length
        att = prompt_attention(q, k, v, ctx.positions, lengths, ctx.cfg.sliding_window, self.chunk)
        ctx = dataclasses.replace(ctx, prompt_attention=att)
        pairs = [
            (m.prefill_attend_slice if m.stacked_cache else m.prefill_attend)(q, k, v, c, ctx)
            for m, c in zip(self.methods, caches, strict=True)
        ]
        return pairs[0][0], tuple(c for _, c in pairs)


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    method: KVMethod | None = None,
    seed: int = 0,
    budget_rounding: str = "bucket",
    question_starts: Sequence[int] | None = None,
    past: GenerationResult | None = None,
    kv_dtype: Any = DEFAULT_KV_DTYPE,
    mesh: Mesh | None = None,
) -> GenerationResult:
    """Generate for a batch of token prompts of different lengths.

    budget_rounding: "bucket" sizes a budgeted cache for the shortest prompt of the length bucket (one
    compilation per bucket, the budget holds for every prompt in it); "exact" sizes it for the shortest
    prompt of this batch (may compile once per distinct length).
    question_starts: question-agnostic compression, for every method: per prompt, the index of its first
    question token. The context before it is prefilled and compressed without seeing the question; the
    question is then appended to the compressed cache (``_append``: each token attends over the tiers and
    adds its mass to the scores, then a routing event) before decoding.
    past: continue a conversation: ``prompts`` are the next turn of each row, appended (after the pending
    token of ``past``) to ``past.cache`` the same way; the method defaults to ``past.method``.
    kv_dtype: storage dtype of the KV cache (bfloat16 by default); Full-KV's reference bytes use it too.
    mesh: run on this device mesh (``sharding.make_mesh``): batch over "data", KV heads, the tiers and the
    attention/MLP weights over "model" (``qevict_jax.sharding``); the batch must divide by the "data" axis.
    """
    method = method or (past.method if past is not None else None) or FullKV()
    if past is None:
        return generate_shared(
            model, prompts, sampler, [method], seed, budget_rounding, question_starts, kv_dtype, mesh
        )[0]
    if question_starts is not None:
        raise ValueError("question_starts and past exclude each other: a new turn is appended whole")
    if len(prompts) != len(past.pending):
        raise ValueError(f"past has {len(past.pending)} rows, got {len(prompts)} prompts")
    check_prompts(prompts, model.cfg, sampler, offsets=[n + 1 for n in past.next_positions])
    check_batch(len(prompts), mesh)
    turns = [[pending, *p] for pending, p in zip(past.pending, prompts, strict=True)]
    start = np.asarray(past.next_positions, np.int32)
    need = int(max(start + np.array([len(t) for t in turns]))) + sampler.max_new_tokens
    cache = method.reserve(past.cache, need)
    return _continue(
        model, method, cache, None, start, turns, sampler, seed, prompts, past.kv_dtype, 0.0, mesh
    )


def generate_shared(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    methods: Sequence[KVMethod],
    seed: int = 0,
    budget_rounding: str = "bucket",
    question_starts: Sequence[int] | None = None,
    kv_dtype: Any = DEFAULT_KV_DTYPE,
    mesh: Mesh | None = None,
) -> list[GenerationResult]:
    """``generate`` with several methods on the same prompts, from one prompt pass (``Fanout``): one
    result per method, as ``generate`` would return them.

    With several methods, each result's ``ttft_s`` includes the one shared prefill, not a per-method one.
    """
    check_prompts(prompts, model.cfg, sampler)
    check_batch(len(prompts), mesh)
    full_lengths = np.array([len(p) for p in prompts], np.int32)
    if question_starts is None:
        contexts, turns = [list(p) for p in prompts], None
    else:
        contexts, turns = _split_questions(prompts, question_starts)
    tokens, lengths = _pad_prompts(contexts)
    capacity_new = (chunk_capacity(max(len(t) for t in turns)) if turns else 0) + sampler.max_new_tokens
    budgets = tuple(_budget_tokens(m, full_lengths, sampler.max_new_tokens, budget_rounding) for m in methods)
    graphdef, state = _split(model, mesh)
    results: list[GenerationResult | None] = [None] * len(methods)
    if len(methods) == 1:
        groups = [([0], methods[0], budgets[0])]
    else:
        groups = [(list(range(len(methods))), Fanout(tuple(methods)), budgets)]
    for members, prefill_method, budget_tokens in groups:
        t0 = time.perf_counter()
        static, args = _prefill_call(
            graphdef,
            state,
            tokens,
            lengths,
            seed,
            prefill_method,
            sampler,
            budget_tokens,
            capacity_new,
            kv_dtype,
            mesh,
        )
        (first, caches), compile_s = EXECUTABLES.run(_prefill_jit, static, *args)
        first.block_until_ready()
        prefill_s = time.perf_counter() - t0 - compile_s
        if not isinstance(prefill_method, Fanout):
            caches = (caches,)
        for i, cache in zip(members, caches, strict=True):
            results[i] = _continue(
                model,
                methods[i],
                cache,
                first,
                lengths,
                turns,
                sampler,
                seed,
                prompts,
                kv_dtype,
                prefill_s,
                mesh,
            )
            results[i].compile_s += compile_s
    return results  # type: ignore[return-value]


def _prefill_call(
    graphdef,
    state,
    tokens: np.ndarray,
    lengths: np.ndarray,
    seed: int,
    method: Any,
    sampler: SamplerConfig,
    budget_tokens: Any,
    capacity_new: int,
    kv_dtype: Any,
    mesh: Mesh | None,
) -> tuple[dict[int, Any], tuple[Any, ...]]:
    """(static arguments, arguments) of ``_prefill_jit`` for tokens [B, P] right-padded, lengths [B]: inputs
    placed on the mesh, the prefill's random key drawn from ``seed`` as ``generate`` draws it."""
    static = {0: graphdef, 5: method, 6: sampler, 7: budget_tokens, 8: capacity_new, 9: kv_dtype, 10: mesh}
    key = place_replicated(jax.random.split(jax.random.key(seed), 3)[0], mesh)
    args = (graphdef, state, place_rows(tokens, mesh), place_rows(lengths, mesh), key)
    return static, (*args, method, sampler, budget_tokens, capacity_new, kv_dtype, mesh)


def lower_prefill(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    method: KVMethod | None = None,
    budget_rounding: str = "bucket",
    kv_dtype: Any = DEFAULT_KV_DTYPE,
) -> Any:
    """The jitted prefill that ``generate(model, prompts, sampler, method, ...)`` runs, lowered for these
    prompts and not run: ``.compile().memory_analysis()`` is XLA's buffer assignment of that prefill, what
    ``bench/throughput.py`` reports as its peak, without a prompt pass."""
    method = method or FullKV()
    check_prompts(prompts, model.cfg, sampler)
    tokens, lengths = _pad_prompts(prompts)
    budget_tokens = _budget_tokens(method, lengths, sampler.max_new_tokens, budget_rounding)
    graphdef, state = nnx.split(model)
    _, args = _prefill_call(
        graphdef,
        state,
        tokens,
        lengths,
        0,
        method,
        sampler,
        budget_tokens,
        sampler.max_new_tokens,
        kv_dtype,
        None,
    )
    return _prefill_jit.lower(*args)


def _continue(
    model: Transformer,
    method: KVMethod,
    cache: Any,
    first: jax.Array | None,
    start: np.ndarray,
    turns: Sequence[Sequence[int]] | None,
    sampler: SamplerConfig,
    seed: int,
    prompts: Sequence[Sequence[int]],
    kv_dtype: Any,
    prefill_s: float,
    mesh: Mesh | None = None,
) -> GenerationResult:
    """Append ``turns`` (if any) at positions ``start`` [B], then decode from ``first`` (the prefill's token,
    used when nothing is appended). ``ttft_s`` = ``prefill_s`` + the append, compilation excluded."""
    graphdef, state = _split(model, mesh)
    compile_s = 0.0
    t0 = time.perf_counter()
    _, k_append, k_decode = jax.random.split(jax.random.key(seed), 3)
    positions = np.asarray(start, np.int32)
    if turns:
        chunk, counts = _pad_prompts(turns, chunk_capacity(max(len(t) for t in turns)))
        (first, cache), c = EXECUTABLES.run(
            _append_jit,
            {0: graphdef, 7: method, 8: sampler, 9: mesh},
            graphdef,
            state,
            cache,
            place_rows(chunk, mesh),
            place_rows(positions, mesh),
            place_rows(counts, mesh),
            place_replicated(k_append, mesh),
            method,
            sampler,
            mesh,
        )
        compile_s += c
        positions = positions + counts
    first.block_until_ready()
    t1 = time.perf_counter()
    (out, counts, steps, cache), compile_decode = EXECUTABLES.run(
        _decode_jit,
        {0: graphdef, 6: method, 7: sampler, 8: mesh},
        graphdef,
        state,
        cache,
        first,
        place_rows(positions, mesh),
        place_replicated(k_decode, mesh),
        method,
        sampler,
        mesh,
    )
    out = np.asarray(out)
    t2 = time.perf_counter()
    counts, steps = np.asarray(counts), int(steps)
    final_tokens = int(sum(positions[i] + counts[i] - 1 for i in range(len(prompts))))
    return GenerationResult(
        tokens=[out[i, : counts[i]].tolist() for i in range(len(prompts))],
        prompt_lengths=[len(p) for p in prompts],
        ttft_s=prefill_s + t1 - t0 - compile_s,
        decode_s=t2 - t1 - compile_decode,
        compile_s=compile_s + compile_decode,
        cache=cache,
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(model.cfg, final_tokens, kv_dtype),
        method=method,
        next_positions=(positions + steps).tolist(),
        pending=out[:, steps].tolist(),
        kv_dtype=kv_dtype,
    )


def _split(model: Transformer, mesh: Mesh | None) -> tuple[Any, Any]:
    """(graphdef, parameter state) of ``model``; on a mesh the state is placed by ``sharding.param_specs``
    (a no-op for parameters already placed so, e.g. by ``sharding.shard_model``)."""
    graphdef, state = nnx.split(model)
    return graphdef, state if mesh is None else shard_state(state, model.cfg, mesh)


def _budget_tokens(method: KVMethod, lengths: np.ndarray, max_new_tokens: int, budget_rounding: str) -> int:
    """Tokens per row a budgeted method sizes its cache for (0 for methods without a budget)."""
    if not method.uses_budget:
        return 0
    if budget_rounding not in ("bucket", "exact"):
        raise ValueError(f"budget_rounding must be 'bucket' or 'exact', got {budget_rounding!r}")
    shortest = int(lengths.min())
    base = bucket_floor(shortest) if budget_rounding == "bucket" else shortest
    return base + max_new_tokens


def _pad_prompts(prompts: Sequence[Sequence[int]], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad prompts to ``width`` (default: their length bucket): (tokens [B, P] int32, lengths [B])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), width or bucket_length(int(lengths.max()))), np.int32)
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
    kv_dtype: Any = DEFAULT_KV_DTYPE,
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
    (logprobs, cache), _ = EXECUTABLES.run(
        _teacher_forced_jit,
        {0: graphdef, 5: method, 6: budget_tokens, 7: kv_dtype},
        graphdef,
        state,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        jnp.asarray(targets),
        method,
        budget_tokens,
        kv_dtype,
    )
    final_tokens = int(lengths.sum()) + len(prompts) * (targets.shape[1] - 1)
    return TeacherForcedResult(
        logprobs=np.asarray(logprobs),
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(model.cfg, final_tokens, kv_dtype),
    )
