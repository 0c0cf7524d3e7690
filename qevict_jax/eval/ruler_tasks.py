"""RULER's tasks (NVIDIA/RULER ``scripts/data/synthetic``: ``niah.py``, ``variable_tracking.py``,
``common_words_extraction.py``, ``freq_words_extraction.py``, ``synthetic.yaml``): their prompt templates and
generation lengths, one spec per task, and the seeded builders that turn a spec and a haystack size into a
prompt (``TaskSpec.builder``); ``fit`` finds the largest haystack that fits a token limit.

A builder ``build(n)`` returns (input text, answer prefix, answers, context, answer depths, haystack kind)
for a haystack of ``n`` units; it is a pure function of the spec, the seed string and n.
"""

from __future__ import annotations

import dataclasses
import math
import random
import string
from collections.abc import Callable, Sequence
from typing import ClassVar

from qevict_jax.eval.haystack import (
    NEEDLE,
    NOISE,
    haystack_units,
    insert_at_depths,
    random_value,
    separator,
    vocabulary,
)

CountTokens = Callable[[str], int]
Builder = Callable[[int], tuple]

# RULER's 40 candidate needle depths, in percent of the haystack
DEPTHS = tuple(round(100 * i / 39) for i in range(40))

TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
        "above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
        "the dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
}


@dataclasses.dataclass(frozen=True)
class Request:
    """What one sample asks of its task's builder (``TaskSpec.builder``): the seed string ``base``, the
    haystack override (None = the task's own) and the depth of the first answer needle (None = seeded), the
    caller's token counter, and the lengths: the whole sequence and the tokens reserved for the answer."""

    base: str
    haystack: str | None
    depth: float | None
    count_tokens: CountTokens
    max_seq_length: int
    tokens_to_generate: int


@dataclasses.dataclass(frozen=True)
class NiahSpec:
    """One needle-in-a-haystack configuration (RULER ``niah.py`` arguments)."""

    haystack: str  # noise | essay | needle
    type_k: str  # words | numbers | uuids
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    tokens_to_generate: ClassVar[int] = 128  # RULER's generation length for niah

    def builder(self, req: Request) -> Builder:
        return _niah_builder(self, req.base, req.haystack or self.haystack, req.depth)


@dataclasses.dataclass(frozen=True)
class VtSpec:
    """Variable tracking (RULER ``variable_tracking.py``): chains of ``num_hops`` assignments."""

    haystack: str = "noise"
    num_chains: int = 1
    num_hops: int = 4
    tokens_to_generate: ClassVar[int] = 30  # RULER's generation length for variable_tracking

    def builder(self, req: Request) -> Builder:
        return _vt_builder(self, req.base, req.haystack or self.haystack, req.count_tokens)


