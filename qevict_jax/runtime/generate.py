"""Generation: ``generate`` (a batch of prompts through one method), ``generate_shared`` (several methods from
one prompt pass), continued conversations (``past=``) and ``teacher_forced`` (fidelity).

Prompts are right-padded to a length bucket; the KV cache is a pytree handed from the jitted prompt pass
(``qevict_jax.runtime.prefill``) to the jitted decode loop (``qevict_jax.runtime.decode``) and returned in the result
(``qevict_jax.runtime.results``). One compilation per (bucket, batch size, method, sampler config), owned by
``compiled.EXECUTABLES``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.model import Transformer
from qevict_jax.core.kv import DEFAULT_KV_DTYPE, KVMethod, cache_nbytes, full_kv_bytes
from qevict_jax.core.sharding import Mesh, check_batch, place_replicated, place_rows, shard_state, to_host
from qevict_jax.runtime.compiled import EXECUTABLES, chunk_capacity
from qevict_jax.runtime.decode import decode_jit
from qevict_jax.runtime.fanout import Fanout
from qevict_jax.runtime.prefill import (
    append_jit,
    check_prompts,
    fit_method,
    method_weights,
    pad_prompts,
    prefill_call,
    prefill_jit,
    run_prefill,
    split_questions,
    tokens_for_budget,
)
from qevict_jax.runtime.results import GenerationResult
from qevict_jax.runtime.sampling import SamplerConfig
from qevict_jax.runtime.streaming import TokenSink, open_stream


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    method: KVMethod | None = None,
    *,
    seed: int = 0,
    budget_rounding: str = "bucket",
    question_starts: Sequence[int] | None = None,
    past: GenerationResult | None = None,
    kv_dtype: Any = DEFAULT_KV_DTYPE,
    mesh: Mesh | None = None,
    on_token: TokenSink | None = None,
    growing: bool = False,
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
    token of ``past``) to ``past.cache`` the same way; the method defaults to ``past.method``. A conversation
    kept whole so far (``past.compressed`` False: too short for the method asked for) switches to that method
    at the first turn where it saves bytes (``prefill.fit_method`` with ``growing``, on the whole sequence):
    that turn prefills ``past.history`` + the turn through the method, exactly as ``generate`` on that
    sequence would, and every later turn is appended to the compressed cache. β is then a fraction of the
    sequence at that turn and the cache keeps that size as the conversation grows; a ``budget_bytes`` method
    switches once the uncompressed sequence outgrows it, and keeps that size.
    growing: the first turn of a conversation (``pipeline.Conversation``): as at a later turn, the method
    runs only where its cache is smaller than the uncompressed sequence (``prefill.fit_method``).
    kv_dtype: storage dtype of the KV cache (bfloat16 by default); Full-KV's reference bytes use it too.
    mesh: run on this device mesh (``sharding.make_mesh``): batch over "data", KV heads, the tiers and the
    attention/MLP weights over "model" (``qevict_jax.core.sharding``); the batch must divide by the "data" axis.
    on_token: stream the output: called on the host with each position's tokens [B] and live [B] as they
    are sampled (``qevict_jax.runtime.streaming``), the first from the prompt pass, then one per decode step.
    """
    follows = past is not None and (method is None or method == past.requested_method)
    if past is not None and method is not None and method == past.requested_method:
        method = past.method  # the method that built the cache (Full-KV where nothing was compressed)
    method = method or (past.method if past is not None else None)
    if method is None:
        raise ValueError(
            "generate needs a KV method: FullKV() (qevict_jax.methods.full) for the uncompressed cache, or "
            "one from qevict_jax.methods.registry.make_method; a continued conversation (past) reuses its own"
        )
    if past is None:
        return generate_shared(
            model,
            prompts,
            sampler,
            [method],
            seed=seed,
            budget_rounding=budget_rounding,
            question_starts=question_starts,
            kv_dtype=kv_dtype,
            mesh=mesh,
            on_token=on_token,
            growing=growing,
        )[0]
    if question_starts is not None:
        raise ValueError("question_starts and past exclude each other: a new turn is appended whole")
    if len(prompts) != len(past.pending):
        raise ValueError(f"past has {len(past.pending)} rows, got {len(prompts)} prompts")
    check_prompts(prompts, model.cfg, sampler, offsets=[n + 1 for n in past.next_positions])
    check_batch(len(prompts), mesh)
    requested = past.requested_method
    if follows and not past.compressed and requested is not None and requested.compresses:
        sequences = [[*h, *p] for h, p in zip(past.history, prompts, strict=True)]
        fit = fit_method(
            requested,
            model_cfg=model.cfg,
            lengths=np.array([len(s) for s in sequences], np.int32),
            max_new_tokens=sampler.max_new_tokens,
            budget_rounding=budget_rounding,
            kv_dtype=past.kv_dtype,
            growing=True,
        )
        if fit.compressed:  # the first turn where the method saves bytes: compress all of it, as a prefill
            result = generate_shared(
                model,
                sequences,
                sampler,
                [requested],
                seed=seed,
                budget_rounding=budget_rounding,
                kv_dtype=past.kv_dtype,
                mesh=mesh,
                on_token=on_token,
                growing=True,
            )[0]
            return dataclasses.replace(result, prompt_lengths=[len(p) for p in prompts])  # this turn's tokens
    turns = [[pending, *p] for pending, p in zip(past.pending, prompts, strict=True)]
    start = np.asarray(past.next_positions, np.int32)
    need = int(max(start + np.array([len(t) for t in turns]))) + sampler.max_new_tokens
    cache = method.reserve(past.cache, need)
    result = _continue(
        model=model,
        method=method,
        cache=cache,
        first=None,  # a new turn is appended: its last token's logits give the first token
        start=start,
        turns=turns,
        sampler=sampler,
        seed=seed,
        prompts=prompts,
        kv_dtype=past.kv_dtype,
        prefill_s=0.0,  # no prompt pass: the time to first token is the append's
        mesh=mesh,
        on_token=on_token,
        before=past.history,
    )
    return dataclasses.replace(
        result,
        requested_method=past.requested_method or method,
        compressed_at=past.compressed_at if result.compressed else None,
    )


