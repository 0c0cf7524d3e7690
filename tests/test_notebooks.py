"""notebooks/pareto.ipynb runs top to bottom on a sweep's results file (written here by the runner)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qevict_jax.eval.sweep import expand_jobs, run_sweep

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "pareto.ipynb"


def fake_run(job) -> dict:
    """Deterministic stand-in records: scores fall as the budget shrinks; Full-KV scores best."""
    budget = job.budget if job.budget is not None else 1.0
    return {
        "score": 100.0 * min(1.0, budget * 4) * (1 - 0.1 * (job.sample % 2)),
        "memory_ratio": budget + 0.003 * job.sample,
        "cache_bytes": int(1e6 * budget),
        "full_kv_bytes": 1_000_000,
        "prompt_tokens": job.length - 100,
        "prediction": "",
        "ttft_s": 0.1,
        "decode_tokens_per_s": 50.0,
    }


def test_pareto_notebook_executes(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    methods = [("full", None), ("qevict", 0.1), ("qevict", 0.2), ("r2", 0.1), ("r2", 0.2)]
    jobs = expand_jobs(["niah_single_1", "vt"], methods, [2048, 4096], 2)
    results = tmp_path / "results.jsonl"
    run_sweep(jobs, fake_run, results, progress=False)
    monkeypatch.setenv("QEVICT_RESULTS", str(results))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{len(jobs)} samples from {results}" in text
    assert re.search(r"qevict  memory  0\.10\d  score +\d+\.\d+", text)  # frontier points listed
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 3  # the pooled plot and one per task
    tables = [o for c in nb.cells for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})]
    assert "| vt | qevict | 0.1 |" in tables[0]["data"]["text/markdown"]


DRIFT = Path(__file__).parents[1] / "notebooks" / "attention_drift.ipynb"


def test_attention_drift_notebook_executes(tmp_path, monkeypatch):
    """notebooks/attention_drift.ipynb runs the diagnosis (tiny random model) and draws its three plots."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("QEVICT_DIAGNOSE_MODEL", "tiny")
    monkeypatch.setenv("QEVICT_DIAGNOSE_FIGURES", str(tmp_path))
    monkeypatch.delenv("QEVICT_DIAGNOSE_RESULTS", raising=False)
    nb = nbformat.read(DRIFT, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(DRIFT.parent)}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Table 15 (tier mass)" in text
    assert re.search(r"qevict-nopromo: 0 Q->F transitions", text)
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "diagnose_fmm.png",
        "diagnose_tier_mass.png",
        "diagnose_transitions.png",
    ]
