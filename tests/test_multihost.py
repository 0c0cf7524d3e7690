"""Generation across processes (``qevict_jax.runtime.distributed``): two local processes with 4 fake CPU devices
each, one ``jax.distributed`` job (gloo collectives) on a 2 x 4 mesh ("data" across the processes, "model"
within each), give what one process on one device gives; a process that fails stops the others.

``tests/multihost_worker.py`` is the program every process runs; it also runs alone (one process, one
device) as the reference. Its runs cover Full-KV and QEvict (routing with evictions, promotions and
demotions every 2 steps; four prompts of different lengths in one batch) and a second turn appended to
QEvict's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qevict_jax.runtime.distributed import (
    COORDINATOR,
    HEARTBEAT,
    NUM_PROCESSES,
    PROCESS_ID,
    free_port,
    launch,
)

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("multihost_worker.py")
FAILURE_BOUND_S = 120  # a failure must end every process well within this (measured: about 15 s)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """One process, one device, no mesh."""
    out = tmp_path_factory.mktemp("ref") / "ref.json"
    proc = subprocess.run(
        [sys.executable, str(WORKER), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """Two processes x 4 fake CPU devices, a 2 x 4 mesh, started by the launcher."""
    out = tmp_path_factory.mktemp("mp") / "mp.json"
    rc = launch(
        [sys.executable, str(WORKER), "--mesh", "2x4", "--out", str(out)],
        processes=2,
        devices_per_process=4,
        env=_env(),
        timeout_s=600,
    )
    assert rc == 0
    return json.loads(out.read_text())


def test_two_processes_saw_eight_devices(two_processes, reference):
    assert (two_processes["processes"], two_processes["devices"]) == (2, 8)
    assert (reference["processes"], reference["devices"]) == (1, 1)


@pytest.mark.parametrize("name", ["full", "qevict", "qevict-turn2"])
def test_two_processes_equal_one_process(two_processes, reference, name):
    """Tokens, cache bytes, memory ratio and routing counters are those of one process on one device."""
    many, one = two_processes["runs"][name], reference["runs"][name]
    for field in ("tokens", "cache_bytes", "full_kv_bytes", "memory_ratio"):
        assert many[field] == one[field], field
    for counter in ("routing_events", "evictions", "promotions", "demotions"):
        assert many[counter] == one[counter], counter


def test_the_compared_runs_route_on_a_ragged_batch(reference):
    run = reference["runs"]["qevict"]
    assert min(run["routing_events"]) >= 20
    assert min(run["evictions"]) > 0 and sum(run["promotions"]) + sum(run["demotions"]) > 0
    assert run["memory_ratio"] < 0.5
    assert len(run["tokens"]) == 4 and all(len(t) == 48 for t in run["tokens"])
    assert all(len(t) == 16 for t in reference["runs"]["qevict-turn2"]["tokens"])


def test_a_failing_process_stops_the_others_through_the_launcher(tmp_path):
    """Process 1 raises after its first generation while process 0 goes on into the next one's collectives:
    the launcher returns the failure's status within the bound, names process 1, and no process is left."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from qevict_jax.runtime.distributed import launch; "
            f"sys.exit(launch([sys.executable, {str(WORKER)!r}, '--mesh', '2x4', '--out', "
            f"{str(tmp_path / 'x.json')!r}, '--fail-process', '1'], processes=2, devices_per_process=4))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=FAILURE_BOUND_S,
    )
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1
    assert "qevict: process 1 of 2 failed: RuntimeError: injected failure" in proc.stderr
    assert "qevict: process 1 of 2 failed (exit status 1); stopping the others" in proc.stderr
    assert elapsed < FAILURE_BOUND_S
    assert not (tmp_path / "x.json").exists()


def test_a_failing_process_ends_the_others_without_a_launcher(tmp_path):
    """Separate hosts have no launcher: the environment variables alone, as a user sets them. Process 1
    raises and leaves at once (``run_main``); process 0, waiting in a collective with it, fails too within
    the bound (its peer's connection closes; a silent peer would miss the heartbeat) and says so."""
    env = _env() | {
        COORDINATOR: f"127.0.0.1:{free_port()}",
        NUM_PROCESSES: "2",
        HEARTBEAT: "5",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
    }
    cmd = [sys.executable, str(WORKER), "--mesh", "2x4", "--out", str(tmp_path / "x.json"), "--fail-process", "1"]
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=env | {PROCESS_ID: str(i)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    try:
        errs = [p.communicate(timeout=FAILURE_BOUND_S)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.monotonic() - t0
    assert procs[1].returncode == 1
    assert "qevict: process 1 of 2 failed: RuntimeError: injected failure" in errs[1]
    assert procs[0].returncode != 0, errs[0][-2000:]
    assert elapsed < FAILURE_BOUND_S


def _cli_json(args: list[str]) -> dict:
    """``qevict generate ... --json`` in a subprocess: its JSON line (gloo prints connection lines too)."""
    proc = subprocess.run(
        [sys.executable, "-m", "qevict_jax.cli", "generate", *args, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout[-2000:]  # only process 0 prints
    return json.loads(lines[0])


def test_cli_generate_on_three_processes_equals_one(smollm2_gguf):
    """``qevict generate --processes 3`` (SmolLM2, 3 KV heads: a 1 x 3 mesh, one CPU device per process)
    prints what one process prints: the text, memory ratio and routing counters of a QEvict generation that
    compresses (a ~700-token prompt at β = 0.2, routing while it decodes)."""
    prompt = " ".join(f"Line {i}: the lighthouse keeper counted {i * 7 % 13} ships." for i in range(60))
    args = ["--prompt", prompt, "--method", "qevict", "--budget", "0.2", "--max-new-tokens", "24", "--no-chat"]
    one = _cli_json(args)
    three = _cli_json([*args, "--processes", "3"])
    assert (one["processes"], one["devices"], three["processes"], three["devices"]) == (1, 1, 3, 3)
    assert one["compressed"] and one["memory_ratio"] < 0.5 and one["routing_events"][0] > 0
    for field in ("text", "memory_ratio", "cache_bytes", "full_kv_bytes", "new_tokens"):
        assert three[field] == one[field], field
    for counter in ("routing_events", "promotions", "demotions", "evictions"):
        assert three[counter] == one[counter], counter
