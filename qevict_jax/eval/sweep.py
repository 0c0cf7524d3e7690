"""The sweep runner shared by every evaluation: methods x budgets x lengths x samples, resumable.

Every finished sample is appended to ``results.jsonl`` at once (flush + fsync), so a killed run loses at most
the sample in flight; a rerun reads the file and skips every job whose key (task, method, budget, length,
sample) is there. A line torn by a kill mid-write is cut off before appending. The summary (Markdown and CSV)
and the Pareto plot are computed from the records alone (``summary``, ``plots``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import io
import json
import math
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
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


def read_results(path: str | Path, *, log: Callable[[str], None] | None = None) -> list[dict]:
    """Records of a results file; a torn (unterminated, unparsable) last line is ignored.

    A malformed record (not a JSON object, or lacking a key field or a numeric score: ``malformed``) is left
    out with a note naming the file and line (``log``, default stderr), so it is never counted and a resumed
    sweep runs its job again; so is an unparsable line before the last (one a kill cannot tear).
    """
    path = Path(path)
    if not path.exists():
        return []
    log = log or _note
    records = []
    lines = path.read_text(encoding="utf-8", errors="replace").split(
        "\n"
    )  # bytes that are not text: not JSON
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = malformed(record)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # the last line, cut by a kill mid-write: repaired before the next append
                break
            problem = "is not valid JSON"
        if problem:
            log(f"note: {path}: line {i + 1} {problem}: left out (a sweep over this folder runs it again)")
            continue
        records.append(record)
    return records


def malformed(record: Any) -> str | None:
    """Why ``record`` cannot be a sweep record (in words), or None when it can: it must be a JSON object with
    every key field (``KEY_FIELDS``, of their types) and a numeric ``score``."""
    if not isinstance(record, dict):
        return f"is not a JSON object ({type(record).__name__})"
    missing = [k for k in (*KEY_FIELDS, "score") if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    types = {"task": str, "method": str, "length": int, "sample": int}
    wrong = [k for k, t in types.items() if not isinstance(record[k], t) or isinstance(record[k], bool)]
    if record["budget"] is not None and not _is_number(record["budget"]):
        wrong.append("budget")
    if not _is_number(record["score"]):
        wrong.append("score")
    if wrong:
        return "has " + ", ".join(f"{k}={record[k]!r}" for k in wrong)
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _note(message: str) -> None:
    print(message, file=sys.stderr)


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


def compare_config(out_dir: str | Path, config: Mapping[str, Any]) -> None:
    """Refuse a sweep whose configuration differs from the one ``out_dir/sweep.json`` records, or whose
    ``sweep.json`` cannot be read, while ``results.jsonl`` holds records; writes nothing.

    A folder without records (a sweep.json left by an earlier command that ran nothing) takes the new
    configuration. Methods, budgets, lengths and sample counts may change between reruns (they only add or
    select jobs); anything in ``config`` changes what a job means, so a mismatch is an error.
    """
    path = Path(out_dir) / "sweep.json"
    if not path.exists() or not read_results(Path(out_dir) / "results.jsonl", log=lambda _: None):
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:  # empty, torn or not UTF-8
        raise ValueError(
            f"{path} cannot be read ({err}) but results.jsonl beside it holds records: restore it, or use "
            "a new --out"
        ) from None
    if not isinstance(old, dict):
        raise ValueError(f"{path} is not a JSON object: restore it, or use a new --out")
    config = _clean(dict(config))
    diff = {k: (old.get(k), config.get(k)) for k in set(old) | set(config) if old.get(k) != config.get(k)}
    if diff:
        detail = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(f"{out_dir} holds a sweep with another configuration ({detail}); use a new --out")


def check_config(out_dir: str | Path, config: Mapping[str, Any]) -> None:
    """Record the sweep's identity (model, seed, ...) in ``sweep.json`` after ``compare_config`` accepts it.
    Call it once everything else is validated: a refused command must not leave a sweep.json behind."""
    compare_config(out_dir, config)
    path = Path(out_dir) / "sweep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".sweep.json.{os.getpid()}")
    tmp.write_text(json.dumps(_clean(dict(config)), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # whole or absent: a kill never leaves a torn sweep.json


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


# ---------------------------------------------------------------------------------------------------------
# summary
