"""Converted checkpoints: an orbax checkpoint of the params tree plus the model config (no torch needed).

Folder layout (written by ``models.convert.convert`` / ``save_checkpoint``)::

    OUT/params/             orbax checkpoint of the params dict (layout of ``models.model.param_shapes``)
    OUT/model_config.json   ``ModelConfig.to_json()``
    OUT/tokenizer.json, OUT/tokenizer_config.json   (written by the converter when the source has a tokenizer)
    OUT/convert_info.json   the source, the dtype and ``files``: every other file's size, modification time
                            and SHA-256 (``file_manifest``), which ``damage`` checks
"""

from __future__ import annotations

import hashlib
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
_DELETE_HINT = (
    "the checkpoint folder {} is damaged: delete it and convert its source again "
    "(resolve_model converts a deleted cache entry again)"
)


class CheckpointError(ValueError):
    """A folder is not a converted checkpoint, or its contents are unreadable or inconsistent."""


def is_converted_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a folder with ``model_config.json`` and an orbax ``params/`` checkpoint."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def file_manifest(path: str | Path) -> dict[str, dict[str, int | str]]:
    """Every file below ``path`` but ``convert_info.json``: {relative path: {"size", "mtime_ns", "sha256"}}."""
    path = Path(path)
    out: dict[str, dict[str, int | str]] = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = file.relative_to(path).as_posix()
        if rel == INFO_FILE:
            continue
        st = file.stat()
        with open(file, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        out[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    return out


def damage(path: str | Path) -> str | None:
    """What is wrong with converted checkpoint ``path`` against the ``files`` its ``convert_info.json``
    records (``file_manifest``), or None when nothing is or nothing is recorded (a folder converted before
    the record existed): a file missing, of another size, or with another modification time and another
    SHA-256 (a file with only another modification time, as a copy has, is hashed and passes when its
    content is the same), or an unreadable ``convert_info.json``."""
    path = Path(path)
    try:
        info = json.loads((path / INFO_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"{INFO_FILE} is unreadable ({e})"
    if not isinstance(info, dict) or "files" not in info:
        return None
    try:
        items = [
            (str(k), int(v["size"]), int(v["mtime_ns"]), str(v["sha256"])) for k, v in info["files"].items()
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{INFO_FILE} has a malformed file list ({type(e).__name__}: {e})"
    for rel, size, mtime_ns, sha in items:
        file = path / rel
        try:
            st = file.stat()
        except FileNotFoundError:
            return f"{rel} is missing"
        if st.st_size != size:
            return f"{rel} is {st.st_size:,} bytes, expected {size:,}"
        if st.st_mtime_ns != mtime_ns:
            with open(file, "rb") as f:
                if hashlib.file_digest(f, "sha256").hexdigest() != sha:
                    return f"{rel} was modified after the conversion (its SHA-256 differs)"
    return None


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
            raise CheckpointError(
                f"{params_dir}: unreadable orbax checkpoint metadata: {e}; {_DELETE_HINT.format(path)}"
            ) from e
        try:
            check_param_shapes(cfg, shapes)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from e
        try:
            params = ckptr.restore(params_dir)
        except Exception as e:
            raise CheckpointError(
                f"{params_dir}: cannot restore orbax checkpoint: {e}; {_DELETE_HINT.format(path)}"
            ) from e
    return cfg, params


def load_model(path: str | Path, dtype: Any = None) -> tuple[ModelConfig, Transformer]:
    """Load a converted checkpoint folder as ``(config, Transformer)``.

    dtype: parameter dtype of the model ("float32", "bfloat16", a jnp dtype); None keeps the stored dtype.
    """
    cfg, params = load_params(path)
    if isinstance(dtype, str):
        dtype = jnp.dtype(dtype)
    return cfg, from_params(cfg, params, dtype)