def generate_shared(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    methods: Sequence[KVMethod],
    *,
    seed: int = 0,
    budget_rounding: str = "bucket",
    question_starts: Sequence[int] | None = None,
    kv_dtype: Any = DEFAULT_KV_DTYPE,
    mesh: Mesh | None = None,
    on_token: TokenSink | None = None,
    growing: bool = False,
) -> list[GenerationResult]:
    """``generate`` with several methods on the same prompts, from one prompt pass (``Fanout``): one
    result per method, as ``generate`` would return them.

    With several methods, each result's ``ttft_s`` includes the one shared prefill, not a per-method one.
    A method that could save nothing on these prompts (``prefill.fit_method``: its sinks and recent region
    already hold them) runs as Full-KV, and its result says ``compressed=False``; one whose β cannot hold its
    smallest cache for prompts long enough to compress runs at the least β that can, and its result's
    ``note`` says so. ``on_token`` (``generate``'s) streams one method's output, so it needs exactly one
    method; ``growing`` as in ``generate``.
    """
    if on_token is not None and len(methods) != 1:
        raise ValueError(f"streaming follows one method's output; got {len(methods)} methods")
    check_prompts(prompts, model.cfg, sampler)
    check_batch(len(prompts), mesh)
    full_lengths = np.array([len(p) for p in prompts], np.int32)
    fits = [
        fit_method(
            m,
            model_cfg=model.cfg,
            lengths=full_lengths,
            max_new_tokens=sampler.max_new_tokens,
            budget_rounding=budget_rounding,
            kv_dtype=kv_dtype,
            growing=growing,
        )
        for m in methods
    ]
    requested, methods = methods, [f.method for f in fits]
    if question_starts is None:
        contexts, turns = [list(p) for p in prompts], None
    else:
        contexts, turns = split_questions(prompts, question_starts)
    tokens, lengths = pad_prompts(contexts)
    capacity_new = (chunk_capacity(max(len(t) for t in turns)) if turns else 0) + sampler.max_new_tokens
    budgets = tuple(
        tokens_for_budget(m, full_lengths, sampler.max_new_tokens, budget_rounding) for m in methods
    )
    graphdef, state = _split(model, mesh)
    results: list[GenerationResult | None] = [None] * len(methods)
    if len(methods) == 1:
        groups = [([0], methods[0], budgets[0])]
    else:
        groups = [(list(range(len(methods))), Fanout(tuple(methods)), budgets)]
    for members, prefill_method, budget_tokens in groups:
        first, caches, prefill_s, compile_s = run_prefill(
            model_cfg=model.cfg,
            graphdef=graphdef,
            state=state,
            tokens=tokens,
            lengths=lengths,
            seed=seed,
            method=prefill_method,
            sampler=sampler,
            budget_tokens=budget_tokens,
            capacity_new=capacity_new,
            kv_dtype=kv_dtype,
            mesh=mesh,
        )
        if not isinstance(prefill_method, Fanout):
            caches = (caches,)
        for i, cache in zip(members, caches, strict=True):
            results[i] = _continue(
                model=model,
                method=methods[i],
                cache=cache,
                first=first,
                start=lengths,
                turns=turns,
                sampler=sampler,
                seed=seed,
                prompts=prompts,
                kv_dtype=kv_dtype,
                prefill_s=prefill_s,
                mesh=mesh,
                on_token=on_token,
            )
            results[i] = dataclasses.replace(
                results[i],
                compile_s=results[i].compile_s + compile_s,
                compressed=fits[i].compressed,
                compressed_at=lengths.tolist() if fits[i].compressed else None,
                note=fits[i].note,
                requested_method=requested[i],
            )
    return results  # type: ignore[return-value]


