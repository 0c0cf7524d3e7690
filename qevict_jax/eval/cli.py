"""``qevict eval {ruler,longbench,gsm8k,fidelity}``: sweeps of methods x budgets x lengths x samples.

Each writes into ``--out``: results.jsonl (one record per finished sample, appended at once; a rerun skips
what is there), sweep.json (the configuration; a rerun with another one is refused), summary.md, summary.csv
and summary.png; the Markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from qevict_jax.eval import gsm8k, longbench, ruler
from qevict_jax.eval.harness import (
    FidelityHarness,
    GenerationHarness,
    check_feasible,
    resolve_methods,
)
from qevict_jax.eval.plots import write_summary
from qevict_jax.eval.summary import merge_results, paired_markdown, paired_rows
from qevict_jax.eval.sweep import check_config, compare_config, expand_jobs, lock_sweep, run_sweep
from qevict_jax.eval.tasks import fidelity_sampler, floats, generation_length, generation_setup, ints, names
from qevict_jax.methods.options import parse_set_options
from qevict_jax.model_args import add_model_args, check_counts, eos_ids, kv_dtype, load

DEFAULT_METHODS = "full,streamingllm,h2o,snapkv,kivi2,r2,qevict"
EVAL_TASKS = ("ruler", "longbench", "gsm8k", "fidelity")
PROTECTED_RECENT: dict[str, int | float | None] = {
    "ruler": 64,
    "longbench": 128,
    "gsm8k": 0.25,
    "fidelity": None,
}
"""The QEvict paper's protected recent region per benchmark (tokens; GSM8K: a fraction of the budget), set on
every method that has one; ``--recent`` overrides, None keeps each method's default."""


def _add_common(
    p: argparse.ArgumentParser, *, lengths: str | None, samples: int, out: str, lengths_help: str = ""
) -> None:
    add_model_args(p)
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; unavailable ones are skipped")
    p.add_argument("--budgets", default="0.2", help="comma-separated budgets β (fraction of Full-KV bytes)")
    if lengths is not None:
        p.add_argument("--lengths", default=lengths, help=lengths_help or "comma-separated lengths in tokens")
    p.add_argument(
        "--samples", type=int, default=samples, help="samples per task and length (data files: the first N)"
    )
    p.add_argument("--out", type=Path, default=Path(out), help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the task's generation length")
    p.add_argument("--no-chat", action="store_true", help="never wrap prompts in the chat template")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--recent",
        type=lambda x: float(x) if "." in x else int(x),
        default=None,
        help="protected recent region (tokens, or a fraction of the budget) of every method that has one; "
        "default: the benchmark's (RULER 64, LongBench 128, GSM8K 0.25)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="samples of one task and length generated together (memory ratios are per row)",
    )
    p.add_argument(
        "--no-share-prefill",
        action="store_true",
        help="one prefill per method (default: the methods of a sample share one; TTFTs then include it)",
    )


