"""Compress a context once, ask it any number of questions: ``Pipeline.compress(context)`` returns a
``CompressedContext`` (the context's compressed cache, its method and its measured bytes); ``.ask(question)``
answers from it, ``.ask_many([q1, q2, ...])`` (or ``.ask`` of a list) answers several as one batch.

    ctx = pipe.compress(document)                 # qevict-gated at β 0.2, the best question-agnostic method
    ctx.ask("Who wrote it?").text
    [a.text for a in ctx.ask_many(["When?", "Where?"])]

Every answer starts from the same compressed cache (a copy per call: the compressed cache is never donated
to a jitted call), so one question never changes another's context. The prompt is what ``qevict generate
--question --question-agnostic`` builds: one user message "{context}\\n\\n{question}" in the chat template,
the context's part compressed before the question is seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from models.tokenizer import Tokenizer, token_index
from qevict_jax.core.kv import KVMethod, full_kv_bytes
from qevict_jax.runtime.compressed import CompressedCache, answer, check_room, compress
from qevict_jax.runtime.results import GenerationResult
from qevict_jax.runtime.sampling import SamplerConfig
from qevict_jax.runtime.streaming import TextStream

DEFAULT_QUESTION_AGNOSTIC_METHOD = "qevict-gated"
"""The default of ``compress`` and ``qevict ask``: the best question-agnostic method in the records
(docs/results.md, "Gating the discount by where the best match is"; held out, context compressed before the
question at β 0.2): SmolLM2 RULER 2K six tasks 41.6 against the default ``qevict``'s 38.9 (4K: 31.5 against
30.8), Qwen2.5-Coder-0.5B 4K niah_multikey_2 50 against 45. It is not the project's default method because it
moves the next-token distribution further from Full-KV's when the question is in the prompt."""

