"""Official metrics against hand-computed values: RULER string matches, LongBench F1 / Rouge-L /
classification, GSM8K answer extraction, fidelity statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qevict_jax.eval import gsm8k, longbench
from qevict_jax.eval.fidelity import fidelity_stats
from qevict_jax.eval.metrics import (
    classification_score,
    first_line,
    lcs_length,
    normalize_answer,
    qa_f1_score,
    rouge_l_score,
    ruler_postprocess,
    string_match_all,
    string_match_part,
)


def test_string_match_all_and_part():
    pred = "The numbers are 123 and 456."
    assert string_match_all(pred, ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("UUID: ABC-def", ["abc-DEF"]) == 1.0  # case-insensitive
    assert string_match_part(pred, ["789", "456"]) == 1.0
    assert string_match_part(pred, ["789"]) == 0.0
    with pytest.raises(ValueError):
        string_match_all(pred, [])


def test_ruler_postprocess_replaces_control_characters():
    assert ruler_postprocess("  a\tb\x00c  ") == "a\nb\nc"


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert normalize_answer("An apple a day") == "apple day"


def test_qa_f1_hand_computed():
    # "cat sat on mat" vs "cat sat on hat": 3 common of 4 and 4 -> P = R = 3/4
    assert qa_f1_score("The cat sat on the mat", "A cat sat on a hat") == pytest.approx(0.75)
    # [paris, france] vs [paris]: P = 1/2, R = 1 -> F1 = 2/3
    assert qa_f1_score("Paris, France", "paris") == pytest.approx(2 / 3)
    assert qa_f1_score("London", "Paris") == 0.0
    # repeated tokens count with multiplicity: [a1 a1 b] vs [a1 b b]: common {a1:1, b:1} = 2 -> P = R = 2/3
    assert qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)


def test_lcs_and_rouge_l_hand_computed():
    assert lcs_length(["a", "b", "c", "d"], ["a", "c"]) == 2
    assert lcs_length(["a", "b", "c"], ["c", "b", "a"]) == 1
    # LCS("the cat sat on the mat", "the cat is on the mat") = "the cat on the mat" = 5 -> P = R = 5/6
    assert rouge_l_score("the cat sat on the mat", "the cat is on the mat") == pytest.approx(5 / 6)
    # LCS 2, P = 2/4, R = 2/2 -> F = 2 * 0.5 * 1 / 1.5 = 2/3
    assert rouge_l_score("a b c d", "a c") == pytest.approx(2 / 3)
    assert rouge_l_score("a. b.", "a b") == 1.0  # periods split and vanish, as in the rouge package
    assert rouge_l_score("", "a b") == 0.0
    assert rouge_l_score("x y", "a b") == 0.0


def test_classification_score_is_longbench_exact():
    classes = ["City", "Country", "Date"]
    assert classification_score("City", "City", classes) == 1.0
    assert classification_score("City or Country", "City", classes) == 0.5
    assert classification_score("Date", "City", classes) == 0.0
    # a class that is a strict substring of the reference is dropped
    assert classification_score("Date of birth", "Date of birth", ["Date", "Date of birth"]) == 1.0
    # LongBench removes while iterating, so "AB" (right after the removed "A") survives: 1/2, not 1
    assert classification_score("ABC", "ABC", ["A", "AB", "ABC"]) == 0.5


def test_first_line_and_longbench_few_shot_scoring():
    assert first_line("\n\nCity\nType: Country") == "City"
    classes = ["City", "Country"]
    assert longbench.score("trec", "\nCity\nCountry", ["City"], classes) == 1.0
    assert longbench.score("triviaqa", "Paris\nQuestion: what else", ["Paris"]) == 1.0
    # not a few-shot task: the whole prediction counts (F1 of [paris, question, what, else] vs [paris])
    assert longbench.score("hotpotqa", "Paris\nQuestion: what else", ["Paris"]) == pytest.approx(0.4)
    # best over references
    assert longbench.score("hotpotqa", "Paris", ["London", "Paris"]) == 1.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48/2 = 24 clips in May. 48 + 24 = 72. The answer is 72.", "72"),
        ("So she has $1,234 left. The answer is $1,234.", "1234"),
        ("She has 5 apples, then 7", "7"),  # flexible: the last number
        ("The answer is 10.\n\nQ: Tom has 3 cats. The answer is 3.", "10"),  # cut at the next "Q:"
        ("The answer is -5.", "-5"),
        ("I do not know.", ""),
        ("It costs 2.50 dollars.", "2.50"),
    ],
)
def test_gsm8k_extraction(text, expected):
    assert gsm8k.extract_answer(text) == expected


def test_gsm8k_scoring_and_reference():
    assert gsm8k.reference_answer("a\nb\n#### 2,000") == "2000"
    assert gsm8k.score("The answer is 18.00.", "18") == 1.0
    assert gsm8k.score("The answer is 17.", "18") == 0.0
    assert gsm8k.score("nothing", "18") == 0.0
    with pytest.raises(ValueError):
        gsm8k.reference_answer("no marker")


def test_fidelity_stats_hand_computed():
    p = np.log(np.array([[0.5, 0.5, 0.0], [0.8, 0.1, 0.1]]) + 1e-300)
    q = np.log(np.array([[0.25, 0.75, 0.0], [0.8, 0.1, 0.1]]) + 1e-300)
    targets = np.array([1, 0])
    s = fidelity_stats(p, q, targets)
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert s.kl == pytest.approx(kl0 / 2)
    assert s.top1 == 0.5  # position 0: argmax p = 0 (tie, first), argmax q = 1; position 1 agrees
    assert s.ppl == pytest.approx(math.exp(-(math.log(0.75) + math.log(0.8)) / 2))
    assert s.ppl_full == pytest.approx(math.exp(-(math.log(0.5) + math.log(0.8)) / 2))
    assert s.ppl_change == pytest.approx(s.ppl / s.ppl_full - 1)
    same = fidelity_stats(p, p, targets)
    assert same.kl == 0.0 and same.top1 == 1.0 and same.ppl_change == 0.0