@dataclasses.dataclass(frozen=True)
class CweSpec:
    """Common-words extraction (RULER ``common_words_extraction.py``)."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    num_fewshot: int = 1
    tokens_to_generate: ClassVar[int] = 120  # RULER's generation length for common_words_extraction

    def builder(self, req: Request) -> Builder:
        return _cwe_builder(self, req.base, req.max_seq_length)


@dataclasses.dataclass(frozen=True)
class FweSpec:
    """Frequent-words extraction (RULER ``freq_words_extraction.py``)."""

    alpha: float = 2.0
    coded_wordlen: int = 6
    tokens_to_generate: ClassVar[int] = 50  # RULER's generation length for freq_words_extraction

    def builder(self, req: Request) -> Builder:
        return _fwe_builder(self, req.base, req.max_seq_length - req.tokens_to_generate)


TaskSpec = NiahSpec | VtSpec | CweSpec | FweSpec

TASKS: dict[str, TaskSpec] = {
    "niah_single_1": NiahSpec("noise", "words", "numbers"),
    "niah_single_2": NiahSpec("essay", "words", "numbers"),
    "niah_single_3": NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": NiahSpec("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": NiahSpec("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahSpec("essay", "words", "numbers", num_k=4, num_q=4),
    "vt": VtSpec(),
    "cwe": CweSpec(),
    "fwe": FweSpec(),
}


# ---------------------------------------------------------------------------------------------------------
# sizing: the largest haystack that fits


def fit(build, count_tokens: CountTokens, limit: int, task: str, max_seq_length: int):
    """Largest n >= 1 with count_tokens(prompt of build(n)) <= limit, and build(n) (binary search)."""

    def fits(n: int) -> bool:
        parts = build(n)
        return count_tokens(parts[0] + parts[1]) <= limit

    if not fits(1):
        raise ValueError(f"max_seq_length={max_seq_length} is too small for the {task} prompt")
    # estimate from two points, then bracket and bisect
    t1 = count_tokens("".join(build(1)[:2]))
    t64 = count_tokens("".join(build(64)[:2]))
    per = max((t64 - t1) / 63, 1e-3)
    est = max(1, int(1 + (limit - t1) / per))
    lo, hi = max(1, int(est * 0.9)), int(est * 1.1) + 2
    while lo > 1 and not fits(lo):
        lo = max(1, lo // 2)
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, build(lo)


# ---------------------------------------------------------------------------------------------------------
# niah


def _niah_builder(spec: NiahSpec, base: str, haystack: str, depth: float | None):
    rng = random.Random(base)
    keys, values, needles = [], [], []
    for _ in range(spec.num_k):
        keys.append(random_value(rng, spec.type_k))
        values.append([random_value(rng, spec.type_v) for _ in range(spec.num_v)])
        needles += [NEEDLE.format(type_needle_v=spec.type_v, key=keys[-1], value=v) for v in values[-1]]
    depths = [d / 100 for d in rng.sample(DEPTHS, len(needles))]
    queried = rng.sample(range(spec.num_k), spec.num_q)
    if depth is not None:  # the first answer needle goes to the requested depth
        depths[queried[0] * spec.num_v] = depth
    answers = [v for i in queried for v in values[i]]
    answer_needles = [i * spec.num_v + j for i in queried for j in range(spec.num_v)]
    qkeys = [keys[i] for i in queried]
    query = ", ".join(qkeys[:-1]) + ", and " + qkeys[-1] if len(qkeys) > 1 else qkeys[0]
    template, prefix = TEMPLATES["niah"]
    type_v = spec.type_v
    if spec.num_q * spec.num_v == 1:  # RULER's singular wording
        template, prefix = (_singular(t) for t in (template, prefix))
        type_v = type_v[:-1]
    units = haystack_units(haystack, random.Random(base + ":haystack"), spec.type_k, spec.type_v)
    sep = separator(haystack)

    def build(n: int):
        context, realized = insert_at_depths(units.first(n), list(zip(needles, depths, strict=True)), sep)
        text = template.format(type_needle_v=type_v, context=context, query=query)
        answer_depths = [realized[i] for i in answer_needles]
        return (
            text,
            prefix.format(type_needle_v=type_v, query=query),
            answers,
            context,
            answer_depths,
            haystack,
        )

    return build


def _singular(template: str) -> str:
    """RULER's rewording of the niah template when one value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template