QUESTION_SEPARATOR = "\n\n"
"""Between the context and the question in the user message (as ``qevict generate --question`` joins them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextPrompt:
    """How a context and its questions are tokenized: ``prefix`` is the rendered prompt up to the end of the
    context (the chat template's opening and the context, or the context alone without ``chat``).
    ``context_ids`` are the prefix's tokens that the separator after it leaves unchanged (a context ending in
    a newline shares a token with the separator: that token goes to the question, as ``qevict generate
    --question-agnostic`` splits it), and a question's tokens are the rest of the whole prompt's, so context
    + question tokens are the prompt ``qevict generate --question`` tokenizes (checked: a prompt whose tokens
    do not start with the context's is an error)."""

    tokenizer: Tokenizer
    context: str
    chat: bool
    prefix: str
    context_ids: tuple[int, ...]

    @classmethod
    def render(cls, tokenizer: Tokenizer, context: str, *, chat: bool = True) -> ContextPrompt:
        """The prompt of ``context``; a ValueError for an empty (or all-whitespace) context."""
        if not context.strip():
            raise ValueError("the context is empty: give the text to compress")
        chat = chat and bool(tokenizer.chat_template)
        text = cls._render(tokenizer, context, chat)
        cut = text.rindex(context) + len(context) if chat else len(context)
        n = token_index(tokenizer, text[:cut] + QUESTION_SEPARATOR, cut)
        ids = tuple(tokenizer.encode(text[:cut])[:n])
        return cls(tokenizer=tokenizer, context=context, chat=chat, prefix=text[:cut], context_ids=ids)

    @staticmethod
    def _render(tokenizer: Tokenizer, user: str, chat: bool) -> str:
        if not chat:
            return user
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)

    def question_ids(self, question: str, *, what: str = "question") -> list[int]:
        """Token ids of the prompt after the context with ``question``; a ValueError naming ``what`` for a
        question that is empty or not a string."""
        if not isinstance(question, str):
            raise ValueError(f"{what} must be a string, got {type(question).__name__}")
        if not question.strip():
            raise ValueError(f"{what} is empty")
        text = self._render(self.tokenizer, f"{self.context}{QUESTION_SEPARATOR}{question}", self.chat)
        ids, n = self.tokenizer.encode(text), len(self.context_ids)
        if not text.startswith(self.prefix) or tuple(ids[:n]) != self.context_ids:
            raise ValueError(f"{what}: the prompt with it does not start with the context's tokens")
        return ids[n:]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Answer:
    """One question's answer from a ``CompressedContext``. ``result`` is the batch's ``GenerationResult``
    (``row``: this answer's row in it); ``ttft_s`` and ``decode_tokens_per_s`` are the batch's.
    memory_ratio: this row's share of the final cache's bytes / the uncompressed 16-bit cache of context +
    question + answer (the cache holds the answer's tokens but its last)."""

    question: str
    text: str
    tokens: tuple[int, ...]
    question_tokens: int
    cache_bytes: int
    full_kv_bytes: int
    ttft_s: float
    decode_tokens_per_s: float
    row: int
    result: GenerationResult

    @property
    def memory_ratio(self) -> float:
        return self.cache_bytes / self.full_kv_bytes


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CompressedContext(CompressedCache):
    """A context compressed once (``Pipeline.compress``), read-only: ``ask`` / ``ask_many`` answer from
    copies of ``cache``. Its fields are ``CompressedCache``'s (the pytree, leaves [L, 1, ...]; ``method``,
    what built it, Full-KV where compressing saved nothing, and ``requested_method``; ``context_tokens``;
    ``cache_bytes`` and ``memory_ratio``, its measured bytes over the uncompressed 16-bit cache of the
    context's tokens) with the model, the prompt and the stop tokens to answer with."""

    model: Any
    prompt: ContextPrompt
    eos_ids: tuple[int, ...]

    def question_ids(
        self, questions: Sequence[str], max_new_tokens: int, *, what: str = "question"
    ) -> list[list[int]]:
        """Token ids of each question, checked before any compute: at least one question, none empty, each
        fitting the model's context after the context with ``max_new_tokens``; errors name ``what`` and the
        question's number (from 1)."""
        if isinstance(questions, str) or not isinstance(questions, Sequence):
            raise ValueError(f"{what}s must be a list of strings, got {type(questions).__name__}")
        if not questions:
            raise ValueError(f"no {what} given: give at least one")
        ids = []
        for i, q in enumerate(questions):
            label = f"{what} {i + 1}" if len(questions) > 1 else what
            ids.append(self.prompt.question_ids(q, what=label))
            check_room(self.context_tokens, len(ids[-1]), max_new_tokens, self.model.cfg, what=label)
        return ids

    def ask(
        self,
        question: str | Sequence[str],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stream: Callable[[str], object] | None = None,
    ) -> Answer | list[Answer]:
        """Answer ``question`` (a list: ``ask_many``); ``stream`` receives a single answer's text piece by
        piece as it is produced."""
        if not isinstance(question, str):
            if stream is not None:
                raise ValueError("stream follows one answer: ask one question at a time to stream it")
            return self.ask_many(
                question, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
            )
        return self._answer([question], max_new_tokens, temperature, top_p, seed, stream)[0]

    def ask_many(
        self,
        questions: Sequence[str],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[Answer]:
        """Answer ``questions`` as one batch (one append and one decode loop for all); each row starts from
        its own copy of the compressed cache. Greedy answers equal ``ask``'s one at a time when the questions
        have the same token count (Ω decode steps apart in general: a batch's routing events follow its first
        row's count, ``runtime.compressed.answer``)."""
        return self._answer(questions, max_new_tokens, temperature, top_p, seed, None)

    def _answer(
        self,
        questions: Sequence[str],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stream: Callable[[str], object] | None,
    ) -> list[Answer]:
        sampler = SamplerConfig(max_new_tokens, temperature, top_p, self.eos_ids)  # bad values raise here
        ids = self.question_ids(questions, max_new_tokens)
        tok = self.prompt.tokenizer
        sink = None if stream is None else TextStream(decode=tok.decode, write=stream)
        res = answer(self.model, self, ids, sampler, seed=seed, on_token=sink)
        per_row = res.cache_bytes // len(ids)  # rows are copies of one cache: equal bytes each
        return [
            Answer(
                question=q,
                text=tok.decode(res.tokens[i]),
                tokens=tuple(res.tokens[i]),
                question_tokens=len(ids[i]),
                cache_bytes=per_row,
                full_kv_bytes=self._full_bytes(len(ids[i]) + len(res.tokens[i]) - 1),
                ttft_s=res.ttft_s,
                decode_tokens_per_s=res.decode_tokens_per_s,
                row=i,
                result=res,
            )
            for i, q in enumerate(questions)
        ]

    def _full_bytes(self, after_context: int) -> int:
        return full_kv_bytes(self.model.cfg, self.context_tokens + after_context, self.kv_dtype)


def compress_context(
    model: Any,
    tokenizer: Tokenizer,
    context: str,
    method: KVMethod,
    *,
    eos_ids: tuple[int, ...],
    question_tokens: int = 64,
    max_new_tokens: int = 64,
    chat: bool = True,
    seed: int = 0,
    kv_dtype: Any,
) -> CompressedContext:
    """Compress ``context`` (text) through ``method`` into a ``CompressedContext`` (``Pipeline.compress``)."""
    prompt = ContextPrompt.render(tokenizer, context, chat=chat)
    stored = compress(
        model,
        list(prompt.context_ids),
        method,
        question_tokens=question_tokens,
        max_new_tokens=max_new_tokens,
        seed=seed,
        kv_dtype=kv_dtype,
    )
    fields = {f.name: getattr(stored, f.name) for f in dataclasses.fields(CompressedCache)}
    return CompressedContext(**fields, model=model, prompt=prompt, eos_ids=eos_ids)
