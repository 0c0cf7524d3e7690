"""GGUF dequantization of the quant types in Qwen2.5-Coder-0.5B's GGUF (Q4_K, Q5_0, Q6_K, Q8_0), on small
synthetic tensors: no model download.

Each block is packed here from random integer codes and scales following ggml's documented block layouts
(``block_q4_K``, ``block_q5_0``, ``block_q6_K``, ``block_q8_0`` in ggml-common.h), so the value of every element
is known in float64 from its code and scales alone, without any decoder. The packed bytes are written into a
small GGUF with ``gguf.GGUFWriter`` (raw quantized data) and read back through the converter's path,
``models.sources.GGUFSource.read``. For Q5_0 and Q8_0, which ``gguf.quants.quantize`` can produce, random
floats are also quantized by it and the round trip is held to the error bound of the format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from models.sources import GGUFSource

QK_K = 256  # values per k-quant super-block
QK = 32  # values per Q5_0 / Q8_0 block


def _f16(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """``n`` random positive scales, rounded to float16 (as stored), [n]."""
    return rng.uniform(lo, hi, n).astype(np.float16)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float16 [n] -> its little-endian bytes [n, 2]."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


# ------------------------------------------------------------------------------------------- block packers
# Each packer takes random codes for n blocks and returns (bytes [n, block bytes], expected values [n, block]
# in float64 computed from the codes and scales, not from the bytes).


def pack_q8_0(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """block_q8_0 (34 bytes per 32 values): d f16, qs int8[32]; x = d * q."""
    d = _f16(rng, n, 1e-3, 0.1)
    q = rng.integers(-128, 128, (n, QK)).astype(np.int8)
    raw = np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)
    return raw, d.astype(np.float64)[:, None] * q


def pack_q5_0(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """block_q5_0 (22 bytes per 32 values): d f16, qh u32 (bit i = 5th bit of value i), qs[16] (low nibble:
    value j, high nibble: value j + 16); x = d * (q - 16), q in [0, 32)."""
    d = _f16(rng, n, 1e-3, 0.1)
    q = rng.integers(0, 32, (n, QK)).astype(np.uint32)
    qh = ((q >> 4) & 1) << np.arange(QK, dtype=np.uint32)
    qh = np.bitwise_or.reduce(qh, axis=1).astype("<u4").view(np.uint8).reshape(n, 4)
    qs = ((q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)).astype(np.uint8)
    raw = np.concatenate([_f16_bytes(d), qh, qs], axis=1)
    return raw, d.astype(np.float64)[:, None] * (q.astype(np.float64) - 16)


def pack_q4_k(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """block_q4_K (144 bytes per 256 values): d f16, dmin f16, scales[12] (eight 6-bit scales and eight 6-bit
    mins), qs[128]. Sub-block s (32 values) has scale sc[s], min m[s]; x = d * sc[s] * q - dmin * m[s], q in
    [0, 16). Byte 32 * j + l of qs holds value l of sub-block 2j (low nibble) and of 2j + 1 (high nibble).
    Scales (ggml ``get_scale_min_k4``), for k < 4: byte k = sc[k] | (sc[k+4] >> 4) << 6, byte k + 4 =
    m[k] | (m[k+4] >> 4) << 6, byte k + 8 = (sc[k+4] & 15) | (m[k+4] & 15) << 4."""
    d, dmin = _f16(rng, n, 1e-3, 0.02), _f16(rng, n, 1e-3, 0.02)
    sc = rng.integers(0, 64, (n, 8)).astype(np.uint8)
    m = rng.integers(0, 64, (n, 8)).astype(np.uint8)
    q = rng.integers(0, 16, (n, 8, 32)).astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            m[:, :4] | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)
    raw = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    d64, dmin64 = d.astype(np.float64)[:, None, None], dmin.astype(np.float64)[:, None, None]
    expected = d64 * sc[:, :, None] * q - dmin64 * m[:, :, None]
    return raw, expected.reshape(n, QK_K)


def pack_q6_k(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """block_q6_K (210 bytes per 256 values): ql[128] (low 4 bits), qh[64] (high 2 bits), scales int8[16],
    d f16. Value e has 6-bit code q[e] and scale sc[e // 16]; x = d * sc * (q - 32). Half h (128 values,
    ql[64h:], qh[32h:]), l < 32: ql[l] = q[l] | q[l+64] << 4 (low nibbles), ql[l+32] = q[l+32] | q[l+96] << 4,
    qh[l] = q[l] | q[l+32] << 2 | q[l+64] << 4 | q[l+96] << 6 (high bit pairs)."""
    d = _f16(rng, n, 1e-4, 0.01)
    sc = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    q = rng.integers(0, 64, (n, 2, 4, 32)).astype(np.uint8)  # [block, half, quarter t (values 32t + l), l]
    lo, hi = q & 0xF, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    raw = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    codes = q.reshape(n, QK_K).astype(np.float64) - 32
    expected = d.astype(np.float64)[:, None] * np.repeat(sc.astype(np.float64), 16, axis=1) * codes
    return raw, expected


PACKERS: dict[str, tuple[gguf.GGMLQuantizationType, int, Callable]] = {
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, QK, pack_q8_0),
    "Q5_0": (gguf.GGMLQuantizationType.Q5_0, QK, pack_q5_0),
    "Q4_K": (gguf.GGMLQuantizationType.Q4_K, QK_K, pack_q4_k),
    "Q6_K": (gguf.GGMLQuantizationType.Q6_K, QK_K, pack_q6_k),
}


def write_quant_gguf(
    path: Path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]
) -> Path:
    """A GGUF holding ``tensors``: name -> (raw bytes [rows, bytes per row] uint8, their quant type), or
    (a float32 array, None) for an F32 tensor."""
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", list(PACKERS))
def test_block_sizes_match_ggml(kind):
    qtype, block, pack = PACKERS[kind]
    raw, expected = pack(np.random.default_rng(0), 3)
    assert (block, raw.shape[1]) == gguf.GGML_QUANT_SIZES[qtype]
    assert expected.shape == (3, block)


@pytest.mark.parametrize("kind", list(PACKERS))
def test_dequantize_random_blocks(tmp_path, kind):
    """Rows of several blocks (row-major block order), read back as [rows, cols] float32."""
    qtype, block, pack = PACKERS[kind]
    rows, per_row = 3, 4
    raw, expected = pack(np.random.default_rng(sum(map(ord, kind))), rows * per_row)
    assert np.abs(expected).max() > 0.1  # codes and scales are not degenerate
    path = write_quant_gguf(tmp_path / "q.gguf", {"w": (raw.reshape(rows, -1), qtype)})
    src = GGUFSource(path)
    assert src.shape("w") == (rows, per_row * block)
    got = src.read("w")
    assert got.dtype == np.float32 and got.shape == (rows, per_row * block)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(got, expected.reshape(rows, -1), rtol=1e-6, atol=1e-6 * scale)


def test_mixed_types_in_one_file(tmp_path):
    """One file with every type plus F32, as in the real GGUF: each tensor reads back as its own values."""
    rng = np.random.default_rng(7)
    tensors, expected = {}, {}
    for kind, (qtype, _, pack) in PACKERS.items():
        raw, exp = pack(rng, 2)
        tensors[kind] = (raw.reshape(1, -1), qtype)
        expected[kind] = exp.reshape(1, -1)
    dense = rng.standard_normal((5, 7)).astype(np.float32)
    src = GGUFSource(write_quant_gguf(tmp_path / "mixed.gguf", tensors | {"dense": (dense, None)}))
    assert src.names() == {*PACKERS, "dense"}
    for kind, exp in expected.items():
        np.testing.assert_allclose(src.read(kind), exp, rtol=1e-6, atol=1e-6 * np.abs(exp).max())
    np.testing.assert_array_equal(src.read("dense"), dense)


@pytest.mark.parametrize(("kind", "levels"), [("Q8_0", 127), ("Q5_0", 16)])
def test_quantize_round_trip_error_bound(tmp_path, kind, levels):
    """gguf's own quantizer on random floats, read back through the converter: per block of 32, the scale
    is d = amax / levels (stored as float16) and every value is within one step d (half a step for all but
    the values Q5_0's asymmetric range clips), the mean error near the d / 4 of uniform rounding."""
    qtype = PACKERS[kind][0]
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 2.0, (8, 1))).astype(np.float32)
    raw = gguf.quants.quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (8, 256 // QK * gguf.GGML_QUANT_SIZES[qtype][1])
    got = GGUFSource(write_quant_gguf(tmp_path / "rt.gguf", {"w": (raw, qtype)})).read("w")
    blocks = x.reshape(-1, QK).astype(np.float64)
    err = np.abs(got.reshape(-1, QK) - blocks)
    step = np.abs(blocks).max(axis=1, keepdims=True) / levels
    assert (err <= 1.01 * step).all()
    if kind == "Q8_0":  # symmetric: nothing clips
        assert (err <= 0.51 * step + 127 * step * 2.0**-11).all()  # + float16 rounding of d
    assert 0.15 < (err / step).mean() < 0.3
