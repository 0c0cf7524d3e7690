"""Summaries of sweep records (README, "Results"): mean score per cell, paired wins and losses of two methods on the
same samples, markdown and CSV tables. Reads the records ``sweep`` writes."""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qevict_jax.eval.sweep import read_results

_COLUMNS = ("score", "memory_ratio", "ttft_s", "decode_tokens_per_s", "prompt_tokens")


def merge_results(sources: Sequence[tuple[str | Path, str]]) -> list[dict]:
    """Records of several sweeps in one list, for one table and plot: each source is (folder, label); a
    non-empty label is appended to the method names of that folder's records (``qevict (q-agnostic)``)."""
    merged = []
    for folder, label in sources:
        records = read_results(Path(folder) / "results.jsonl")
        if not records:
            raise ValueError(f"{folder}: no results.jsonl records")
        merged += [{**r, "method": f"{r['method']} ({label})" if label else r["method"]} for r in records]
    return merged


def paired_rows(records: Sequence[Mapping[str, Any]], *, a: str, b: str) -> list[dict[str, Any]]:
    """Methods ``a`` and ``b`` on the samples both ran: per (length, budget) and then over every pair, the
    number of pairs n, each method's mean score, a's wins, b's wins, ties and the mean gap (a - b).

    A sample is (task, length, sample index) at a budget; a method without a budget (Full-KV) pairs with
    the other at each of its budgets. Raises when the two share no sample.
    """
    by_method: dict[str, dict[tuple, float]] = {a: {}, b: {}}
    for r in records:
        if r["method"] in by_method:
            by_method[r["method"]][(r["task"], r["length"], r["sample"], r["budget"])] = float(r["score"])
    budgets = sorted({key[3] for m in (a, b) for key in by_method[m] if key[3] is not None}) or [None]
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for (task, length, sample, budget), score_a in by_method[a].items():
        for bud in [budget] if budget is not None else budgets:
            score_b = by_method[b].get(
                (task, length, sample, bud), by_method[b].get((task, length, sample, None))
            )
            if score_b is not None:
                groups.setdefault((length, bud), []).append((score_a, score_b))
    if not groups:
        raise ValueError(f"{a!r} and {b!r} share no sample (same task, length, sample index and budget)")
    everything = [pair for key in sorted(groups, key=str) for pair in groups[key]]
    rows = []
    for (length, budget), pairs in [*sorted(groups.items(), key=str), (("all", "all"), everything)]:
        n = len(pairs)
        rows.append(
            {
                "length": length,
                "budget": budget,
                "n": n,
                a: sum(x for x, _ in pairs) / n,
                b: sum(y for _, y in pairs) / n,
                f"{a} wins": sum(x > y for x, y in pairs),
                f"{b} wins": sum(y > x for x, y in pairs),
                "ties": sum(x == y for x, y in pairs),
                "mean gap": sum(x - y for x, y in pairs) / n,
            }
        )
    return rows


