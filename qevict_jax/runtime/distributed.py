"""Generation across processes (one per host, or several on one machine): ``jax.distributed`` set up from
environment variables, a local launcher, and a bounded exit when any process fails.

Every process runs the same program: it calls ``initialize_from_env()`` before JAX starts a backend, builds
the same model and the same prompts, and calls ``generate(..., mesh=make_mesh(...))`` over
``jax.devices()``, which then lists the devices of every process. The jitted prefill, append and decode loop
are the single-process ones; XLA inserts the cross-process collectives (gloo on CPU, NCCL on GPU). Outputs
are gathered to every process (``sharding.to_host``); only process 0 prints (``is_main``).

Environment variables (set them on each host; ``launch`` sets them for local processes):

- ``QEVICT_COORDINATOR``: ``host:port`` of process 0's coordination service (every process connects to it);
- ``QEVICT_NUM_PROCESSES``: the number of processes;
- ``QEVICT_PROCESS_ID``: this process's index, 0 .. N-1 (process 0 hosts the coordinator);
- ``QEVICT_HEARTBEAT_S`` (default 10): seconds after which the coordination service declares a silent
  process dead and stops the others (``jax.distributed.initialize(heartbeat_timeout_seconds=...)``).

Failure: ``run_main`` runs a process's work; an exception prints ``qevict: process i of N failed`` with the
traceback and leaves at once (``os._exit``: no shutdown barrier that would wait for the others). The
others are then stopped by ``launch`` (it terminates the siblings of a failed process) or, on separate hosts,
by the coordination service once the heartbeat timeout passes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence

import jax

COORDINATOR, NUM_PROCESSES, PROCESS_ID, HEARTBEAT = (
    "QEVICT_COORDINATOR",
    "QEVICT_NUM_PROCESSES",
    "QEVICT_PROCESS_ID",
    "QEVICT_HEARTBEAT_S",
)


def env_processes() -> tuple[str, int, int] | None:
    """(coordinator address, number of processes, process id) from the environment, or None when
    ``QEVICT_NUM_PROCESSES`` is unset (one process). A ValueError names a missing or malformed variable."""
    if NUM_PROCESSES not in os.environ:
        return None
    try:
        n, pid = int(os.environ[NUM_PROCESSES]), int(os.environ[PROCESS_ID])
        address = os.environ[COORDINATOR]
    except KeyError as e:
        raise ValueError(f"{NUM_PROCESSES} is set but {e.args[0]} is not") from None
    if n < 1 or not 0 <= pid < n:
        raise ValueError(f"{PROCESS_ID}={pid} is not in 0..{n - 1} ({NUM_PROCESSES}={n})")
    return address, n, pid


def initialize_from_env() -> bool:
    """``jax.distributed.initialize`` from the environment variables (module doc), before any JAX backend
    starts; on the CPU with the gloo collectives. False (and nothing done) for a single process."""
    found = env_processes()
    if found is None or found[1] == 1:
        return False
    address, n, pid = found
    # CPU collectives across processes need an implementation; GPUs use NCCL whatever this says
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    heartbeat = int(os.environ.get(HEARTBEAT, "10"))
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=n,
        process_id=pid,
        heartbeat_timeout_seconds=heartbeat,
        initialization_timeout=max(60, 6 * heartbeat),
        shutdown_timeout_seconds=max(30, 3 * heartbeat),
    )
    return True


def is_main() -> bool:
    """True on the process that prints results: process 0 (also without ``jax.distributed``)."""
    return jax.process_index() == 0


def run_main(main: Callable[[], int | None]) -> None:
    """Run ``main`` and exit with its status; on an exception, print which process failed and the
    traceback, and exit 1 at once (``os._exit``: the shutdown barrier of ``jax.distributed`` would wait for
    processes that are stuck in a collective with this one)."""
    try:
        status = main()
    except BaseException as err:  # noqa: BLE001 - every failure must end this process, named
        found = env_processes()
        who = f"process {found[2]} of {found[1]}" if found else "process 0 of 1"
        print(f"qevict: {who} failed: {type(err).__name__}: {err}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
    sys.exit(status or 0)


def free_port() -> int:
    """A TCP port free on this machine now (for a local coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    command: Sequence[str],
    *,
    processes: int,
    devices_per_process: int | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float | None = None,
    grace_s: float = 5.0,
) -> int:
    """Run ``command`` as ``processes`` local processes of one ``jax.distributed`` job; returns 0 when every
    one exits 0, else the failing one's exit status (1 on a timeout).

    Each gets the environment variables of the module doc (a free local port for the coordinator) and, with
    ``devices_per_process``, that many CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count``).
    Output goes to this process's stdout and stderr. When one exits non-zero, or ``timeout_s`` passes, the
    others are terminated (SIGTERM, then SIGKILL after ``grace_s``) and a line on stderr names the process:
    a failure never leaves the others waiting in a collective.
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    base = dict(os.environ if env is None else env)
    base |= {COORDINATOR: f"127.0.0.1:{free_port()}", NUM_PROCESSES: str(processes)}
    if devices_per_process is not None:
        flags = base.get("XLA_FLAGS", "")
        base["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip()
    children = [
        subprocess.Popen(list(command), env=base | {PROCESS_ID: str(i)}, start_new_session=True)
        for i in range(processes)
    ]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    status = 0
    try:
        while True:
            codes = [c.poll() for c in children]  # every child each time: the first to fail is the one named
            failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                status = codes[failed[0]]
                print(
                    f"qevict: process {failed[0]} of {processes} failed (exit status {status}); "
                    "stopping the others",
                    file=sys.stderr,
                )
                break
            if all(rc == 0 for rc in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                print(f"qevict: timed out after {timeout_s:.0f} s; stopping every process", file=sys.stderr)
                status = 1
                break
            time.sleep(0.1)
    finally:
        _stop(children, grace_s)
    return status


def _stop(children: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Terminate every child still running (its whole process group), then kill what outlives ``grace_s``."""
    for c in children:
        if c.poll() is None:
            os.killpg(c.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for c in children:
        try:
            c.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(c.pid, signal.SIGKILL)
            c.wait()
