"""What generation returns: ``GenerationResult`` (tokens, timings, the final cache and its measured size, what
a later turn continues from) and ``TeacherForcedResult`` (log-probabilities under teacher forcing)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qevict_jax.core.kv import DEFAULT_KV_DTYPE


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Generated tokens per row (EOS included when hit), timings and the final cache.

    ``generate(..., past=result)`` continues the conversation: ``next_positions`` [B] are the tokens each
    row's cache holds and ``pending`` [B] the last sampled token of each row, not yet in the cache (a row
    that hit EOS before the others has been fed EOS while they finished). ``history`` [B] holds those tokens
    themselves (``next_positions[b] + 1`` per row, pending last): a conversation still kept whole is
    compressed from them at the turn where the method first saves bytes (``generate``'s ``past``).
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
    compressed: bool = False  # the cache compresses (False: every token kept, e.g. a prompt too short to gain)
    requested_method: Any = None  # the method asked for (``method`` is Full-KV when it had nothing to save)
    history: list[list[int]] = dataclasses.field(default_factory=list)  # per row: cache tokens + pending
    compressed_at: list[int] | None = None  # per row: the sequence's tokens when compressed (None: not yet)
    note: str | None = None  # one line when the method ran at another β than asked (``prefill.fit_method``)

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


@dataclasses.dataclass
class TeacherForcedResult:
    """Log-probabilities of teacher-forced decoding (``teacher_forced.teacher_forced``) and the cache's measured size
    against the uncompressed cache of every row's final length."""

    logprobs: np.ndarray  # [B, T, V] float32 log-probabilities at each target position
    cache_bytes: int
    full_kv_bytes: int

    @property
    def memory_ratio(self) -> float:
        return self.cache_bytes / self.full_kv_bytes
