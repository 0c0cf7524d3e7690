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

from qevict_jax.eval.plots import (
    bar_cells,
    frontier_points,
    sweep_figure,
    sweep_plot,
    wilson_interval,
    write_summary,
)
from qevict_jax.eval.summary import paired_markdown, paired_rows, summary_rows
from qevict_jax.eval.sweep import (
    Job,
    check_config,
    expand_jobs,
    lock_sweep,
    read_results,
    record_key,
    run_sweep,
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


def test_check_config_refuses_another_configuration_once_records_exist(tmp_path):
    check_config(tmp_path, {"model": "a", "seed": 0})
    check_config(tmp_path, {"model": "a", "seed": 1})  # no record yet: nothing to mix, the new one is taken
    assert json.loads((tmp_path / "sweep.json").read_text()) == {"model": "a", "seed": 1}
    run_sweep(jobs()[:1], fake_run, tmp_path / "results.jsonl", progress=False)
    check_config(tmp_path, {"model": "a", "seed": 1})  # same: fine
    with pytest.raises(ValueError, match="seed: 1 -> 0"):
        check_config(tmp_path, {"model": "a", "seed": 0})
    (tmp_path / "sweep.json").write_text("")  # unreadable while records exist: named, not parsed blindly
    with pytest.raises(ValueError, match=r"sweep\.json cannot be read"):
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
    png = (tmp_path / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_plot_does_not_touch_the_global_backend(tmp_path):
    import matplotlib

    before = matplotlib.get_backend()
    sweep_plot(_records(), tmp_path / "p.png")
    assert matplotlib.get_backend() == before
    pts = frontier_points(_records(), length=1000)
    # per task first, then over tasks: h2o = mean(25, 0) at memory mean(0.21, 0.2)
    assert pts["h2o"] == [(pytest.approx(0.205), pytest.approx(12.5))]
    assert os.path.getsize(tmp_path / "p.png") > 0


def test_pivot_table_has_one_line_per_method_and_a_column_per_task():
    from qevict_jax.eval.summary import pivot_markdown, summary_rows

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


def test_wilson_interval_hand_checked():
    # p = 0.5, n = 20: centre 0.5, half-width 1.96 * sqrt(0.0125 + 0.0024010) / 1.19208 = 0.20070
    lo, hi = wilson_interval(mean=0.5, n=20)
    assert (lo, hi) == (pytest.approx(0.29930, abs=1e-4), pytest.approx(0.70070, abs=1e-4))
    # nothing right out of 10: [0, z^2/n / (1 + z^2/n)] = [0, 0.38416 / 1.38416]
    assert wilson_interval(mean=0.0, n=10) == (0.0, pytest.approx(0.27754, abs=1e-4))
    lo, hi = wilson_interval(mean=1.0, n=10)
    assert hi == 1.0 and lo == pytest.approx(1 - 0.27754, abs=1e-4)
    with pytest.raises(ValueError, match="at least one sample"):
        wilson_interval(mean=0.5, n=0)
    for n in range(1, 200):  # the interval always holds its own proportion (a bar's error is never negative)
        for p in (0.0, 1.0, 0.25, 1 / 3, 0.7):
            lo, hi = wilson_interval(mean=p, n=n)
            assert lo <= p <= hi


def _bar_records() -> list[dict]:
    """Two tasks, Full-KV and two methods at one budget, 4 samples each."""
    scores = {("t1", "full"): [100, 100, 100, 0], ("t1", "a"): [0, 100, 0, 0], ("t1", "b"): [100] * 4,
              ("t2", "full"): [100] * 4, ("t2", "a"): [0] * 4, ("t2", "b"): [100, 0, 100, 0]}  # fmt: skip
    return [
        {"task": t, "method": m, "budget": None if m == "full" else 0.2, "length": 1000, "score": float(v),
         "memory_ratio": 1.0 if m == "full" else 0.2}  # fmt: skip
        for (t, m), vs in scores.items()
        for v in vs
    ]


def test_one_budget_draws_labelled_bars_with_intervals_and_several_a_frontier():
    cells = bar_cells(_bar_records(), 1000)
    assert cells["t1"] == {"full": (75.0, 4), "a": (25.0, 4), "b": (100.0, 4)}
    assert cells["mean"] == {"full": (87.5, 8), "a": (12.5, 8), "b": (75.0, 8)}  # mean of task means
    fig = sweep_figure(_bar_records())
    (ax,) = fig.axes
    bars = [p for p in ax.patches if p.get_width() > 0]
    # one bar per (task incl. mean, method), Full-KV a line, not a bar
    # t1: a 25, b 100; t2: a 0 (no width), b 50; mean: a 12.5, b 75
    assert sorted(b.get_width() for b in bars) == [12.5, 25.0, 50.0, 75.0, 100.0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["a", "b", "t1", "a", "b", "t2", "a", "b", "mean"]  # ticks in order of position  # methods named on the plot, per group
    assert {t.get_text() for t in ax.texts} >= {"25 (n=4)", "12.5 (n=8)"}
    assert {t.get_text() for t in ax.texts} >= {"Full-KV 75", "Full-KV 100", "Full-KV 87.5"}  # per group
    # the error bar of method a on t1 spans its Wilson interval: 25% of 4 -> [4.6%, 69.9%]
    lo, hi = wilson_interval(mean=0.25, n=4)
    segments = [s for c in ax.collections for s in getattr(c, "get_segments", lambda: [])()]
    spans = {(round(float(s[0][0]), 3), round(float(s[1][0]), 3)) for s in segments if len(s) == 2}
    assert (round(100 * lo, 3), round(100 * hi, 3)) in spans
    several = [{**r, "budget": 0.1, "memory_ratio": 0.1} for r in _bar_records() if r["method"] != "full"]
    frontier = sweep_figure(_bar_records() + several)
    assert not [p for p in frontier.axes[0].patches if p.get_width() > 0]  # points and lines, no bars
    assert {t.get_text() for t in frontier.axes[0].texts} >= {"a", "b"}  # each frontier named
    assert frontier_points(_bar_records() + several, 1000)["a"] == [(0.1, 12.5), (0.2, 12.5)]


def test_paired_rows_count_wins_on_shared_samples_only():
    def rec(method, budget, sample, score, task="t1", length=1000):
        return {"task": task, "method": method, "budget": budget, "length": length, "sample": sample, "score": score}

    records = [
        rec("a", 0.2, 0, 100.0), rec("b", 0.2, 0, 0.0),  # a wins
        rec("a", 0.2, 1, 50.0), rec("b", 0.2, 1, 75.0),  # b wins (partial credit)
        rec("a", 0.2, 2, 100.0), rec("b", 0.2, 2, 100.0),  # tie
        rec("a", 0.2, 3, 100.0),  # b never ran sample 3: not a pair
        rec("a", 0.1, 0, 0.0), rec("b", 0.1, 0, 0.0),
        rec("full", None, 0, 100.0), rec("full", None, 1, 100.0),
    ]  # fmt: skip
    rows = {(r["length"], r["budget"]): r for r in paired_rows(records, a="a", b="b")}
    r = rows[(1000, 0.2)]
    assert (r["n"], r["a wins"], r["b wins"], r["ties"]) == (3, 1, 1, 1)
    assert r["a"] == pytest.approx(250 / 3) and r["mean gap"] == pytest.approx((100 - 25 + 0) / 3)
    assert rows[("all", "all")]["n"] == 4
    # Full-KV has no budget: it pairs with the other method at each of its budgets
    full = {(r["length"], r["budget"]): r for r in paired_rows(records, a="a", b="full")}
    assert full[(1000, 0.2)]["n"] == 2 and full[(1000, 0.2)]["full wins"] == 1
    assert full[(1000, 0.1)]["n"] == 1 and full[(1000, 0.1)]["full wins"] == 1
    with pytest.raises(ValueError, match="share no sample"):
        paired_rows(records, a="a", b="nobody")
    assert paired_markdown(paired_rows(records, a="a", b="b")).splitlines()[0].startswith("| length | budget | n |")
