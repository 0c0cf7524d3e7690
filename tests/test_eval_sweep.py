"""The sweep runner: kill-and-resume loses and duplicates nothing; summaries and plots from records."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qevict_jax.eval.plots import write_summary
from qevict_jax.eval.sweep import (
    Job,
    check_config,
    expand_jobs,
    lock_sweep,
    read_results,
    record_key,
    run_sweep,
    summary_rows,
)

METHODS = [("full", None), ("qevict", 0.1), ("qevict", 0.2), ("h2o", 0.2)]


def fake_run(job: Job) -> dict:
    """A deterministic stand-in for a model run: the score and memory depend only on the job."""
    budget = job.budget or 1.0
    score = 100.0 * ((job.sample * 7 + job.length // 100 + int(budget * 10)) % 5) / 4
    return {
        "score": score,
        "memory_ratio": budget + 0.01 * (job.length // 1000),
        "cache_bytes": int(1000 * budget),
        "full_kv_bytes": 1000,
        "prompt_tokens": job.length - 10,
        "prediction": f"answer {job.sample}",
        "ttft_s": 0.5,
        "decode_tokens_per_s": 10.0,
    }


def jobs() -> list[Job]:
    return expand_jobs(["niah_single_1", "vt"], METHODS, [1000, 2000], 3)


def test_expand_jobs_order_and_count():
    js = jobs()
    assert len(js) == 2 * 2 * 3 * len(METHODS)
    assert js[0] == Job("niah_single_1", "full", None, 1000, 0)
    assert [j.method for j in js[:4]] == ["full", "qevict", "qevict", "h2o"]  # methods innermost
    per_task = expand_jobs(["a", "b"], METHODS[:1], [0], {"a": 2, "b": 1})
    assert [(j.task, j.sample) for j in per_task] == [("a", 0), ("a", 1), ("b", 0)]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_injected_failure_then_resume_equals_uninterrupted(tmp_path):
    ref = run_sweep(jobs(), fake_run, tmp_path / "ref.jsonl", progress=False)
    calls = []

    def failing(job: Job) -> dict:
        if len(calls) == 10:
            raise RuntimeError("boom")
        calls.append(job)
        return fake_run(job)

    path = tmp_path / "results.jsonl"
    with pytest.raises(RuntimeError, match="boom"):
        run_sweep(jobs(), failing, path, progress=False)
    assert len(_lines(path)) == 10
    rerun = []
    out = run_sweep(jobs(), lambda j: (rerun.append(j), fake_run(j))[1], path, progress=False)
    assert len(rerun) == len(jobs()) - 10  # only the missing jobs ran
    assert out == ref
    keys = [record_key(r) for r in _lines(path)]
    assert len(keys) == len(set(keys)) == len(jobs())  # nothing lost, nothing twice
    assert sorted(map(str, keys)) == sorted(str(j.key) for j in jobs())
    # a third run does nothing
    assert run_sweep(jobs(), lambda j: pytest.fail("nothing left to run"), path, progress=False) == ref


def test_killed_subprocess_then_resume(tmp_path):
    """SIGKILL the runner after k appended samples (mid-sweep, no cleanup), then rerun: identical results."""
    path = tmp_path / "results.jsonl"
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_eval_sweep import fake_run, jobs
        from qevict_jax.eval.sweep import run_sweep
        done = []
        def run(job):
            if len(done) == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            done.append(job)
            return fake_run(job)
        run_sweep(jobs(), run, {str(path)!r}, progress=False)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert len(_lines(path)) == 7
    out = run_sweep(jobs(), fake_run, path, progress=False)
    assert out == run_sweep(jobs(), fake_run, tmp_path / "ref.jsonl", progress=False)
    assert len(_lines(path)) == len(jobs())


def test_torn_last_line_is_repaired(tmp_path):
    path = tmp_path / "results.jsonl"
    run_sweep(jobs()[:5], fake_run, path, progress=False)
    with path.open("a") as f:  # a write cut by a kill
        f.write('{"task": "vt", "method": "fu')
    assert len(read_results(path)) == 5
    out = run_sweep(jobs()[:8], fake_run, path, progress=False)
    assert [record_key(r) for r in out] == [j.key for j in jobs()[:8]]
    assert len(_lines(path)) == 8  # every line parses again


def test_records_carry_the_required_fields_and_nan_becomes_null(tmp_path):
    rec = run_sweep(
        jobs()[:1], lambda j: {**fake_run(j), "decode_tokens_per_s": float("nan")}, tmp_path / "r.jsonl"
    )
    required = {
        "task",
        "method",
        "budget",
        "length",
        "sample",
        "memory_ratio",
        "cache_bytes",
        "full_kv_bytes",
    }
    required |= {"prompt_tokens", "score", "prediction", "ttft_s", "decode_tokens_per_s"}
    assert required <= set(rec[0])
    assert rec[0]["decode_tokens_per_s"] is None
    assert "NaN" not in (tmp_path / "r.jsonl").read_text()


def test_check_config_refuses_another_configuration(tmp_path):
    check_config(tmp_path, {"model": "a", "seed": 0})
    check_config(tmp_path, {"model": "a", "seed": 0})  # same: fine
    with pytest.raises(ValueError, match="seed: 0 -> 1"):
        check_config(tmp_path, {"model": "a", "seed": 1})


def _records() -> list[dict]:
    base = {"prediction": "", "ttft_s": 1.0, "decode_tokens_per_s": 20.0, "prompt_tokens": 100}
    rows = [
        ("t1", "full", None, 1000, 0, 100.0, 1.0),
        ("t1", "full", None, 1000, 1, 50.0, 1.0),
        ("t1", "h2o", 0.2, 1000, 0, 50.0, 0.2),
        ("t1", "h2o", 0.2, 1000, 1, 0.0, 0.22),
        ("t1", "full", None, 2000, 0, 100.0, 1.0),
        ("t1", "h2o", 0.2, 2000, 0, 100.0, 0.24),
        ("t2", "full", None, 1000, 0, 0.0, 1.0),
        ("t2", "h2o", 0.2, 1000, 0, 0.0, 0.2),
    ]
    keys = ("task", "method", "budget", "length", "sample", "score", "memory_ratio")
    return [{**base, **dict(zip(keys, r, strict=True))} for r in rows]


def test_summary_rows_hand_computed():
    rows = {(r["task"], r["method"], r["budget"], r["length"]): r for r in summary_rows(_records())}
    assert rows[("t1", "full", None, 1000)]["score"] == 75.0
    assert rows[("t1", "h2o", 0.2, 1000)]["score"] == 25.0
    assert rows[("t1", "h2o", 0.2, 1000)]["memory_ratio"] == pytest.approx(0.21)
    assert rows[("t1", "h2o", 0.2, "all")]["score"] == pytest.approx(50.0)  # (50 + 0 + 100) / 3
    assert rows[("t1", "h2o", 0.2, "all")]["n"] == 3
    # task average = mean of the per-task means: (25 + 0) / 2 at length 1000
    assert rows[("average", "h2o", 0.2, 1000)]["score"] == pytest.approx(12.5)
    assert rows[("average", "h2o", 0.2, 1000)]["n"] == 3


def test_write_summary_files(tmp_path):
    table = write_summary(_records(), tmp_path)
    assert (tmp_path / "summary.md").read_text().split("\n\n")[0].strip() == table  # then the pivot
    lines = table.splitlines()
    assert lines[0].startswith(
        "| task | method | budget β | n | score | memory ratio | score @1000 | mem @1000"
    )
    assert "| t1 | h2o | 0.2 | 3 | 50.0 | 0.220 | 25.0 | 0.210 | 100.0 | 0.240 |" in table
    assert "| t1 | full | - | 3 | 83.3 | 1.000 |" in table
    with (tmp_path / "summary.csv").open() as f:
        csv_rows = list(csv.DictReader(f))
    assert {"task", "method", "budget", "length", "score", "memory_ratio"} <= set(csv_rows[0])
    first = csv_rows[0]
    assert (first["task"], first["method"], first["budget"], first["length"]) == ("t1", "full", "", "1000")
    assert float(first["score"]) == 75.0
    png = (tmp_path / "pareto.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_plot_does_not_touch_the_global_backend(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    from qevict_jax.eval.plots import frontier_points, pareto_plot

    pareto_plot(_records(), tmp_path / "p.png")
    assert matplotlib.get_backend() == before
    pts = frontier_points(_records(), length=1000)
    # per task first, then over tasks: h2o = mean(25, 0) at memory mean(0.21, 0.2)
    assert pts["h2o"] == [(pytest.approx(0.205), pytest.approx(12.5))]
    assert os.path.getsize(tmp_path / "p.png") > 0


def test_pivot_table_has_one_line_per_method_and_a_column_per_task():
    from qevict_jax.eval.sweep import pivot_markdown, summary_rows

    records = [
        {"task": t, "method": m, "budget": b, "length": 2048, "sample": i, "score": s, "memory_ratio": mem}
        for t, m, b, s, mem in [
            ("a", "full", None, 100.0, 1.0),
            ("b", "full", None, 50.0, 1.0),
            ("a", "qevict", 0.2, 80.0, 0.2),
            ("b", "qevict", 0.2, 40.0, 0.2),
        ]
        for i in range(2)
    ]
    lines = pivot_markdown(summary_rows(records)).splitlines()
    assert lines[0] == "| method | budget β | a | b | mean score | memory ratio |"
    assert lines[2] == "| full | - | 100.0 (2) | 50.0 (2) | 75.0 | 1.000 |"
    assert lines[3] == "| qevict | 0.2 | 80.0 (2) | 40.0 (2) | 60.0 | 0.200 |"
    assert len(lines) == 4


def test_a_second_writer_of_a_sweep_folder_stops_at_once_naming_the_first(tmp_path):
    """One writer per folder: while another process holds the folder, lock_sweep (taken by ``qevict eval``
    before the model loads, and by run_sweep) raises at once with that process's pid; once it exits, the
    folder is free again."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from qevict_jax.eval.sweep import lock_sweep; "
         f"lock_sweep({str(tmp_path)!r}); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"being written by another sweep \(pid {holder.pid} "):
            lock_sweep(tmp_path)
        with pytest.raises(ValueError, match="another sweep"):
            run_sweep([], lambda job: {}, tmp_path / "results.jsonl", progress=False)
    finally:
        holder.communicate("")
    lock_sweep(tmp_path)  # released with its holder
    lock_sweep(tmp_path)  # re-entrant