def _add_question_agnostic(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--question-agnostic",
        action="store_true",
        help="compress each prompt's context before its question is seen, then append the question",
    )


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``eval`` with its four sub-commands to a ``qevict`` sub-parser set; returns the ``eval`` parser."""
    p = subparsers.add_parser("eval", help="benchmark sweeps: RULER, LongBench, GSM8K, fidelity")
    sub = p.add_subparsers(dest="eval_task", required=True)

    r = sub.add_parser("ruler", help="RULER synthetic tasks (niah, vt, cwe, fwe), generated with seeds")
    _add_common(
        r,
        lengths="4096",
        samples=10,
        out="runs/ruler",
        lengths_help="context lengths in tokens: prompt + answer",
    )
    r.add_argument("--tasks", default="niah_single_1", help=f"comma list or 'all': {', '.join(ruler.TASKS)}")
    r.add_argument(
        "--haystack", choices=["ruler", *ruler.HAYSTACKS], default="ruler", help="ruler = each task's own"
    )
    r.add_argument(
        "--depths", default=None, help="needle depths in [0,1], cycled over samples (default seeded)"
    )
    _add_question_agnostic(r)

    lb = sub.add_parser("longbench", help="LongBench's 12 English tasks from the official JSONL files")
    _add_common(
        lb,
        lengths="7500",
        samples=20,
        out="runs/longbench",
        lengths_help="maximum prompt tokens (longer prompts are cut in the middle, as LongBench does)",
    )
    lb.add_argument("--data-dir", type=Path, required=True, help="folder with <task>.jsonl")
    lb.add_argument("--tasks", default="all", help=f"comma list or 'all': {', '.join(longbench.TASKS)}")
    _add_question_agnostic(lb)

    g = sub.add_parser("gsm8k", help="GSM8K with the 8-shot chain-of-thought prompt")
    _add_common(g, lengths=None, samples=50, out="runs/gsm8k")
    g.add_argument("--data-file", type=Path, required=True, help="official test.jsonl")

    f = sub.add_parser("fidelity", help="teacher-forced KL / top-1 agreement / perplexity against Full-KV")
    _add_common(
        f, lengths="2048,4096", samples=4, out="runs/fidelity", lengths_help="prefill lengths in tokens"
    )
    f.add_argument("--targets", type=int, default=64, help="teacher-forced tokens after the prefill")

    rep = sub.add_parser("report", help="one table and plot from several sweep folders")
    rep.add_argument(
        "sources",
        nargs="+",
        help="result folders, each FOLDER or FOLDER:LABEL (LABEL is added to method names)",
    )
    rep.add_argument("--out", type=Path, required=True, help="where summary.md/csv/png go")

    pair = sub.add_parser("paired", help="paired wins/losses of two methods on the samples both ran")
    pair.add_argument("sources", nargs="+", help="result folders, each FOLDER or FOLDER:LABEL (as in report)")
    pair.add_argument("--a", required=True, help="method name as in the records (with its label, if any)")
    pair.add_argument("--b", required=True, help="the other method")
    return p


def cmd_eval(args: argparse.Namespace) -> int:
    """Load the model and tokenizer named by ``--model``, then run the sweep (``report``: merge sweeps)."""
    if args.eval_task == "report":
        return cmd_report(args)
    if args.eval_task == "paired":
        return cmd_paired(args)
    precheck(args)
    lock_sweep(args.out)  # one writer per sweep folder, taken before the model loads
    cfg, model, tok = load(args)
    run_eval(args, model, tok, eos_ids(cfg, tok))
    return 0


def _sources(items: Sequence[str]) -> list[tuple[str, str]]:
    """FOLDER or FOLDER:LABEL items -> (folder, label)."""
    return [(src.rsplit(":", 1)[0], src.rsplit(":", 1)[1]) if ":" in src else (src, "") for src in items]


def cmd_report(args: argparse.Namespace) -> int:
    """``qevict eval report A B:label --out DIR``: the records of several sweeps in one table and plot."""
    records = merge_results(_sources(args.sources))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    fidelity = any("kl" in r for r in records)  # top-1 agreement is not a per-sample success: no intervals
    print(write_summary(records, args.out, ("kl", "ppl_change") if fidelity else (), intervals=not fidelity))
    print(f"plot: {Path(args.out) / 'summary.png'}", file=sys.stderr)
    return 0


def cmd_paired(args: argparse.Namespace) -> int:
    """``qevict eval paired A B:label --a M1 --b M2``: paired wins and losses of M1 and M2 per length and
    budget, from the records of one or several sweeps."""
    print(paired_markdown(paired_rows(merge_results(_sources(args.sources)), a=args.a, b=args.b)))
    return 0


def precheck(args: argparse.Namespace) -> None:
    """Fail fast, before the model loads and before anything is written: every list and count option, unknown
    tasks, missing data files, RULER lengths with no room for a prompt, every method with its ``--set``
    options, and a ``--out`` that holds a sweep of another configuration. Each error names the option."""
    budgets = floats(args.budgets, "--budgets")
    lengths = ints(args.lengths, "--lengths") if hasattr(args, "lengths") else []
    check_counts(
        args, "samples", "batch", "max_new_tokens", *(["targets"] if hasattr(args, "targets") else [])
    )
    if lengths and min(lengths) < 1:
        raise ValueError(f"--lengths must be >= 1, got {min(lengths)}")
    if args.eval_task == "fidelity" and args.max_new_tokens is not None:
        raise ValueError("--max-new-tokens does not apply to fidelity, which teacher-forces --targets tokens")
    if getattr(args, "depths", None):
        for d in floats(args.depths, "--depths"):
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"--depths are relative depths in [0, 1], got {d:g}")
    if args.eval_task == "ruler":
        _check_ruler_lengths(args, lengths)
    if args.eval_task == "longbench":
        for t in longbench.TASKS if args.tasks == "all" else names(args.tasks):
            longbench.load_task(args.data_dir, t, limit=1)
    if args.eval_task == "gsm8k":
        gsm8k.load(args.data_file, limit=1)
    resolve_methods(names(args.methods), budgets, lambda _: None, parse_set_options(args.set), _recent(args))
    compare_config(args.out, _config(args))


def _check_ruler_lengths(args: argparse.Namespace, lengths: Sequence[int]) -> None:
    """A RULER length counts prompt + answer: refuse one that the answer alone fills, naming the option."""
    for task in ruler.TASKS if args.tasks == "all" else names(args.tasks):
        gen = generation_length(args, ruler.tokens_to_generate(task))
        for n in lengths:
            if gen >= n:
                source = (
                    f"--max-new-tokens {gen}"
                    if args.max_new_tokens is not None
                    else f"{task}'s default answer length {gen} (set --max-new-tokens to change it)"
                )
                raise ValueError(
                    f"--lengths {n} leaves no room for a prompt after {source}: a RULER length counts prompt "
                    f"+ answer; use --max-new-tokens below {n} or a longer --lengths"
                )


def _recent(args: argparse.Namespace) -> int | float | None:
    """The protected recent region of every method that has one: ``--recent``, else the benchmark's."""
    return args.recent if args.recent is not None else PROTECTED_RECENT[args.eval_task]


