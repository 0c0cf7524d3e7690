"""The sweep runner shared by every evaluation: methods x budgets x lengths x samples, resumable.

Every finished sample is appended to ``results.jsonl`` at once (flush + fsync), so a killed run loses at most
the sample in flight; a rerun reads the file and skips every job whose key (task, method, budget, length,
sample) is there. A line torn by a kill mid-write is cut off before appending. The summary (Markdown and CSV)
and the Pareto plot are computed from the records alone.
"""

from __future__ import annotations

import csv
import dataclasses
import fcntl
import io
import json
import math
import os
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

KEY_FIELDS = ("task", "method", "budget", "length", "sample")
FULL = "full"


@dataclasses.dataclass(frozen=True)
class Job:
    """One unit of work: one sample of one task at one length, run with one method at one budget."""

    task: str
    method: str
    budget: float | None  # None for methods without a budget (Full-KV, fixed-bit quantization)
    length: int
    sample: int

    @property
    def key(self) -> tuple:
        return (self.task, self.method, self.budget, self.length, self.sample)


def record_key(record: Mapping[str, Any]) -> tuple:
    return tuple(record[k] for k in KEY_FIELDS)


def expand_jobs(
    tasks: Sequence[str],
    methods: Sequence[tuple[str, float | None]],
    lengths: Sequence[int],
    samples: int | Mapping[str, int],
) -> list[Job]:
    """All jobs, ordered task > length > sample > method, so a sample's prompt is built once for every method.

    samples: a count for every task, or a count per task (e.g. the records a LongBench file holds).
    """
    jobs = []
    for task in tasks:
        n = samples if isinstance(samples, int) else samples[task]
        for length in lengths:
            for i in range(n):
                jobs += [Job(task, name, budget, length, i) for name, budget in methods]
    return jobs


# ---------------------------------------------------------------------------------------------------------
# the results file


def read_results(path: str | Path) -> list[dict]:
    """Records of a results file; a torn (unterminated, unparsable) last line is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the last line, cut by a kill mid-write
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
    return records


def _repair_tail(path: Path) -> None:
    """Cut an unterminated last line (a write interrupted by a kill) so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data[: data.rfind(b"\n") + 1]
    with path.open("r+b") as f:
        f.truncate(len(keep))


def _clean(value: Any) -> Any:
    """JSON-safe values: NaN and infinities become None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def append_record(f: io.TextIOBase, record: Mapping[str, Any]) -> None:
    """Write one record as a JSON line and force it to disk."""
    f.write(json.dumps(_clean(dict(record)), ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


_HELD_LOCKS: dict[Path, Any] = {}  # sweep folders this process writes: the open, flock-ed lock files


def lock_sweep(out_dir: str | Path) -> None:
    """Make this process the one writer of sweep folder ``out_dir`` (until it exits): an exclusive ``flock``
    on ``out_dir/.lock``, which names the holder. A second sweep on the same folder fails at once with a
    ValueError naming the process that holds it (two writers would append the same samples twice).
    Re-entrant within a process."""
    folder = Path(out_dir).resolve()
    if folder in _HELD_LOCKS:
        return
    folder.mkdir(parents=True, exist_ok=True)
    f = (folder / ".lock").open("a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(
            f"{out_dir} is being written by another sweep ({holder}); wait for it to finish or use another --out"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)}\n")
    f.flush()
    _HELD_LOCKS[folder] = f


def check_config(out_dir: str | Path, config: Mapping[str, Any]) -> None:
    """Record the sweep's identity (model, seed, ...) in ``sweep.json``; refuse to mix two configurations.

    Methods, budgets, lengths and sample counts may change between reruns (they only add or select jobs);
    anything in ``config`` changes what a job means, so a mismatch is an error.
    """
    path = Path(out_dir) / "sweep.json"
    config = _clean(dict(config))
    if path.exists():
        old = json.loads(path.read_text())
        diff = {k: (old.get(k), config.get(k)) for k in set(old) | set(config) if old.get(k) != config.get(k)}
        if diff:
            detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
            raise ValueError(
                f"{out_dir} holds a sweep with another configuration ({detail}); use a new --out"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def run_sweep(
    jobs: Sequence[Job],
    run_job: Callable[[Job], Mapping[str, Any]],
    results_path: str | Path,
    *,
    progress: bool = True,
    desc: str = "eval",
) -> list[dict]:
    """Run every job not yet in ``results_path``, appending each record as soon as it is done.

    ``run_job(job)`` returns the record's measured fields; the job's key fields are added. A ``run_job`` with a
    ``plan(pending_jobs)`` method is told first which jobs will run. Returns the records of all ``jobs`` (old
    and new) in job order.
    """
    from tqdm.auto import tqdm

    path = Path(results_path)
    lock_sweep(path.parent)
    _repair_tail(path)
    done: dict[tuple, dict] = {}
    for rec in read_results(path):
        done.setdefault(record_key(rec), rec)
    pending = [j for j in jobs if j.key not in done]
    if hasattr(run_job, "plan"):
        run_job.plan(pending)
    bar = tqdm(
        total=len(jobs), initial=len(jobs) - len(pending), desc=desc, disable=not progress, unit="sample"
    )
    try:
        with path.open("a", encoding="utf-8") as f:
            for job in pending:
                bar.set_postfix_str(f"{job.task} L={job.length} {job.method} β={job.budget} #{job.sample}")
                record = _clean({**dataclasses.asdict(job), **run_job(job)})
                append_record(f, record)
                done[job.key] = record
                bar.update(1)
    finally:
        bar.close()
    return [done[j.key] for j in jobs]


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


# ---------------------------------------------------------------------------------------------------------
# summary


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


_COLUMNS = ("score", "memory_ratio", "ttft_s", "decode_tokens_per_s", "prompt_tokens")


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
