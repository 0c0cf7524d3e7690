"""One import to generate or chat on a compressed cache: ``qevict_jax.load(name)`` returns a ``Pipeline`` that
holds the model and its tokenizer.

    pipe = qevict_jax.load("smollm2-135m-instruct")
    reply = pipe.generate("What is a KV cache?", method="qevict:0.2,n_obs=64", max_new_tokens=64)
    chat = pipe.chat(method="qevict", budget=0.2)
    chat.send("Hello!"); chat.send("And what did I just say?")   # each turn appended to the one cache
    # kept whole while too short to gain; compressed (reply.compressed_turn) at the first turn that gains

A method is a ``KVMethod`` object, a registry name, or a spec string ``"name[:budget][,option=value...]"``
(``"qevict:0.2,n_obs=64"``, ``"snapkv:0.1"``, ``"full"``); ``budget=`` and keyword options apply to a name or
spec (a spec's own values win). Everything runs through ``qevict_jax.runtime.generate.generate``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from models.checkpoint import load_model
from models.registry import DEFAULT_MODEL, resolve_model
from models.tokenizer import Tokenizer
from qevict_jax.compressed import DEFAULT_QUESTION_AGNOSTIC_METHOD, CompressedContext, compress_context
from qevict_jax.core.kv import DEFAULT_KV_DTYPE, KVMethod
from qevict_jax.methods.options import parse_method_spec
from qevict_jax.methods.registry import bind_tokenizer, make_method
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.results import GenerationResult
from qevict_jax.runtime.sampling import SamplerConfig
from qevict_jax.runtime.streaming import TextStream

Messages = Sequence[Mapping[str, str]]


def resolve_method(method: str | KVMethod, budget: float | None = None, **options: Any) -> KVMethod:
    """A ``KVMethod`` from an object (returned as is), a name or a spec string (``parse_method_spec``)."""
    if not isinstance(method, str):
        if budget is not None or options:
            raise ValueError("budget and options apply to a method name or spec, not to a method object")
        return method
    name, spec_budget, spec_options = parse_method_spec(method)
    beta = spec_budget if spec_budget is not None else budget
    opts = {**options, **spec_options}
    if name == "full":
        return make_method(name, **opts)
    return make_method(name, 0.2 if beta is None else beta, **opts)


@dataclasses.dataclass(frozen=True)
class Reply:
    """One generated answer and what its cache measured (``result`` holds everything else)."""

    text: str
    prompt_tokens: int
    compressed: bool  # False: the sequence is still too short to gain from compression and is kept whole
    memory_ratio: float  # cache bytes / bytes of the uncompressed 16-bit cache at the final length
    ttft_s: float
    decode_tokens_per_s: float
    result: GenerationResult
    compressed_turn: int | None = None  # the turn (1: the first) whose sequence was compressed; None: not yet
    compressed_at: int | None = None  # tokens of the sequence when it was compressed; None: not yet
    note: str | None = None  # one line when the method ran at another β than asked (also a UserWarning)

    @property
    def method(self) -> str:
        return self.result.requested_method.name


@dataclasses.dataclass
class Pipeline:
    """A model and its tokenizer, ready to generate (``generate``) or hold a conversation (``chat``)."""

    model: Any
    tokenizer: Tokenizer
    kv_dtype: Any = DEFAULT_KV_DTYPE

    def encode(self, prompt: str | Messages, *, chat: bool = True) -> list[int]:
        """Token ids of a prompt: a string (wrapped as one user message when ``chat`` and the tokenizer has a
        template) or a list of ``{"role", "content"}`` messages (always templated)."""
        tok = self.tokenizer
        if isinstance(prompt, str) and not (chat and tok.chat_template):
            return tok.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if not tok.chat_template:
            raise ValueError("this tokenizer has no chat template: pass the prompt as a string")
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))

    def sampler(self, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0) -> SamplerConfig:
        eos = tuple(sorted(set(self.model.cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        return SamplerConfig(max_new_tokens, temperature, top_p, eos)

    def reply(self, result: GenerationResult, *, compressed_turn: int | None = None) -> Reply:
        """Row 0 of ``result``; ``compressed_turn``: the turn compression started at (a conversation's), by
        default the first when ``result`` is compressed. A ``note`` is also issued as a UserWarning."""
        if result.note is not None:
            warnings.warn(result.note, UserWarning, stacklevel=3)
        compressed = result.compressed
        return Reply(
            text=self.tokenizer.decode(result.tokens[0]),
            prompt_tokens=result.prompt_lengths[0],
            compressed=compressed,
            memory_ratio=result.memory_ratio,
            ttft_s=result.ttft_s,
            decode_tokens_per_s=result.decode_tokens_per_s,
            result=result,
            compressed_turn=(compressed_turn or 1) if compressed else None,
            compressed_at=result.compressed_at[0] if compressed and result.compressed_at else None,
            note=result.note,
        )

    def compress(
        self,
        context: str,
        *,
        method: str | KVMethod = DEFAULT_QUESTION_AGNOSTIC_METHOD,
        budget: float | None = None,
        question_tokens: int = 64,
        max_new_tokens: int = 64,
        chat: bool = True,
        seed: int = 0,
        **options: Any,
    ) -> CompressedContext:
        """Compress ``context`` once, before any question, and return it to be asked (``CompressedContext.ask``,
        ``.ask_many``): every answer starts from the same compressed cache.

        The default method is ``qevict-gated``, the best question-agnostic method in the records (held out,
        context compressed before the question, β 0.2): SmolLM2 RULER 2K six tasks 41.6 against 38.9 for the
        default ``qevict``; Qwen2.5-Coder-0.5B 4K niah_multikey_2 50 against 45 (docs/results.md).
        ``budget``: β (default 0.2); the cache is sized for a question of ``question_tokens`` tokens and an
        answer of ``max_new_tokens`` (β of that uncompressed length, as ``generate`` sizes a prompt; longer
        ones still run where the method can grow). An empty context, or one that leaves no room in the
        model's context, is a ValueError before any compute.
        """
        return compress_context(
            self.model,
            self.tokenizer,
            context,
            bind_tokenizer(resolve_method(method, budget, **options), self.tokenizer),
            eos_ids=self.sampler(1).eos_ids,
            question_tokens=question_tokens,
            max_new_tokens=max_new_tokens,
            chat=chat,
            seed=seed,
            kv_dtype=self.kv_dtype,
        )

    def generate(
        self,
        prompt: str | Messages,
        *,
        method: str | KVMethod = "qevict",
        budget: float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        chat: bool = True,
        stream: Callable[[str], object] | None = None,
        **options: Any,
    ) -> Reply:
        """Generate an answer to ``prompt`` through ``method`` at ``budget`` (β; default 0.2) with ``options``;
        ``stream`` receives the answer's text piece by piece as it is produced (e.g. ``print`` with
        ``end=""``)."""
        kv_method = bind_tokenizer(resolve_method(method, budget, **options), self.tokenizer)
        sampler = self.sampler(max_new_tokens, temperature, top_p)
        ids = self.encode(prompt, chat=chat)
        result = generate(
            self.model,
            [ids],
            sampler,
            kv_method,
            seed=seed,
            kv_dtype=self.kv_dtype,
            on_token=self.text_stream(stream),
        )
        return self.reply(result)

    def text_stream(self, write: Callable[[str], object] | None) -> TextStream | None:
        """The token sink that decodes row 0's tokens and hands ``write`` each new piece of text."""
        return None if write is None else TextStream(decode=self.tokenizer.decode, write=write)

    def chat(
        self,
        *,
        method: str | KVMethod = "qevict",
        budget: float | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        **options: Any,
    ) -> Conversation:
        """A conversation whose turns are appended to one cache (``Conversation.send``), kept whole while the
        conversation is too short for ``method`` to gain and compressed from the first turn where it gains."""
        kv_method = bind_tokenizer(resolve_method(method, budget, **options), self.tokenizer)
        return Conversation(self, kv_method, self.sampler(max_new_tokens, temperature, top_p), seed)


