"""RULER's synthetic tasks, generated here with seeded generators and RULER's prompt templates.

Follows NVIDIA/RULER ``scripts/data/synthetic`` (``constants.py``, ``niah.py``, ``variable_tracking.py``,
``common_words_extraction.py``, ``freq_words_extraction.py``) and ``scripts/synthetic.yaml``:

- ``niah_single_1/2/3``, ``niah_multikey_1/2/3``, ``niah_multivalue``, ``niah_multiquery``: needles
  "One of the special magic {numbers} for {key} is: {value}." in a haystack of RULER's repeated noise
  sentences, of real prose (RULER's "essay"; here the Python reference manual in ``pydoc_data``) or of
  distractor needles;
- ``vt``: variable tracking, one chain of 4 hops in the noise haystack, with RULER's one in-context example;
- ``cwe``: common-words extraction (10 words repeated 30 times among words repeated 3 times; 6 and 1 with a
  smaller example below 4096 tokens), with one in-context example;
- ``fwe``: frequent-words extraction over coded words drawn from a Zipf (zeta, alpha = 2) distribution.

Lengths are counted by the caller's tokenizer: the prompt (template, answer prefix and the chat template's
``overhead_tokens``) plus ``tokens_to_generate`` fit in ``max_seq_length``, filled as far as they go (binary
search over the haystack size, as RULER does). Scoring is RULER's ``string_match_all``.

Differences from RULER, by necessity: keys of type "words" join two words of the pydoc vocabulary instead of
wonderwords' adjective-noun pairs, and the common words come from that vocabulary; every random draw comes
from a ``random.Random`` seeded by (task, seed), so a sample is a pure function of its arguments; a needle's
depth is a fraction of the haystack's characters, at the unit (sentence, line) boundary nearest to it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence

from qevict_jax.eval.metrics import ruler_postprocess, string_match_all
from qevict_jax.needle import prose_paragraphs

CountTokens = Callable[[str], int]

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
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
TOKENS_TO_GENERATE = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
}


@dataclasses.dataclass(frozen=True)
class NiahSpec:
    """One needle-in-a-haystack configuration (RULER ``niah.py`` arguments)."""

    haystack: str  # noise | essay | needle
    type_k: str  # words | numbers | uuids
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    kind: str = "niah"


@dataclasses.dataclass(frozen=True)
class VtSpec:
    haystack: str = "noise"
    num_chains: int = 1
    num_hops: int = 4
    kind: str = "variable_tracking"


@dataclasses.dataclass(frozen=True)
class CweSpec:
    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    num_fewshot: int = 1
    kind: str = "common_words_extraction"


@dataclasses.dataclass(frozen=True)
class FweSpec:
    alpha: float = 2.0
    coded_wordlen: int = 6
    kind: str = "freq_words_extraction"


TASKS: dict[str, NiahSpec | VtSpec | CweSpec | FweSpec] = {
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
HAYSTACKS = ("noise", "essay", "needle")


@dataclasses.dataclass(frozen=True)
class RulerSample:
    """One generated RULER sample: the prompt is ``input`` (user turn) followed by ``answer_prefix``."""

    task: str
    seed: int
    input: str
    answer_prefix: str
    outputs: tuple[str, ...]  # references; score = share found in the prediction
    context: str  # the haystack with the needles (or the word list) inside
    depths: tuple[float, ...]  # realized depth (fraction of haystack characters) of each answer needle
    haystack: str
    tokens: int  # tokens of input + answer_prefix, by the caller's tokenizer (chat template excluded)


def task_names() -> list[str]:
    return list(TASKS)


def tokens_to_generate(task: str) -> int:
    """RULER's generation length for a task."""
    return TOKENS_TO_GENERATE[_spec(task).kind]


def ruler_score(sample: RulerSample, prediction: str) -> float:
    """RULER's ``string_match_all`` on the post-processed prediction, as a fraction in [0, 1]."""
    return string_match_all(ruler_postprocess(prediction), sample.outputs)