def paired_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """``paired_rows`` as a Markdown table."""
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [
            _budget(r[c]) if c == "budget" and not isinstance(r[c], str) else _fmt(r[c], 1) for c in cols
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean(values: Iterable[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _timing_records(group: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """Records whose timings exclude compilation (all of them when every one compiled)."""
    warm = [r for r in group if not r.get("compiled")]
    return warm or group


def aggregate(
    records: Sequence[Mapping[str, Any]], by: Sequence[str], extra: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Means per group (groups in first-seen order): score, memory ratio, timings, prompt tokens and
    ``extra``."""
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in records:
        groups.setdefault(tuple(r.get(k) for k in by), []).append(r)
    rows = []
    for key, group in groups.items():
        timed = _timing_records(group)
        row = dict(zip(by, key, strict=True))
        row.update(
            n=len(group),
            score=_mean(r.get("score") for r in group),
            memory_ratio=_mean(r.get("memory_ratio") for r in group),
            prompt_tokens=_mean(r.get("prompt_tokens") for r in group),
            ttft_s=_mean(r.get("ttft_s") for r in timed),
            decode_tokens_per_s=_mean(r.get("decode_tokens_per_s") for r in timed),
        )
        for name in extra:
            row[name] = _mean(r.get(name) for r in group)
        rows.append(row)
    return rows


def summary_rows(records: Sequence[Mapping[str, Any]], extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Long-format summary: one row per (task, method, budget, length), plus length "all" rows when a sweep
    has several lengths and task "average" rows (the mean over tasks of the per-task means) when it has
    several tasks."""
    fields = ("task", "method", "budget", "length")
    rows = aggregate(records, fields, extra)
    lengths = {r["length"] for r in records}
    if len(lengths) > 1:
        rows += [{**r, "length": "all"} for r in aggregate(records, fields[:3], extra)]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    if len(tasks) > 1:
        avg = aggregate([{**r, "task": "average"} for r in rows], fields, extra)
        for a in avg:  # n: samples behind the average, not tasks
            a["n"] = sum(
                r["n"]
                for r in rows
                if (r["method"], r["budget"], r["length"]) == tuple(a[k] for k in fields[1:])
            )
        rows += avg
    return rows


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path, extra: Sequence[str] = ()) -> None:
    cols = ["task", "method", "budget", "length", "n", *_COLUMNS, *extra]
    with Path(path).open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r.get(k) for k in cols})


def _fmt(value: Any, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _budget(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def markdown_table(
    rows: Sequence[Mapping[str, Any]], extra: Sequence[str] = (), score_name: str = "score"
) -> str:
    """Wide Markdown table: one line per (task, method, budget) with the overall score and memory ratio, then
    the score and memory ratio at each length when there are several."""
    lengths = list(dict.fromkeys(r["length"] for r in rows if r["length"] != "all"))
    overall = "all" if len(lengths) > 1 else lengths[0] if lengths else None
    by_key = {(r["task"], r["method"], r["budget"], r["length"]): r for r in rows}
    head = ["task", "method", "budget β", "n", score_name, "memory ratio"]
    if len(lengths) > 1:
        for length in lengths:
            head += [f"{score_name} @{length}", f"mem @{length}"]
    head += [*extra, "TTFT (s)", "decode tok/s", "prompt tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r["length"] != overall:
            continue
        cells = [r["task"], r["method"], _budget(r["budget"]), str(r["n"]), _fmt(r["score"], 1)]
        cells.append(_fmt(r["memory_ratio"], 3))
        if len(lengths) > 1:
            for length in lengths:
                lr = by_key.get((r["task"], r["method"], r["budget"], length), {})
                cells += [_fmt(lr.get("score"), 1), _fmt(lr.get("memory_ratio"), 3)]
        cells += [_fmt(r.get(e), 4) for e in extra]
        cells += [_fmt(r["ttft_s"], 2), _fmt(r["decode_tokens_per_s"], 1), _fmt(r["prompt_tokens"], 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pivot_markdown(rows: Sequence[Mapping[str, Any]], score_name: str = "score") -> str:
    """Compact Markdown: one line per (method, budget), one column per task (score and sample count), the
    mean over tasks and the measured memory ratio; lengths pooled ("all" rows when there are several)."""
    lengths = {r["length"] for r in rows}
    pooled = "all" if "all" in lengths else next(iter(lengths), None)
    keep = [r for r in rows if r["length"] == pooled]
    tasks = [t for t in dict.fromkeys(r["task"] for r in keep) if t != "average"]
    methods = list(dict.fromkeys((r["method"], r["budget"]) for r in keep))
    by = {(r["task"], r["method"], r["budget"]): r for r in keep}
    head = ["method", "budget β", *tasks, f"mean {score_name}", "memory ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, b in methods:
        cells = [m, _budget(b)]
        for t in tasks:
            r = by.get((t, m, b))
            cells.append(f"{_fmt(r['score'], 1)} ({r['n']})" if r else "-")
        avg = by.get(("average", m, b)) or by.get((tasks[0], m, b)) if tasks else None
        cells += [_fmt(avg["score"], 1) if avg else "-", _fmt(avg["memory_ratio"], 3) if avg else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