@dataclasses.dataclass
class Conversation:
    """Turns appended to one cache: the first ``send`` prefills the templated message, every later one
    appends only the new turn's tokens (``generate(..., past=...)``), so the cache is continued, not rebuilt.

    While the conversation is too short for ``method`` to save bytes (its smallest cache, or a
    ``budget_bytes`` larger than the uncompressed conversation) the cache is Full-KV; the first turn where
    the method gains compresses the whole conversation so far as a prefill of it would (``generate``'s
    ``past``) and ``compressed_turn`` records that turn. From then on the cache keeps that size: β of the
    conversation at that turn, or ``budget_bytes``. ``messages`` is the transcript."""

    pipeline: Pipeline
    method: KVMethod
    sampler: SamplerConfig
    seed: int = 0
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    last: GenerationResult | None = None
    compressed_turn: int | None = None  # the turn (1: the first) whose sequence was compressed

    def send(self, text: str, *, stream: Callable[[str], object] | None = None) -> Reply:
        """Append a user turn, generate the answer, return it (also appended to ``messages``); ``stream``
        as in ``Pipeline.generate``."""
        pipe, tok = self.pipeline, self.pipeline.tokenizer
        if not tok.chat_template:
            raise ValueError("a conversation needs a tokenizer with a chat template")
        turn = [*self.messages, {"role": "user", "content": text}]
        if self.last is None:
            ids = pipe.encode(turn)
            result = generate(
                pipe.model,
                [ids],
                self.sampler,
                self.method,
                seed=self.seed,
                kv_dtype=pipe.kv_dtype,
                on_token=pipe.text_stream(stream),
                growing=True,
            )
        else:
            result = generate(
                pipe.model,
                [self._next_turn_ids(turn)],
                self.sampler,
                seed=self.seed,
                past=self.last,
                on_token=pipe.text_stream(stream),
            )
        if result.compressed and self.compressed_turn is None:
            self.compressed_turn = len(self.messages) // 2 + 1
        reply = pipe.reply(result, compressed_turn=self.compressed_turn)
        self.messages = [*turn, {"role": "assistant", "content": reply.text}]
        self.last = result
        return reply

    def _next_turn_ids(self, turn: list[dict[str, str]]) -> list[int]:
        """Tokens of the new turn as the template renders it after the last answer. The cache already holds
        the answer's tokens and its last sampled token (the end-of-turn token when it stopped there), so the
        new turn starts where the answer's text ends in the rendered transcript."""
        tok = self.pipeline.tokenizer
        answer = self.messages[-1]["content"].strip()  # templates may trim what surrounds the content
        before = tok.apply_chat_template(self.messages, add_generation_prompt=False)
        full = tok.apply_chat_template(turn, add_generation_prompt=True)
        cut = before.rindex(answer) + len(answer) if answer else len(before)
        if not full.startswith(before[:cut]):
            raise ValueError("the chat template does not render the transcript as a prefix of the next turn")
        rest = full[cut:]
        last = self.last.tokens[0][-1] if self.last.tokens[0] else None
        if last in tok.eos_token_ids:  # already in the cache as the pending token: do not feed it twice
            eos_text = tok.decode([last], skip_special_tokens=False)
            rest = rest[len(eos_text) :] if rest.startswith(eos_text) else rest
        return tok.encode(rest, add_bos=False)


def load(
    name_or_path: str | Path = DEFAULT_MODEL, *, dtype: Any = None, kv_dtype: Any = DEFAULT_KV_DTYPE
) -> Pipeline:
    """The model ``name_or_path`` (a registered name, a converted folder, a Hugging Face folder or a ``.gguf``
    file, converted once into the cache) with its tokenizer. ``dtype``: compute dtype (default the
    checkpoint's); ``kv_dtype``: storage dtype of the KV cache (bfloat16)."""
    path = resolve_model(name_or_path)
    compute = None if dtype is None else jnp.dtype(dtype)
    _, model = load_model(path, dtype=compute)
    return Pipeline(model=model, tokenizer=Tokenizer.from_dir(path), kv_dtype=jnp.dtype(kv_dtype))
