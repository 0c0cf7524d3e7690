"""RULER's haystacks and needle values (NVIDIA/RULER ``scripts/data/synthetic``): the repeated noise sentences,
real prose (RULER's "essay"; here the Python reference manual in ``pydoc_data``, cut into sentences), lines of
distractor needles, the random keys and values of needles, and the insertion of texts at relative depths.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from collections.abc import Sequence

from qevict_jax.eval.needle import prose_paragraphs

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
HAYSTACKS = ("noise", "essay", "needle")


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Distinct lower-case words (3-12 letters) of the pydoc prose, sorted: keys and common words."""
    text = " ".join(prose_paragraphs())
    return tuple(sorted(set(re.findall(r"\b[a-z]{3,12}\b", text))))


def random_value(rng: random.Random, kind: str) -> str:
    """RULER's random needle keys/values: 7-digit numbers, two joined words, or UUID4s."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        words = vocabulary()
        return f"{rng.choice(words)}-{rng.choice(words)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _sentences(start: int, max_chars: int = 300):
    """Sentences of the pydoc prose, from paragraph ``start`` on, cycling (generator).

    A sentence longer than ``max_chars`` (grammar rules, tables) comes in pieces cut at spaces, so the
    haystack can be filled to within a short unit of the requested length.
    """
    paras = prose_paragraphs()
    split = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
    i = start
    while True:
        for sentence in split.split(paras[i % len(paras)]):
            yield from _pieces(sentence, max_chars)
        i += 1


def _pieces(text: str, max_chars: int) -> list[str]:
    """``text`` cut at spaces into pieces of at most ``max_chars`` characters (a longer word stays whole)."""
    pieces, cur = [], ""
    for word in text.split(" "):
        if cur and len(cur) + 1 + len(word) > max_chars:
            pieces.append(cur)
            cur = word
        else:
            cur = f"{cur} {word}" if cur else word
    return [*pieces, cur] if cur else pieces


class _Units:
    """A lazily extended, prefix-stable list of haystack units (the first n never change as n grows)."""

    def __init__(self, source) -> None:
        self._source = source
        self._items: list[str] = []

    def first(self, n: int) -> list[str]:
        while len(self._items) < n:
            self._items.append(next(self._source))
        return self._items[:n]


def haystack_units(kind: str, rng: random.Random, type_k: str = "words", type_v: str = "numbers") -> _Units:
    if kind == "noise":
        return _Units(iter(lambda: NOISE, None))
    if kind == "essay":
        return _Units(_sentences(rng.randrange(len(prose_paragraphs()))))
    if kind == "needle":

        def distractors():
            while True:
                key, value = random_value(rng, type_k), random_value(rng, type_v)
                yield NEEDLE.format(type_needle_v=type_v, key=key, value=value)

        return _Units(distractors())
    raise ValueError(f"unknown haystack {kind!r}")


def separator(kind: str) -> str:
    """RULER joins essay sentences with spaces and noise / needle lines with newlines."""
    return " " if kind == "essay" else "\n"


def insert_at_depths(
    units: Sequence[str], inserts: Sequence[tuple[str, float]], sep: str
) -> tuple[str, list[float]]:
    """Insert texts at relative depths (fractions of the haystack's characters) between units.

    Each insert goes to the unit boundary nearest to its depth; inserts at one boundary keep their order.
    Returns the joined text and the realized depth of every insert (in the order given).
    """
    bounds = [0]
    for u in units:
        bounds.append(bounds[-1] + len(u) + len(sep))
    total = max(bounds[-1] - len(sep), 1) if units else 1
    slots = []
    for order, (_, d) in enumerate(inserts):
        target = d * total
        at = min(range(len(bounds)), key=lambda i: (abs(bounds[i] - target), i))
        slots.append((at, order))
    pieces: list[str] = []
    ranked = sorted(slots)
    k = 0
    for i in range(len(units) + 1):
        while k < len(ranked) and ranked[k][0] == i:
            pieces.append(inserts[ranked[k][1]][0])
            k += 1
        if i < len(units):
            pieces.append(units[i])
    realized = [min(bounds[at], total) / total for at, _ in slots]
    return sep.join(pieces), realized
