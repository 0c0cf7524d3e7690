"""Decode attention over the packed ledger on the CPU: an XLA FFI custom call read straight from the codes.

``ledger_attention_cpu`` has the signature and the result of ``reference.ledger_partial`` (up to
float32 rounding); ``cpu/ledger_attention.cc`` is the kernel. The shared library is compiled on first use
with the machine's C++ compiler (``$CXX``, else ``g++``) against the FFI headers that jaxlib ships, into
``$QEVICT_CACHE/kernels`` (else ``~/.cache/qevict-jax/kernels``), named by a hash of the source, the flags
and the jaxlib version, so an edit or an upgrade rebuilds it. ``available()`` says whether it built; where it
cannot (no compiler), callers use the jnp reference and ``unavailable_reason()`` says why.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

from pallas_kernels.formats import ChannelKeys, QuantFormat, RotatedTokens
from pallas_kernels.tiers import Partial, QuantTier, empty_partial, rotate_values_back, rotated_partial

SOURCE = Path(__file__).parent / "cpu" / "ledger_attention.cc"
TARGET = "qevict_ledger_attention"
ROTATED_TARGET = "qevict_rotated_ledger_attention"
CENTERED_TARGET = "qevict_centered_ledger_attention"
# no -ffast-math: linking it sets flush-to-zero for the whole process
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC")


def _cache_dir() -> Path:
    root = os.environ.get("QEVICT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "qevict-jax") / "kernels"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if found is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set $CXX)")
    return found


def library_path() -> Path:
    """Where the compiled kernel for this source, these flags and this jaxlib lives."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + jaxlib.__version__.encode())
    return _cache_dir() / f"ledger_attention-{digest.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the kernel unless it is there (one compile at a time across processes); returns its path."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return path
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            cmd = [_compiler(), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(
                    f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}"
                )
            os.replace(out, path)
    return path


@functools.cache
def _load() -> str | None:
    """Build, load and register the kernel once per process; None when it worked, else the reason."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as e:
        return str(e)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.QevictLedgerAttention), platform="cpu")
    jax.ffi.register_ffi_target(
        ROTATED_TARGET, jax.ffi.pycapsule(lib.QevictRotatedLedgerAttention), platform="cpu"
    )
    jax.ffi.register_ffi_target(
        CENTERED_TARGET, jax.ffi.pycapsule(lib.QevictCenteredLedgerAttention), platform="cpu"
    )
    return None


def available() -> bool:
    """True when the CPU kernel is built and registered (compiles it on the first call)."""
    return _load() is None


def unavailable_reason() -> str | None:
    """Why the CPU kernel could not be built, or None."""
    return _load()


def _results(q: jax.Array, nl: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    b, hkv, g, d = q.shape
    f32 = jnp.float32
    return (
        jax.ShapeDtypeStruct((b, hkv, g, d), f32),
        jax.ShapeDtypeStruct((b, hkv, g), f32),
        jax.ShapeDtypeStruct((b, hkv, g), f32),
        jax.ShapeDtypeStruct((b, hkv, g, nl), f32),
    )


def _code_args(codes) -> tuple[jax.Array, ...]:
    """The ledger's fields as the kernel reads them: codes as bytes, grids as float16."""
    return tuple(x if x.dtype == jnp.uint8 else x.astype(jnp.float16) for x in jax.tree.leaves(codes))


def _rotated_cpu(q: jax.Array, q_rot: jax.Array, tier: QuantTier, inv_freq: jax.Array, fmt: RotatedTokens) -> Partial:
    """``tiers.RotatedAttention`` by the kernel's RotatedTokens handler (the centered one when the keys
    are centered: it also reads the key means, the un-rotated query and the slots' positions)."""
    nl = tier.codes.k_codes.shape[2]
    codes = tier.codes.replace(k_mean=None)  # the six fields every handler reads first
    args = [q_rot.astype(jnp.float32), *_code_args(codes), tier.slot_valid.astype(jnp.uint8)]
    target = ROTATED_TARGET
    if fmt.center_keys:
        target = CENTERED_TARGET
        args += [
            tier.codes.k_mean.astype(jnp.float16),
            q.astype(jnp.float32),
            tier.slot_start.astype(jnp.int32),
            inv_freq.astype(jnp.float32),
        ]
    call = jax.ffi.ffi_call(target, _results(q_rot, nl), vmap_method="sequential")
    return Partial(*call(*args, k_bits=fmt.k_bits, v_bits=fmt.v_bits))


def ledger_attention_cpu(
    q: jax.Array,
    tier: QuantTier,
    inv_freq: jax.Array,
    *,
    window: int,
    fmt: QuantFormat,
) -> Partial:
    """``reference.ledger_partial`` on the CPU from the codes (same arguments, same results).

    "channel": the RoPE angles are formed as the reference forms them (float32 ``position * inv_freq`` of
    each slot start and of each offset, combined by angle addition); the kernel evaluates their sines and
    cosines itself, for the valid slots only, and reads the float16 grids as they are stored.
    ``RotatedTokens``: the query is rotated here, the kernel reads the rotated codes (and, centered, adds
    ``q . RoPE_t(mean)`` from the key means), the output is rotated back here (``tiers.rotated_partial``).
    """
    if not available():
        raise RuntimeError(f"the CPU ledger kernel is unavailable: {unavailable_reason()}")
    codes, slot_start, slot_valid = tier
    nl = codes.k_codes.shape[2]
    if nl == 0:
        return empty_partial(q)
    if isinstance(fmt, RotatedTokens):
        return rotated_partial(q, tier, inv_freq, fmt, _rotated_cpu)
    if not isinstance(fmt, ChannelKeys):
        raise TypeError(f"unknown ledger format {fmt!r}")
    f32 = jnp.float32
    call = jax.ffi.ffi_call(TARGET, _results(q, nl), vmap_method="sequential")
    part = Partial(
        *call(
            q.astype(f32),
            *_code_args(codes),
            slot_valid.astype(jnp.uint8),
            slot_start.astype(jnp.int32),
            inv_freq.astype(f32),
            window=window,
            bits=fmt.bits,
            v_bits=fmt.value_bits,
        )
    )
    return rotate_values_back(part, fmt)
