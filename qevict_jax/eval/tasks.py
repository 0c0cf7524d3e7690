"""The evaluations' samples from the command line's arguments (docs: README, "Evaluation"): for RULER, LongBench and
GSM8K the tasks, a ``prepare(task, length, sample) -> Prepared`` and the samples per task; for fidelity the
sample function. Values of list options are comma-separated (``names``, ``floats``, ``ints``)."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from models.tokenizer import token_index
from qevict_jax.eval import gsm8k, longbench, ruler
from qevict_jax.eval.fidelity import fidelity_sample
from qevict_jax.eval.harness import Prepared


def floats(text: str, option: str) -> list[float]:
    """The numbers of list option ``option`` (``"0.1,0.2"``); a ValueError naming it on a bad or empty
    list."""
    return _values(text, float, option, "numbers")


def ints(text: str, option: str) -> list[int]:
    """The integers of list option ``option`` (``"2048,4096"``); a ValueError naming it on a bad or empty
    list."""
    return _values(text, int, option, "integers")


def _values(text: str, cast: Callable[[str], Any], option: str, what: str) -> list:
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            out.append(cast(item))
        except ValueError:
            raise ValueError(f"{option} takes comma-separated {what}, got {item!r} in {text!r}") from None
    if not out:
        raise ValueError(f"{option} takes comma-separated {what}, got none in {text!r}")
    return out


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def generation_length(args: argparse.Namespace, task_default: int) -> int:
    """``--max-new-tokens`` when given (``precheck`` refuses values below 1), else the task's own length."""
    return task_default if args.max_new_tokens is None else args.max_new_tokens


def _gen_source(args: argparse.Namespace) -> str:
    """Where the answer length came from, for an error that should say which option to change."""
    return (
        "--max-new-tokens" if args.max_new_tokens is not None else "the task's default; see --max-new-tokens"
    )


def _chat_wrapper(args: argparse.Namespace, tokenizer) -> Callable[[str], str] | None:
    if args.no_chat or not getattr(tokenizer, "chat_template", None):
        return None
    return lambda text: tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def _encode_plain(tokenizer) -> Callable[[str], list[int]]:
    return lambda text: list(tokenizer.encode(text, add_bos=False))


def generation_setup(args: argparse.Namespace, tokenizer):
    """(tasks, prepare(task, length, sample) -> Prepared, samples per task) for ruler / longbench / gsm8k."""
    if args.eval_task == "ruler":
        return _ruler_setup(args, tokenizer)
    if args.eval_task == "longbench":
        return _longbench_setup(args, tokenizer)
    if args.eval_task == "gsm8k":
        return _gsm8k_setup(args, tokenizer)
    raise ValueError(f"unknown evaluation {args.eval_task!r}")


def _ruler_setup(args: argparse.Namespace, tokenizer):
    tasks = list(ruler.TASKS) if args.tasks == "all" else names(args.tasks)
    for t in tasks:
        ruler.tokens_to_generate(t)  # validates the name before any work
    wrap = _chat_wrapper(args, tokenizer)
    count = _encode_plain(tokenizer)
    overhead = len(tokenizer.encode(wrap("") if wrap else ""))
    depths = floats(args.depths, "--depths") if args.depths else None
    haystack = None if args.haystack == "ruler" else args.haystack

    def prepare(task: str, length: int, sample: int) -> Prepared:
        gen = generation_length(args, ruler.tokens_to_generate(task))
        try:
            s = ruler.ruler_sample(
                task,
                args.seed + sample,
                length,
                lambda text: len(count(text)),
                tokens_to_generate=gen,
                overhead_tokens=overhead,
                haystack=haystack,
                depth=depths[sample % len(depths)] if depths else None,
            )
        except ValueError as err:
            raise ValueError(
                f"RULER {task} at --lengths {length} (prompt + {gen} answer tokens, "
                f"{_gen_source(args)}): {err}"
            ) from None
        text = wrap(s.input) + s.answer_prefix.lstrip() if wrap else s.input + s.answer_prefix
        info = {"depths": list(s.depths), "haystack": s.haystack}
        context_end = text.index(s.input) + s.input.index(s.context) + len(s.context)
        return Prepared(
            tokenizer.encode(text),
            gen,
            list(s.outputs),
            functools.partial(ruler.ruler_score, s),
            info,
            question_start=token_index(tokenizer, text, context_end),
        )

    return tasks, prepare, args.samples


def _longbench_setup(args: argparse.Namespace, tokenizer):
    tasks = list(longbench.TASKS) if args.tasks == "all" else names(args.tasks)
    data = {t: longbench.load_task(args.data_dir, t, limit=args.samples) for t in tasks}
    wrap = _chat_wrapper(args, tokenizer)
    encode = _encode_plain(tokenizer)

    def prepare(task: str, length: int, sample: int) -> Prepared:
        rec = data[task][sample]
        prompt = longbench.truncate_middle(longbench.build_prompt(rec), length, encode, tokenizer.decode)
        if wrap and longbench.uses_chat_template(task):
            prompt = wrap(prompt)
        gen = generation_length(args, longbench.MAX_NEW_TOKENS[task])
        scorer = functools.partial(_longbench_score, task, rec.answers, rec.all_classes)
        info = {"id": rec.id, "data_length": rec.length}
        question = longbench.question_text(rec)
        start = token_index(tokenizer, prompt, prompt.rindex(question)) if question in prompt else None
        return Prepared(tokenizer.encode(prompt), gen, list(rec.answers), scorer, info, question_start=start)

    return tasks, prepare, {t: len(d) for t, d in data.items()}


def _longbench_score(task: str, answers, all_classes, prediction: str) -> float:
    return longbench.score(task, prediction, answers, all_classes)


def _gsm8k_setup(args: argparse.Namespace, tokenizer):
    problems = gsm8k.load(args.data_file, limit=args.samples)
    stop = _encode_plain(tokenizer)("\n\n")
    stop_ids = tuple(stop) if len(stop) == 1 else ()  # the exemplars' separator ends an answer early

    def prepare(task: str, length: int, sample: int) -> Prepared:
        rec = problems[sample]
        gen = generation_length(args, gsm8k.MAX_NEW_TOKENS)
        ids = tokenizer.encode(gsm8k.few_shot_prompt(rec.question))
        scorer = functools.partial(_gsm8k_score, rec.answer)
        return Prepared(ids, gen, [rec.answer], scorer, stop_ids=stop_ids, annotate=_gsm8k_annotate)

    return ["gsm8k"], prepare, {"gsm8k": len(problems)}


def _gsm8k_score(reference: str, prediction: str) -> float:
    return gsm8k.score(prediction, reference)


def _gsm8k_annotate(prediction: str) -> dict[str, str]:
    return {"extracted": gsm8k.extract_answer(prediction)}


def fidelity_sampler(args: argparse.Namespace, tokenizer) -> Callable[[int, int], Any]:
    encode = _encode_plain(tokenizer)
    bos = list(tokenizer.encode("", add_bos=True))

    def sample_fn(length: int, sample: int):
        return fidelity_sample(args.seed + sample, length, args.targets, encode, bos=bos)

    return sample_fn
