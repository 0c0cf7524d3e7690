"""Helpers shared by test modules: the tiny random Llama shape several tests run on, and loading a
``bench/`` script as a module (benchmarks are scripts, not part of the package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from models.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent


def tiny_llama(max_positions: int) -> ModelConfig:
    """A 2-layer Llama (8 query heads, 4 KV heads, head_dim 8, hidden 64, vocabulary 97)."""
    return ModelConfig(
        family="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        max_position_embeddings=max_positions,
    )


def load_bench(name: str) -> ModuleType:
    """The script ``bench/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