def lower_prefill(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    method: KVMethod,
    budget_rounding: str = "bucket",
    kv_dtype: Any = DEFAULT_KV_DTYPE,
) -> Any:
    """The jitted prefill that ``generate(model, prompts, sampler, method, ...)`` runs, lowered for these
    prompts and not run: ``.compile().memory_analysis()`` is XLA's buffer assignment of that prefill, what
    ``bench/throughput.py`` reports as its peak, without a prompt pass."""
    check_prompts(prompts, model.cfg, sampler)
    tokens, lengths = pad_prompts(prompts)
    budget_tokens = tokens_for_budget(method, lengths, sampler.max_new_tokens, budget_rounding)
    graphdef, state = nnx.split(model)
    static, inputs = prefill_call(
        model_cfg=model.cfg,
        graphdef=graphdef,
        state=state,
        tokens=tokens,
        lengths=lengths,
        seed=0,
        method=method,
        sampler=sampler,
        budget_tokens=budget_tokens,
        capacity_new=sampler.max_new_tokens,
        kv_dtype=kv_dtype,
        mesh=None,
    )
    return prefill_jit.lower(**inputs, **static)


def _continue(
    *,
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
    on_token: TokenSink | None = None,
    before: Sequence[Sequence[int]] | None = None,
) -> GenerationResult:
    """Append ``turns`` (if any) at positions ``start`` [B], then decode from ``first`` (the prefill's token;
    None when ``turns`` are appended, whose last logits give it). ``ttft_s`` = ``prefill_s`` + the append, compilation excluded. With
    ``on_token`` the first token goes to it from the host, the rest from inside the decode loop. ``before``:
    each row's tokens ahead of ``prompts`` in the cache (a continued conversation's history), for the
    result's ``history``."""
    graphdef, state = _split(model, mesh)
    weights = method_weights(method, model.cfg, mesh)
    compile_s = 0.0
    t0 = time.perf_counter()
    _, k_append, k_decode = jax.random.split(jax.random.key(seed), 3)
    positions = np.asarray(start, np.int32)
    if turns:
        chunk, counts = pad_prompts(turns, chunk_capacity(max(len(t) for t in turns)))
        (first, cache), c = EXECUTABLES.run(
            append_jit,
            dict(graphdef=graphdef, method=method, sampler=sampler, mesh=mesh),
            state=state,
            cache=cache,
            tokens=place_rows(chunk, mesh),
            start=place_rows(positions, mesh),
            count=place_rows(counts, mesh),
            rng=place_replicated(k_append, mesh),
            weights=weights,
        )
        compile_s += c
        positions = positions + counts
    first.block_until_ready()
    t1 = time.perf_counter()
    if on_token is not None:
        on_token(to_host(first), np.ones(len(prompts), bool))
    with open_stream(on_token) if on_token is not None else contextlib.nullcontext() as stream_id:
        (out, counts, steps, cache), compile_decode = EXECUTABLES.run(
            decode_jit,
            dict(graphdef=graphdef, method=method, sampler=sampler, mesh=mesh),
            state=state,
            cache=cache,
            first=first,
            lengths=place_rows(positions, mesh),
            rng=place_replicated(k_decode, mesh),
            stream_id=None if stream_id is None else place_replicated(stream_id, mesh),
            weights=weights,
        )
        out = to_host(out)  # every process gets every row (a collective across the processes of a mesh)
    t2 = time.perf_counter()
    counts, steps = to_host(counts), int(to_host(steps))
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
        history=[
            [*(before[i] if before is not None else ()), *map(int, prompts[i]), *out[i, : steps + 1].tolist()]
            for i in range(len(prompts))
        ],
        kv_dtype=kv_dtype,
        compressed=method.compresses,
        requested_method=method,
    )


def _split(model: Transformer, mesh: Mesh | None) -> tuple[Any, Any]:
    """(graphdef, parameter state) of ``model``; on a mesh the state is placed by ``sharding.param_specs``
    (a no-op for parameters already placed so, e.g. by ``sharding.shard_model``)."""
    graphdef, state = nnx.split(model)
    return graphdef, state if mesh is None else shard_state(state, model.cfg, mesh)