def run_eval(
    args: argparse.Namespace,
    model,
    tokenizer,
    eos_ids: Sequence[int],
    *,
    generate_fn: Callable | None = None,
    teacher_forced_fn: Callable | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """Run the sweep that ``args`` describes with a loaded model; print and return the records."""

    log = log or (lambda m: print(m, file=sys.stderr))
    precheck(args)
    kind = args.eval_task
    methods = resolve_methods(
        names(args.methods),
        floats(args.budgets, "--budgets"),
        log,
        parse_set_options(args.set),
        _recent(args),
    )
    lengths = ints(args.lengths, "--lengths") if hasattr(args, "lengths") else [0]
    if kind == "fidelity":
        sample_fn = fidelity_sampler(args, tokenizer)
        harness: Any = FidelityHarness(model, methods, sample_fn, teacher_forced_fn, kv_dtype(args))
        jobs = expand_jobs(["fidelity"], list(methods), lengths, args.samples)
        extra, score_name = ("kl", "ppl_change"), "top-1 agreement (%)"
    else:
        tasks, prepare, samples = generation_setup(args, tokenizer)
        prepare = functools.lru_cache(maxsize=64)(prepare)
        planned = [
            prepare(t, n, 0) for t in tasks for n in lengths
        ]  # a prompt that cannot be built fails here
        if generate_fn is None:  # the real generate sizes caches: refuse infeasible budgets up front
            check_feasible(model, methods, planned, kv_dtype(args))
        harness = GenerationHarness(
            model,
            tokenizer,
            methods,
            prepare,
            eos_ids,
            args.seed,
            generate_fn,
            kv_dtype=kv_dtype(args),
            question_agnostic=getattr(args, "question_agnostic", False),
            share_prefill=not args.no_share_prefill,
            batch=args.batch,
        )
        jobs = expand_jobs(tasks, list(methods), lengths, samples)
        extra, score_name = (), "score"
    check_config(args.out, _config(args))  # everything is validated: only now is the sweep recorded
    records = run_sweep(
        jobs, harness, Path(args.out) / "results.jsonl", progress=not args.no_progress, desc=kind
    )
    table = write_summary(records, args.out, extra, score_name, intervals=kind != "fidelity")
    print(table)
    log(f"results: {Path(args.out) / 'results.jsonl'}; plot: {Path(args.out) / 'summary.png'}")
    return records


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """What a job's key does not capture but its result depends on."""
    keys = (
        "model",
        "dtype",
        "kv_dtype",
        "seed",
        "max_new_tokens",
        "no_chat",
        "haystack",
        "depths",
        "targets",
        "recent",
        "set",
        "question_agnostic",
    )
    config = {"eval": args.eval_task, **{k: getattr(args, k) for k in keys if hasattr(args, k)}}
    for k in ("data_dir", "data_file"):
        if hasattr(args, k):
            config[k] = str(Path(getattr(args, k)).resolve())
    return config


# ---------------------------------------------------------------------------------------------------------
# prompts per benchmark


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (``python -m qevict_jax.eval ARGS`` = ``qevict eval ARGS``)."""
    parser = argparse.ArgumentParser(prog="qevict", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_eval(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"qevict eval: error: {err}", file=sys.stderr)
        return 2