# ---------------------------------------------------------------------------------------------------------
# variable tracking


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, name_len: int, value: str | None = None):
    """Chains "VAR A = 12345", "VAR B = VAR A ", ...: (variable names per chain, statements per chain)."""
    names: list[str] = []
    while len(set(names)) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=name_len))
        if name not in names:
            names.append(name)
    chains, all_vars = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1) : (c + 1) * (num_hops + 1)]
        first = value if value is not None else str(rng.randint(10000, 99999))
        chain = [f"VAR {vs[0]} = {first}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        all_vars.append(vs)
        chains.append(chain)
    return all_vars, chains


def _vt_text(
    chains, positions, units: list[str], haystack: str, num_hops: int, value: str
) -> tuple[str, str, str]:
    """Insert each chain's statements, in order, at its sorted positions; format the vt template."""
    inserts = []
    for chain, pos in zip(chains, positions, strict=True):
        for stmt, d in zip(chain, pos, strict=True):
            inserts.append((stmt.strip() + "." if haystack == "essay" else stmt, d))
    context, _ = insert_at_depths(units, inserts, separator(haystack))
    context = context.replace(". \n", ".\n")
    template, prefix = TEMPLATES["variable_tracking"]
    fmt = {"context": context, "query": value, "num_v": num_hops + 1}
    return template.format(**fmt), prefix.format(**fmt), context


def _vt_builder(spec: VtSpec, base: str, haystack: str, count_tokens: CountTokens):
    rng = random.Random(base)
    variables, chains = _vt_chains(rng, spec.num_chains, spec.num_hops, 5)
    value = chains[0][0].split("=")[-1].strip()
    positions = [sorted(rng.random() for _ in chain) for chain in chains]
    units = haystack_units(haystack, random.Random(base + ":haystack"))
    icl = _vt_icl_example(spec, random.Random(base + ":icl"), count_tokens)

    def build(n: int):
        text, prefix, context = _vt_text(chains, positions, units.first(n), haystack, spec.num_hops, value)
        return icl + "\n" + text, prefix, variables[0], context, [], haystack

    return build


def _vt_icl_example(
    spec: VtSpec, rng: random.Random, count_tokens: CountTokens, max_tokens: int = 500
) -> str:
    """RULER's in-context example: a vt sample of <= 500 tokens (3-letter names) followed by its answer."""
    variables, chains = _vt_chains(rng, spec.num_chains, spec.num_hops, 3)
    value = chains[0][0].split("=")[-1].strip()
    positions = [sorted(rng.random() for _ in chain) for chain in chains]

    def build(n: int):
        text, prefix, _ = _vt_text(chains, positions, [NOISE] * n, "noise", spec.num_hops, value)
        return text, prefix

    _, (text, prefix) = fit(build, count_tokens, max_tokens, "vt example", max_tokens)
    return text + prefix + " " + " ".join(variables[0]) + "\n"


# ---------------------------------------------------------------------------------------------------------
# common words extraction


def _word_pool(rng: random.Random, n: int) -> list[str]:
    """n distinct words: the pydoc vocabulary, extended with seeded pseudo-words when n exceeds it."""
    words = list(vocabulary())
    seen = set(words)
    while len(words) < n:
        w = "".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(rng.randint(2, 4)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_example(rng: random.Random, num_words: int, common_repeats: int, uncommon_repeats: int, num_cw: int):
    """RULER ``get_example``: (numbered shuffled word list, the common words)."""
    chosen = rng.sample(_word_pool(rng, num_words), num_words)
    common, uncommon = chosen[:num_cw], chosen[num_cw:]
    words = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(words)
    return _numbered(words), common


def _cwe_builder(spec: CweSpec, base: str, max_seq_length: int):
    template, prefix = TEMPLATES["common_words_extraction"]
    small = max_seq_length < 4096

    def build(n: int):
        rng = random.Random(f"{base}:{n}")
        shots = []
        for _ in range(spec.num_fewshot):
            ctx, ans = (
                _cwe_example(rng, 20, 3, 1, spec.num_cw)
                if small
                else _cwe_example(rng, 40, 10, 3, spec.num_cw)
            )
            shots.append(template.format(context=ctx) + prefix + " " + _numbered(ans))
        cr, ur = (6, 1) if small else (spec.freq_cw, spec.freq_ucw)
        context, answer = _cwe_example(rng, spec.num_cw + n, cr, ur, spec.num_cw)
        return (
            "\n".join(shots) + "\n" + template.format(context=context),
            prefix,
            answer,
            context,
            [],
            "words",
        )

    return build


# ---------------------------------------------------------------------------------------------------------
# frequent words extraction


def zeta(alpha: float, terms: int = 10_000) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum plus Euler-Maclaurin tail)."""
    if alpha <= 1:
        raise ValueError("zeta needs alpha > 1")
    partial = math.fsum(k**-alpha for k in range(1, terms))
    return partial + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms**-alpha


def _fwe_builder(spec: FweSpec, base: str, input_max_len: int):
    rng = random.Random(base)
    vocab_size = max(input_max_len // 50, 5)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=spec.coded_wordlen)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # the most frequent word is noise
    z = zeta(spec.alpha)
    template, prefix = TEMPLATES["freq_words_extraction"]

    def build(n: int):
        counts = [int(n * k**-spec.alpha / z) for k in range(1, len(words) + 1)]
        sampled = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
        random.Random(f"{base}:{n}").shuffle(sampled)
        context = " ".join(sampled)
        return template.format(context=context), prefix, words[1:4], context, [], "coded"

    return build
