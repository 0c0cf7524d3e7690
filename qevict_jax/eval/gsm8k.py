"""GSM8K: the official JSONL, the standard 8-shot chain-of-thought prompt, answer extraction, exact match.

Data: the official ``test.jsonl`` (openai/grade-school-math), one object per line with ``question`` and
``answer``; the reference is the number after "#### " at the end of ``answer``.

Prompt: the 8 chain-of-thought exemplars of Wei et al. (2022), as in lm-evaluation-harness ``gsm8k-cot``:
"Q: {question}\\nA: {reasoning} The answer is N.\\n\\n" x 8, then "Q: {question}\\nA:". The continuation is
cut at the first "Q:" (the harness's stop sequence), then the answer is "The answer is N" if present (strict),
else the last number in the text (flexible); both compared after removing "," "$" and a trailing ".".
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from qevict_jax.eval.jsonl import read_objects

EXEMPLARS = (
    (
        "There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are "
        "done, there will be 21 trees. How many trees did the grove workers plant today?",
        "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must "
        "have been 21 - 15 = 6. The answer is 6.",
    ),
    (
        "If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the "
        "parking lot?",
        "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5. The answer is 5.",
    ),
    (
        "Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in "
        "total?",
        "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After "
        "eating 35, they had 74 - 35 = 39. The answer is 39.",
    ),
    (
        "Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many "
        "lollipops "
        "did Jason give to Denny?",
        "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave "
        "Denny 20 - 12 "
        "= 8. The answer is 8.",
    ),
    (
        "Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many "
        "toys does he "
        "have now?",
        "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
        "5 + 4 = 9. The answer is 9.",
    ),
    (
        "There were nine computers in the server room. Five more computers were installed each day, from "
        "monday to thursday. How many computers are now in the server room?",
        "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
        "computers were added. 9 + 20 is 29. The answer is 29.",
    ),
    (
        "Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. "
        "How many "
        "golf balls did he have at the end of wednesday?",
        "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 "
        "more, he had 35 - 2 = 33 golf balls. The answer is 33.",
    ),
    (
        "Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
        "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 "
        "dollars left. 23 - 15 is 8. The answer is 8.",
    ),
)
MAX_NEW_TOKENS = 256
STOP = "Q:"
_STRICT = re.compile(r"The answer is (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


@dataclasses.dataclass(frozen=True)
class GSM8KRecord:
    index: int
    question: str
    answer: str  # the reference number, normalized
    solution: str  # the full reference answer text


def load(path: str | Path, limit: int | None = None) -> list[GSM8KRecord]:
    """The first ``limit`` problems (all when None) of an official GSM8K JSONL file."""
    path = Path(path)
    objects = read_objects(path, limit, f"GSM8K file not found: {path}")
    return [
        GSM8KRecord(i, obj["question"], reference_answer(obj["answer"]), obj["answer"])
        for i, obj in enumerate(objects)
    ]


def reference_answer(solution: str) -> str:
    """The number after the final "####" of a GSM8K solution, normalized."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer without '####': {solution[-80:]!r}")
    return normalize_number(solution.split("####")[-1])


def few_shot_prompt(question: str) -> str:
    """The 8-shot chain-of-thought prompt ending in "Q: {question}\\nA:"."""
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in EXEMPLARS)
    return f"{shots}Q: {question}\nA:"


def normalize_number(text: str) -> str:
    """Drop surrounding space, thousands separators, "$" and a trailing period: "$1,234." -> "1234"."""
    return text.strip().replace(",", "").replace("$", "").rstrip(".").strip()


def extract_answer(generation: str) -> str:
    """The model's answer: cut at the first "Q:", then "The answer is N" (last one), else the last number.

    Returns "" when the text holds no number.
    """
    text = generation.split(STOP)[0]
    strict = _STRICT.findall(text)
    if strict:
        return normalize_number(strict[-1])
    numbers = [a or b for a, b in _FLEXIBLE.findall(text)]
    numbers = [n for n in numbers if re.search(r"\d", n)]
    return normalize_number(numbers[-1]) if numbers else ""


def score(generation: str, reference: str) -> float:
    """Exact match (1.0 or 0.0) of the extracted answer with the reference number."""
    pred = extract_answer(generation)
    return float(pred != "" and _same_number(pred, normalize_number(reference)))


def _same_number(a: str, b: str) -> bool:
    """String equality, or numeric equality for forms like "18.00" vs "18"."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False
