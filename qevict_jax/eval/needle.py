"""Seeded needle-in-a-haystack prompts over real prose (the Python reference manual in ``pydoc_data``).

A RULER-style single needle: "One of the special magic numbers for {key} is: {value}." placed at a chosen
depth of a haystack of whole paragraphs, followed by the question. Scoring: the value appears in the answer.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"
_WORDS = tuple(
    "amber basil cobalt dune ember fjord garnet harbor indigo juniper kestrel lagoon maple nectar onyx "
    "pebble quartz raven saffron thistle umber velvet willow yarrow zephyr".split()
)


@dataclasses.dataclass(frozen=True)
class NeedleSample:
    context: str  # haystack with the needle inside
    question: str
    answer_prefix: str
    answer: str
    depth: float  # requested relative depth of the needle in the haystack


@functools.cache
def prose_paragraphs() -> tuple[str, ...]:
    """Paragraphs of the Python reference manual shipped with CPython (deterministic order)."""
    from pydoc_data.topics import topics

    paras = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if len(text) > 80 and not text.startswith(("*", ">>>", "...", "|")):
                paras.append(text)
    return tuple(paras)


def needle_sample(
    seed: int,
    context_tokens: int,
    count_tokens: Callable[[str], int],
    depth: float | None = None,
) -> NeedleSample:
    """A haystack of about ``context_tokens`` tokens (by ``count_tokens``) with one needle at ``depth``.

    The haystack starts at a seeded paragraph; the key is two seeded words, the value a seeded 7-digit number.
    """
    rng = random.Random(seed)
    paras = prose_paragraphs()
    key = f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}"
    value = str(rng.randint(1_000_000, 9_999_999))
    depth = rng.random() if depth is None else depth
    start = rng.randrange(len(paras))
    chosen: list[str] = []
    total = 0
    i = start
    while total < context_tokens:
        para = paras[i % len(paras)]
        n = count_tokens(para) + 1
        if total + n > context_tokens and chosen:
            break
        chosen.append(para)
        total += n
        i += 1
    needle = NEEDLE.format(key=key, value=value)
    at = round(depth * len(chosen))
    chosen.insert(at, needle)
    return NeedleSample(
        context="\n".join(chosen),
        question=QUESTION.format(key=key),
        answer_prefix=ANSWER_PREFIX.format(key=key),
        answer=value,
        depth=depth,
    )


def needle_prompt_text(sample: NeedleSample) -> str:
    """The user message: instruction, haystack, question."""
    return (
        "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.\n"
        f"{sample.context}\n{sample.question}"
    )


def needle_correct(sample: NeedleSample, answer: str) -> bool:
    return sample.answer in answer
