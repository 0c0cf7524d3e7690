"""Fidelity: how far a compressed cache moves the next-token distribution from Full-KV's, on real text.

A sample is a span of the Python reference manual (``pydoc_data``, from a seeded paragraph): a prefix of
``length`` tokens is prefilled, then the next ``targets`` tokens are fed one by one (teacher forcing, exactly
as in decoding). At every target position we compare the method's log-probabilities q with Full-KV's p:

- KL(p || q) = sum_v p_v (log p_v - log q_v), averaged over positions (nats);
- top-1 agreement: share of positions where argmax q == argmax p;
- perplexity exp(mean -log q[target]) of the real continuation, and its change against Full-KV's.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import numpy as np

from qevict_jax.eval.needle import prose_paragraphs


@dataclasses.dataclass(frozen=True)
class FidelitySample:
    prefix: list[int]  # [length] prompt tokens
    targets: list[int]  # [T] continuation tokens, teacher-forced
    start_paragraph: int


def fidelity_sample(
    seed: int, length: int, num_targets: int, encode: Callable[[str], list[int]], bos: list[int] | None = None
) -> FidelitySample:
    """``length`` prefix tokens (``bos`` first, if given) and ``num_targets`` following tokens of
    pydoc prose."""
    if length < 1 or num_targets < 1:
        raise ValueError("length and num_targets must be >= 1")
    paras = prose_paragraphs()
    start = random.Random(f"fidelity:{seed}").randrange(len(paras))
    bos = list(bos or [])
    need = length + num_targets - len(bos)
    ids: list[int] = []
    i = start
    while len(ids) < need:
        ids += encode(paras[i % len(paras)] + "\n\n")
        i += 1
        if i - start > 10 * len(paras):
            raise ValueError("the tokenizer produced no tokens for the prose")
    seq = bos + ids[:need]
    return FidelitySample(prefix=seq[:length], targets=seq[length:], start_paragraph=start)


@dataclasses.dataclass(frozen=True)
class FidelityStats:
    kl: float  # mean KL(Full-KV || method) over positions, nats
    top1: float  # share of positions whose argmax agrees with Full-KV's
    ppl: float  # perplexity of the targets under the method
    ppl_full: float  # perplexity of the targets under Full-KV

    @property
    def ppl_change(self) -> float:
        """Relative perplexity change against Full-KV (0.05 = 5% higher)."""
        return self.ppl / self.ppl_full - 1.0


def fidelity_stats(
    full_logprobs: np.ndarray, method_logprobs: np.ndarray, targets: np.ndarray
) -> FidelityStats:
    """Compare log-probabilities [T, V] of a method with Full-KV's at the teacher-forced positions
    ``targets`` [T]."""
    p_log = np.asarray(full_logprobs, np.float64)
    q_log = np.asarray(method_logprobs, np.float64)
    targets = np.asarray(targets)
    if p_log.shape != q_log.shape or p_log.ndim != 2 or targets.shape != p_log.shape[:1]:
        raise ValueError(f"shapes do not match: {p_log.shape}, {q_log.shape}, targets {targets.shape}")
    p = np.exp(p_log)
    # 0 * log 0 = 0; a -inf in q where p > 0 gives an infinite KL, as it should
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (p_log - q_log), 0.0)
    kl = float(terms.sum(axis=-1).mean())
    top1 = float((p_log.argmax(-1) == q_log.argmax(-1)).mean())
    rows = np.arange(len(targets))
    ppl = math.exp(-float(q_log[rows, targets].mean()))
    ppl_full = math.exp(-float(p_log[rows, targets].mean()))
    return FidelityStats(kl=kl, top1=top1, ppl=ppl, ppl_full=ppl_full)
