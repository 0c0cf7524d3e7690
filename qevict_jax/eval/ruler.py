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

Tasks and their builders are ``qevict_jax.eval.ruler_tasks``, haystacks ``qevict_jax.eval.haystack``; this
module makes and scores samples. Lengths are counted by the caller's tokenizer: the prompt (template, answer prefix and the chat template's
``overhead_tokens``) plus ``tokens_to_generate`` fit in ``max_seq_length``, filled as far as they go (binary
search over the haystack size, as RULER does). Scoring is RULER's ``string_match_all``.

Differences from RULER, by necessity: keys of type "words" join two words of the pydoc vocabulary instead of
wonderwords' adjective-noun pairs, and the common words come from that vocabulary; every random draw comes
from a ``random.Random`` seeded by (task, seed), so a sample is a pure function of its arguments; a needle's
depth is a fraction of the haystack's characters, at the unit (sentence, line) boundary nearest to it.
"""

from __future__ import annotations

import dataclasses

from qevict_jax.eval.haystack import HAYSTACKS
from qevict_jax.eval.metrics import ruler_postprocess, string_match_all
from qevict_jax.eval.ruler_tasks import TASKS, CountTokens, Request, TaskSpec, fit


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
    return _spec(task).tokens_to_generate


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
    gen = spec.tokens_to_generate if tokens_to_generate is None else tokens_to_generate
    limit = max_seq_length - gen - overhead_tokens
    build = spec.builder(Request(f"{task}:{seed}", haystack, depth, count_tokens, max_seq_length, gen))
    _, parts = fit(build, count_tokens, limit, task, max_seq_length)
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


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(TASKS)}")
    return TASKS[task]