def ruler_sample(
    task: str,
    seed: int,
    max_seq_length: int,
    count_tokens: CountTokens,
    *,
    tokens_to_generate: int | None = None,
    overhead_tokens: int = 0,
    haystack: str | None = None,
    depth: float | None = None,
) -> RulerSample:
    """A seeded sample of ``task`` whose prompt + generation fill ``max_seq_length`` tokens.

    tokens_to_generate: reserved for the answer (default RULER's per-task value); overhead_tokens: tokens the
    chat template adds around the prompt; haystack: override RULER's haystack (noise / essay / needle) for the
    niah and vt tasks; depth: relative depth in [0, 1] of the (first) answer needle, RULER's seeded choice
    among its 40 depths when None.
    """
    spec = _spec(task)
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if haystack is not None and haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    gen = TOKENS_TO_GENERATE[spec.kind] if tokens_to_generate is None else tokens_to_generate
    limit = max_seq_length - gen - overhead_tokens
    base = f"{task}:{seed}"
    if isinstance(spec, NiahSpec):
        build = _niah_builder(spec, base, haystack or spec.haystack, depth)
    elif isinstance(spec, VtSpec):
        build = _vt_builder(spec, base, haystack or spec.haystack, count_tokens)
    elif isinstance(spec, CweSpec):
        build = _cwe_builder(spec, base, max_seq_length)
    else:
        build = _fwe_builder(spec, base, max_seq_length - gen)
    _, parts = _fit(build, count_tokens, limit, task, max_seq_length)
    text, prefix, outputs, context, depths, hay = parts
    return RulerSample(
        task=task,
        seed=seed,
        input=text,
        answer_prefix=prefix,
        outputs=tuple(outputs),
        context=context,
        depths=tuple(depths),
        haystack=hay,
        tokens=count_tokens(text + prefix),
    )


def _spec(task: str):
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    return TASKS[task]


# ---------------------------------------------------------------------------------------------------------
# sizing: the largest haystack that fits


def _fit(build, count_tokens: CountTokens, limit: int, task: str, max_seq_length: int):
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
# random values and word pools


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Distinct lower-case words (3-12 letters) of the pydoc prose, sorted: keys and common words."""
    text = " ".join(prose_paragraphs())
    return tuple(sorted(set(re.findall(r"\b[a-z]{3,12}\b", text))))


def _random_value(rng: random.Random, kind: str) -> str:
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


def _haystack_units(kind: str, rng: random.Random, type_k: str = "words", type_v: str = "numbers") -> _Units:
    if kind == "noise":
        return _Units(iter(lambda: NOISE, None))
    if kind == "essay":
        return _Units(_sentences(rng.randrange(len(prose_paragraphs()))))
    if kind == "needle":

        def distractors():
            while True:
                key, value = _random_value(rng, type_k), _random_value(rng, type_v)
                yield NEEDLE.format(type_needle_v=type_v, key=key, value=value)

        return _Units(distractors())
    raise ValueError(f"unknown haystack {kind!r}")


def _separator(kind: str) -> str:
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


# ---------------------------------------------------------------------------------------------------------
# niah


def _niah_builder(spec: NiahSpec, base: str, haystack: str, depth: float | None):
    rng = random.Random(base)
    keys, values, needles = [], [], []
    for _ in range(spec.num_k):
        keys.append(_random_value(rng, spec.type_k))
        values.append([_random_value(rng, spec.type_v) for _ in range(spec.num_v)])
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
    units = _haystack_units(haystack, random.Random(base + ":haystack"), spec.type_k, spec.type_v)
    sep = _separator(haystack)

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
    context, _ = insert_at_depths(units, inserts, _separator(haystack))
    context = context.replace(". \n", ".\n")
    template, prefix = TEMPLATES["variable_tracking"]
    fmt = {"context": context, "query": value, "num_v": num_hops + 1}
    return template.format(**fmt), prefix.format(**fmt), context


def _vt_builder(spec: VtSpec, base: str, haystack: str, count_tokens: CountTokens):
    rng = random.Random(base)
    variables, chains = _vt_chains(rng, spec.num_chains, spec.num_hops, 5)
    value = chains[0][0].split("=")[-1].strip()
    positions = [sorted(rng.random() for _ in chain) for chain in chains]
    units = _haystack_units(haystack, random.Random(base + ":haystack"))
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

    _, (text, prefix) = _fit(build, count_tokens, max_tokens, "vt example", max_tokens)
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
