"""RULER generators: deterministic per seed, filled to the requested length, needles at the requested depth,
answers that the context really supports."""

from __future__ import annotations

import collections
import re

import pytest

from qevict_jax.eval import ruler
from qevict_jax.eval.haystack import NOISE, insert_at_depths
from qevict_jax.eval.ruler import ruler_sample, ruler_score
from qevict_jax.eval.testing import ByteTokenizer

TOK = ByteTokenizer()


def count(text: str) -> int:
    return len(TOK.encode(text, add_bos=False))


@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_every_task_is_deterministic_and_fills_the_length(task):
    length = 9000 if task == "cwe" else 4096  # cwe's 30 x 10 repeats need ~6K bytes at >= 4096 "tokens"
    a = ruler_sample(task, 3, length, count, tokens_to_generate=32, overhead_tokens=20)
    assert a == ruler_sample(task, 3, length, count, tokens_to_generate=32, overhead_tokens=20)
    b = ruler_sample(task, 4, length, count, tokens_to_generate=32, overhead_tokens=20)
    assert (a.input, a.outputs) != (b.input, b.outputs)
    limit = length - 32 - 20
    assert a.tokens == count(a.input + a.answer_prefix) <= limit
    assert a.tokens > 0.9 * limit  # filled (one haystack unit of slack at most, ~100 bytes here)
    assert a.outputs and all(o.lower() in a.input.lower() for o in a.outputs)
    assert ruler_score(a, " ".join(a.outputs)) == 1.0
    assert ruler_score(a, "no idea") == 0.0


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.77, 1.0])
def test_needle_is_placed_at_the_requested_depth(task, depth):
    s = ruler_sample(task, 0, 3000, count, tokens_to_generate=16, depth=depth)
    needle = next(line for line in _needles(s.context) if s.outputs[0] in line)
    at = s.context.index(needle)
    haystack_chars = len(s.context) - len(needle) - 1  # without the needle and its separator
    longest_unit = max(len(u) for u in re.split(r"\n|(?<=[.!?]) ", s.context)) + 1
    assert abs(at / haystack_chars - depth) <= longest_unit / haystack_chars + 1e-9
    assert abs(s.depths[0] - depth) <= longest_unit / haystack_chars + 1e-9


def _needles(context: str) -> list[str]:
    return re.findall(r"One of the special magic \w+ for \S+ is: [\w-]+\.", context)


def test_default_depth_is_seeded_among_rulers_depths():
    depths = {ruler_sample("niah_single_1", s, 1500, count, tokens_to_generate=8).depths[0] for s in range(8)}
    assert len(depths) > 1  # varies with the seed


def test_insert_at_depths():
    units = ["aaaa"] * 10  # boundaries every 5 characters (unit + "\n"), 49 characters in all
    text, realized = insert_at_depths(units, [("N", 0.5), ("M", 0.0), ("L", 1.0)], "\n")
    lines = text.split("\n")
    assert lines[0] == "M" and lines[-1] == "L" and lines[6] == "N"  # N after 5 units (25/49 nearest 0.5)
    assert realized[1] == 0.0 and realized[2] == 1.0 and realized[0] == pytest.approx(25 / 49)


def test_niah_wording_and_needle_counts():
    single = ruler_sample("niah_single_1", 0, 1500, count, tokens_to_generate=8)
    assert single.input.startswith("A special magic number is hidden within the following text.")
    assert "What is the special magic number for" in single.input
    assert single.answer_prefix.startswith(" The special magic number for") and single.answer_prefix.endswith(
        " is"
    )
    assert NOISE in single.context and len(_needles(single.context)) == 1

    mk = ruler_sample("niah_multikey_1", 0, 3000, count, tokens_to_generate=8)
    assert len(_needles(mk.context)) == 4 and len(mk.outputs) == 1
    mv = ruler_sample("niah_multivalue", 0, 3000, count, tokens_to_generate=8)
    assert len(mv.outputs) == 4 and "What are all the special magic numbers for" in mv.input
    keys = {re.search(r"for (\S+) is:", n).group(1) for n in _needles(mv.context)}
    assert len(keys) == 1  # four values of one key
    mq = ruler_sample("niah_multiquery", 0, 3000, count, tokens_to_generate=8)
    assert len(mq.outputs) == 4 and ", and " in mq.input.splitlines()[-1]
    uu = ruler_sample("niah_single_3", 0, 3000, count, tokens_to_generate=8)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uu.outputs[0])
    mk2 = ruler_sample("niah_multikey_2", 0, 3000, count, tokens_to_generate=8)
    assert len(_needles(mk2.context)) > 10 and NOISE not in mk2.context  # a haystack of distractor needles


def test_haystack_override():
    essay = ruler_sample("niah_single_1", 0, 2000, count, tokens_to_generate=8, haystack="essay")
    assert NOISE not in essay.context and essay.haystack == "essay"
    noise = ruler_sample("niah_single_2", 0, 2000, count, tokens_to_generate=8, haystack="noise")
    assert NOISE in noise.context
    with pytest.raises(ValueError, match="haystack"):
        ruler_sample("niah_single_1", 0, 2000, count, haystack="lorem")


def test_variable_tracking_chain_resolves_to_the_answer():
    s = ruler_sample("vt", 5, 3000, count, tokens_to_generate=30)
    main = s.input.split("Memorize and track")[-1]  # the task after the in-context example
    value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
    assigned = {m.group(1) for m in re.finditer(rf"VAR (\w+) = {value}\b", main)}
    edges = re.findall(r"VAR (\w+) = VAR (\w+)", main)
    while True:
        more = {a for a, b in edges if b in assigned} - assigned
        if not more:
            break
        assigned |= more
    assert assigned == set(s.outputs) and len(s.outputs) == 5
    assert s.input.count("Memorize and track") == 2  # RULER's one in-context example comes first
    assert f"{len(s.outputs)} variables are assigned the value {value}" in s.answer_prefix


@pytest.mark.parametrize(("length", "common", "rare"), [(2500, 6, 1), (9000, 30, 3)])
def test_common_words_counts(length, common, rare):
    s = ruler_sample("cwe", 1, length, count, tokens_to_generate=16)
    counts = collections.Counter(re.findall(r"\d+\. (\S+)", s.context))
    assert {counts[w] for w in s.outputs} == {common}
    assert {c for w, c in counts.items() if w not in s.outputs} == {rare}


def test_frequent_words_are_the_three_most_frequent_after_the_dots():
    s = ruler_sample("fwe", 2, 4096, count, tokens_to_generate=50)
    ranked = [w for w, _ in collections.Counter(s.context.split()).most_common()]
    assert ranked[0] == "..." and tuple(ranked[1:4]) == s.outputs


def test_too_short_length_is_a_clear_error():
    with pytest.raises(ValueError, match="too small"):
        ruler_sample("niah_single_1", 0, 200, count)
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler_sample("niah_single_9", 0, 2000, count)
