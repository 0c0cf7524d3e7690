"""Scoring functions of the official benchmarks, re-implemented without third-party metric packages.

- RULER (NVIDIA/RULER ``scripts/eval/synthetic/constants.py``): ``string_match_all`` and
  ``string_match_part``, case-insensitive substring matches; ``ruler_postprocess`` as in its ``evaluate.py``.
- LongBench (THUDM/LongBench ``metrics.py`` and ``eval.py``): ``qa_f1_score`` with ``normalize_answer``,
  ``rouge_l_score`` (LCS-based F-measure over tokens), ``classification_score``, and the first-line handling
  of trec / triviaqa / samsum predictions.

Per-sample scores are fractions in [0, 1]; the sweep reports them multiplied by 100, as the papers do.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_PUNCT = set(string.punctuation)
_CONTROL = re.compile(r"[\x00-\x1f]")


def ruler_postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, and turn control characters into newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Share of the references found (case-insensitively) in the prediction (RULER niah/vt/cwe/fwe)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1 if any reference is found (case-insensitively) in the prediction, else 0 (RULER qa)."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    pred = prediction.lower()
    return float(max(r.lower() in pred for r in references))


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD normalization: lower case, drop punctuation, articles and extra whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (LongBench ``f1_score``)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str) -> float:
    """LongBench ``qa_f1_score``: token F1 after ``normalize_answer``."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def lcs_length(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two token sequences (O(len(a) * len(b)) time,
    O(len(b)) memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_tokens(text: str) -> list[str]:
    """Tokens for Rouge-L: whitespace-separated words with periods removed (as the ``rouge`` package
    splits)."""
    return text.replace(".", " ").split()


def rouge_l_score(prediction: str, reference: str) -> float:
    """Rouge-L F-measure: L = LCS(prediction, reference) tokens, P = L/|pred|, R = L/|ref|, F = 2PR/(P+R).

    An empty prediction or reference scores 0 (LongBench catches the ``rouge`` package's error and returns 0).
    """
    pred, ref = rouge_tokens(prediction), rouge_tokens(reference)
    if not pred or not ref:
        return 0.0
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def classification_score(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score``: 1/k if the reference is among the k class names in the prediction.

    A matched class name that is a strict substring of the reference is not counted (LongBench's rule, with
    its in-place removal while iterating).
    """
    matches = [c for c in all_classes if c in prediction]
    # removing while iterating (so a term right after a removed one is skipped) reproduces LongBench exactly
    for term in matches:
        if term in reference and term != reference:
            matches.remove(term)
    return 1.0 / len(matches) if reference in matches else 0.0


def first_line(prediction: str) -> str:
    """LongBench's handling of few-shot tasks (trec, triviaqa, samsum, lsht): the first line after
    leading newlines."""
    return prediction.lstrip("\n").split("\n")[0]


def best_over_references(metric, prediction: str, references: Sequence[str], **kwargs) -> float:
    """LongBench scores a prediction by its best match over all reference answers (0 when there are none)."""
    return max((metric(prediction, r, **kwargs) for r in references), default=0.0)
