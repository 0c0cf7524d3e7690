"""Converted checkpoints: an orbax checkpoint of the params tree plus the model config (no torch needed).

Folder layout (written by ``models.convert.convert`` / ``save_checkpoint``)::

    OUT/params/             orbax checkpoint of the params dict (layout of ``models.model.param_shapes``)
    OUT/model_config.json   ``ModelConfig.to_json()``
    OUT/tokenizer.json, OUT/tokenizer_config.json   (written by the converter when the source has a tokenizer)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.model import Transformer, check_param_shapes, from_params

PARAMS_DIR = "params"
CONFIG_FILE = "model_config.json"
INFO_FILE = "convert_info.json"


class CheckpointError(ValueError):
    """A folder is not a converted checkpoint, or its contents are unreadable or inconsistent."""


def is_converted_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder with ``model_config.json`` and an orbax ``params/`` checkpoint."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def save_checkpoint(params: dict[str, Any], cfg: ModelConfig, out: str | Path) -> Path:
    """Write ``params`` (nested dict of arrays, checked against ``param_shapes(cfg)``) and ``cfg`` to ``out``.

    ``out`` may exist but must not already hold a checkpoint. Returns ``out``.
    """
    check_param_shapes(cfg, params)
    out = Path(out).absolute()
    if (out / PARAMS_DIR).exists():
        raise FileExistsError(f"{out / PARAMS_DIR} already exists")
    out.mkdir(parents=True, exist_ok=True)
    ocp = _orbax()
    params = jax.tree.map(np.asarray, params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / PARAMS_DIR, params)
        ckptr.wait_until_finished()
    (out / CONFIG_FILE).write_text(cfg.to_json())
    return out


def _require_checkpoint(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    if not is_converted_checkpoint(path):
        hint = ""
        if (path.is_file() and path.suffix == ".gguf") or (path / "config.json").is_file():
            hint = (
                " (this looks like a source model: convert it with models.convert.convert or resolve_model)"
            )
        raise CheckpointError(
            f"{path} is not a converted checkpoint: expected {CONFIG_FILE} and {PARAMS_DIR}/ "
            f"as written by models.convert{hint}"
        )


def load_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a converted checkpoint folder."""
    path = Path(path)
    _require_checkpoint(path)
    try:
        return ModelConfig.from_json((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: unreadable model config: {e}") from e


def load_params(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, params as a nested dict of numpy arrays) of a converted checkpoint, shapes checked."""
    path = Path(path).absolute()
    cfg = load_config(path)
    ocp = _orbax()
    params_dir = path / PARAMS_DIR
    with ocp.StandardCheckpointer() as ckptr:
        try:
            tree = ckptr.metadata(params_dir).item_metadata.tree
            shapes = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype),
                tree,
                is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype"),
            )
        except Exception as e:
            raise CheckpointError(f"{params_dir}: unreadable orbax checkpoint metadata: {e}") from e
        try:
            check_param_shapes(cfg, shapes)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
        try:
            params = ckptr.restore(params_dir)
        except Exception as e:
            raise CheckpointError(f"{params_dir}: cannot restore orbax checkpoint: {e}") from e
    return cfg, params


def load_model(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, Transformer]:
    """Load a converted checkpoint folder as ``(config, Transformer)``.

    dtype: parameter dtype of the model ("float32", "bfloat16", a jnp dtype); None keeps the stored dtype.
    """
    cfg, params = load_params(path)
    if isinstance(dtype, str):
        dtype = jnp.dtype(dtype)
    return cfg, from_params(cfg, params, dtype)
