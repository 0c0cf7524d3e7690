"""Compress once, answer many: a context's compressed cache, built by one prompt pass before any question is
known (``compress``), and questions answered from it, alone or as one batch (``answer``).

This is ``generate(..., question_starts=...)`` cut in two where the question arrives: ``compress`` runs the
same jitted prompt pass over the context (sized as ``generate`` sizes a prompt of the context plus a question
of ``question_tokens`` tokens and ``max_new_tokens`` new ones), and ``answer`` runs the same append and
decode. With ``question_tokens`` equal to the question's length the two give the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.model import Transformer
from qevict_jax.core.kv import DEFAULT_KV_DTYPE, KVMethod, cache_nbytes, full_kv_bytes
from qevict_jax.runtime.compiled import chunk_capacity
from qevict_jax.runtime.generate import _continue, _split
from qevict_jax.runtime.prefill import check_prompts, fit_method, pad_prompts, run_prefill, tokens_for_budget
from qevict_jax.runtime.results import GenerationResult
from qevict_jax.runtime.sampling import SamplerConfig
from qevict_jax.runtime.streaming import TokenSink


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CompressedCache:
    """One context's cache after its prompt pass and compression, before any question (read-only: every
    ``answer`` works on a copy, so no question changes what another sees).

    cache: the method's cache pytree, every leaf [L, 1, ...] (one row). method: the method that built it
    (Full-KV where compressing this context saved nothing; ``compressed`` is then False); requested_method:
    the one asked for. context_tokens: the context's token count. question_tokens, max_new_tokens: what the
    cache was sized for (a budgeted method keeps β of the uncompressed cache of context + question + answer,
    as ``generate`` sizes a prompt). cache_bytes: the sum of ``nbytes`` over the pytree; full_kv_bytes: the
    uncompressed cache of the context in ``kv_dtype``. prefill_s: the prompt pass and compression,
    compilation (compile_s) excluded.
    """

    cache: Any
    method: KVMethod
    requested_method: KVMethod
    compressed: bool
    context_tokens: int
    question_tokens: int
    max_new_tokens: int
    kv_dtype: Any
    cache_bytes: int
    full_kv_bytes: int
    prefill_s: float
    compile_s: float

    @property
    def memory_ratio(self) -> float:
        """Measured cache bytes / bytes of the uncompressed 16-bit cache of the context."""
        return self.cache_bytes / self.full_kv_bytes


def check_room(
    context_tokens: int, extra_tokens: int, max_new_tokens: int, model_cfg: Any, *, what: str
) -> None:
    """A ValueError naming ``what`` when context + ``extra_tokens`` + ``max_new_tokens`` exceed the model's
    context length."""
    total = context_tokens + extra_tokens + max_new_tokens
    if total > model_cfg.max_position_embeddings:
        raise ValueError(
            f"{what}: the {context_tokens}-token context + {extra_tokens} tokens + {max_new_tokens} new "
            f"tokens = {total}, more than the model's context of {model_cfg.max_position_embeddings} tokens"
        )


def compress(
    model: Transformer,
    context: Sequence[int],
    method: KVMethod,
    *,
    question_tokens: int,
    max_new_tokens: int,
    seed: int = 0,
    budget_rounding: str = "bucket",
    kv_dtype: Any = DEFAULT_KV_DTYPE,
) -> CompressedCache:
    """Prefill and compress the token ids ``context`` through ``method``; checked before any compute (an
    empty context, a size that does not fit the model, a budget that cannot hold the method's smallest cache).

    question_tokens, max_new_tokens (>= 1): the question and answer the cache is sized for (a longer question
    or answer still runs where the method can grow: the window tiers and decode-time pools hold any length,
    Full-KV grows its buffer, a compress-once pool refuses what overflows its ring).
    """
    if len(context) == 0:
        raise ValueError("the context is empty: give at least one token to compress")
    for name, value in (("question_tokens", question_tokens), ("max_new_tokens", max_new_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    check_room(len(context), question_tokens, max_new_tokens, model.cfg, what="question_tokens")
    check_prompts([context], model.cfg, SamplerConfig(max_new_tokens))  # token ids in the vocabulary
    sized = np.array([len(context) + question_tokens], np.int32)  # what generate sizes with the question
    fit = fit_method(
        method,
        model_cfg=model.cfg,
        lengths=sized,
        max_new_tokens=max_new_tokens,
        budget_rounding=budget_rounding,
        kv_dtype=kv_dtype,
    )
    tokens, lengths = pad_prompts([context])
    graphdef, state = _split(model, None)
    _, cache, prefill_s, compile_s = run_prefill(
        model_cfg=model.cfg,
        graphdef=graphdef,
        state=state,
        tokens=tokens,
        lengths=lengths,
        seed=seed,
        method=fit.method,
        sampler=SamplerConfig(max_new_tokens),  # the prompt pass's token is not used: the question follows
        budget_tokens=tokens_for_budget(fit.method, sized, max_new_tokens, budget_rounding),
        capacity_new=chunk_capacity(question_tokens) + max_new_tokens,
        kv_dtype=kv_dtype,
        mesh=None,
    )
    return CompressedCache(
        cache=cache,
        method=fit.method,
        requested_method=method,
        compressed=fit.compressed,
        context_tokens=len(context),
        question_tokens=question_tokens,
        max_new_tokens=max_new_tokens,
        kv_dtype=kv_dtype,
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(model.cfg, len(context), kv_dtype),
        prefill_s=prefill_s,
        compile_s=compile_s,
    )


def rows_of(cache: Any, rows: int) -> Any:
    """A new cache of ``rows`` copies of a one-row cache (every leaf [L, 1, ...] -> [L, rows, ...]); new
    buffers even for one row, so a jitted call that donates its cache never consumes the original."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    return jax.tree.map(lambda x: jnp.repeat(x, rows, axis=1) if rows > 1 else jnp.array(x, copy=True), cache)


def answer(
    model: Transformer,
    compressed: CompressedCache,
    questions: Sequence[Sequence[int]],
    sampler: SamplerConfig,
    *,
    seed: int = 0,
    on_token: TokenSink | None = None,
) -> GenerationResult:
    """Answer the token-id ``questions`` from ``compressed`` as one batch of rows, each row a copy of its
    cache: each question is appended after the context (``generate``'s append: its tokens attend over the
    tiers and add to the window scores, then a routing event) and decoded. ``compressed`` is never changed.

    Rows are independent but for the routing schedule: an event runs every Ω decode steps counted on row 0
    (``SizedByCapacities.routing_due``, as in every batch), so a row whose question length differs from row
    0's by other than a multiple of Ω may meet its events at other steps than alone.
    Returns the batch's ``GenerationResult`` (``prompt_lengths``: the questions' lengths; ``ttft_s``: the
    append and first token; ``full_kv_bytes``: the uncompressed cache of every row's final length).
    """
    if not questions:
        raise ValueError("no question given: give at least one")
    for i, q in enumerate(questions):
        if len(q) == 0:
            raise ValueError(f"question {i} is empty")
    n, start = len(questions), compressed.context_tokens
    check_prompts(questions, model.cfg, sampler, offsets=[start] * n)
    need = start + max(len(q) for q in questions) + sampler.max_new_tokens
    cache = rows_of(compressed.cache, n)
    try:
        cache = compressed.method.reserve(cache, need)
    except ValueError as err:
        raise ValueError(
            f"{err}; compress with a larger question_tokens or max_new_tokens to reserve the room"
        ) from None
    result = _continue(
        model=model,
        method=compressed.method,
        cache=cache,
        first=None,  # the question is appended: its last token's logits give the first token
        start=np.full(n, start, np.int32),
        turns=[list(q) for q in questions],
        sampler=sampler,
        seed=seed,
        prompts=questions,
        kv_dtype=compressed.kv_dtype,
        prefill_s=0.0,  # the context's prompt pass was paid once, in compress
        on_token=on_token,
    )
    return dataclasses.replace(
        result, compressed=compressed.compressed, requested_method=compressed.requested_method
    )
