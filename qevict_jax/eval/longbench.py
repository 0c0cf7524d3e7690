"""LongBench (v1, English): the 12 tasks from the official JSONL files, with the official prompts and metrics.

Follows THUDM/LongBench ``config/dataset2prompt.json``, ``config/dataset2maxlen.json``, ``pred.py``
(truncation in the middle to a maximum prompt length; no chat template on the few-shot tasks) and
``eval.py`` / ``metrics.py`` (best score over the reference answers; first line only for trec / triviaqa /
samsum).

Data: ``DIR/<task>.jsonl`` as published (``data.zip`` of the THUDM/LongBench dataset), one JSON object per
line with fields ``input``, ``context``, ``answers`` (list), ``length``, ``all_classes`` (list or null),
``_id``, ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from qevict_jax.eval.jsonl import read_objects
from qevict_jax.eval.metrics import (
    best_over_references,
    classification_score,
    first_line,
    qa_f1_score,
    rouge_l_score,
)

TASKS = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "gov_report",
    "qmsum",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
)

_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other "
    "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULE = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
    'answered based on the information in the article, write "unanswerable". If the question is a yes/no '
    'question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)
# dataset2prompt.json, verbatim (including its "asconcisely" typo)
PROMPTS = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULE}\n\nArticle: "
        f"{{context}}\n\n Answer the question based on the above article {_QASPER_RULE}\n\nQuestion: "
        f"{{input}}"
        "\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based "
        "on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
        "Answer:"
    ),
    "hotpotqa": _PASSAGES,
    "2wikimqa": _PASSAGES,
    "musique": _PASSAGES,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer "
        "the query "
        "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
        "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
        "{input}"
    ),
}
MAX_NEW_TOKENS = {  # dataset2maxlen.json
    "narrativeqa": 128,
    "qasper": 128,
    "multifieldqa_en": 64,
    "hotpotqa": 32,
    "2wikimqa": 32,
    "musique": 32,
    "gov_report": 512,
    "qmsum": 512,
    "multi_news": 512,
    "trec": 64,
    "triviaqa": 32,
    "samsum": 128,
}
METRICS: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_l_score,
    "qmsum": rouge_l_score,
    "multi_news": rouge_l_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_l_score,
}
# few-shot tasks: no chat template (pred.py) and only the first line of the prediction is scored (eval.py)
FEW_SHOT = ("trec", "triviaqa", "samsum")


@dataclasses.dataclass(frozen=True)
class LongBenchRecord:
    task: str
    index: int  # line number in the task file
    input: str
    context: str
    answers: tuple[str, ...]
    all_classes: tuple[str, ...]
    length: int  # LongBench's word count of the context
    id: str


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown LongBench task {task!r}; choose from {', '.join(TASKS)}")


def load_task(data_dir: str | Path, task: str, limit: int | None = None) -> list[LongBenchRecord]:
    """The first ``limit`` records (all when None) of ``data_dir/<task>.jsonl``."""
    check_task(task)
    path = Path(data_dir) / f"{task}.jsonl"
    missing = f"LongBench file not found: {path} (expected DIR/<task>.jsonl from data.zip)"
    return [_record(task, i, obj, path) for i, obj in enumerate(read_objects(path, limit, missing))]


def _record(task: str, index: int, obj: dict, path: Path) -> LongBenchRecord:
    missing = [k for k in ("input", "context", "answers") if k not in obj]
    if missing:
        raise ValueError(f"{path} line {index + 1}: missing field(s) {', '.join(missing)}")
    return LongBenchRecord(
        task=task,
        index=index,
        input=obj["input"],
        context=obj["context"],
        answers=tuple(obj["answers"]),
        all_classes=tuple(obj.get("all_classes") or ()),
        length=int(obj.get("length") or 0),
        id=str(obj.get("_id", index)),
    )


def build_prompt(record: LongBenchRecord) -> str:
    """The official prompt of the record's task, filled in."""
    return PROMPTS[record.task].format(context=record.context, input=record.input)


def question_text(record: LongBenchRecord) -> str:
    """The part of the record's prompt after its context (the question and instructions), filled in."""
    return PROMPTS[record.task].split("{context}", 1)[1].format(input=record.input)


def truncate_middle(
    prompt: str, max_length: int, encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str]
) -> str:
    """LongBench's truncation: a prompt over ``max_length`` tokens keeps its first and last
    max_length // 2 tokens."""
    ids = encode(prompt)
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return decode(ids[:half]) + decode(ids[-half:])


def uses_chat_template(task: str) -> bool:
    """LongBench wraps the prompt in the chat template except for the few-shot tasks."""
    return task not in FEW_SHOT


def score(task: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] = ()) -> float:
    """The official per-sample score in [0, 1]: the task's metric, best over the reference answers."""
    check_task(task)
    if task in FEW_SHOT:
        prediction = first_line(prediction)
    kwargs = {"all_classes": all_classes} if task == "trec" else {}
    return best_over_references(METRICS[task], prediction, answers, **kwargs)
