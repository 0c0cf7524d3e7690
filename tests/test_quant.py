"""Quantization and bit packing, against independent numpy references."""

from __future__ import annotations

import functools

import chex
import numpy as np
import pytest
from absl.testing import parameterized
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import quant


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Reference packing: element i -> byte i // (8 // bits), shift (i % (8 // bits)) * bits."""
    per = 8 // bits
    out = np.zeros((*codes.shape[:-1], codes.shape[-1] // per), np.uint8)
    for i in range(codes.shape[-1]):
        out[..., i // per] |= (codes[..., i].astype(np.uint8) << ((i % per) * bits)).astype(np.uint8)
    return out


def np_grid(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference f16 grid over the last axis: min rounded down, scale rounded up (1 for constant groups)."""
    x = x.astype(np.float32)
    lo, hi = x.min(-1), x.max(-1)
    z = lo.astype(np.float16)
    z = np.where(z.astype(np.float32) > lo, np.nextafter(z, np.float16(-np.inf)), z)
    raw = (hi - z.astype(np.float32)) / ((1 << bits) - 1)
    s = raw.astype(np.float16)
    s = np.where(s.astype(np.float32) < raw, np.nextafter(s, np.float16(np.inf)), s)
    s = np.where((hi == lo) | (s == 0), np.float16(1), s)
    return s, z


def np_quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s, z = np_grid(x, bits)
    c = np.round((x.astype(np.float32) - z.astype(np.float32)[..., None]) / s.astype(np.float32)[..., None])
    return np.clip(c, 0, (1 << bits) - 1).astype(np.uint8), s, z


@settings(max_examples=200, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    groups=st.integers(1, 4),
    n_bytes=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_round_trip_and_layout(bits, groups, n_bytes, seed):
    per = 8 // bits
    codes = np.random.default_rng(seed).integers(0, 1 << bits, (groups, n_bytes * per)).astype(np.uint8)
    packed = np.asarray(quant.pack(codes, bits))
    assert packed.dtype == np.uint8 and packed.shape == (groups, n_bytes)
    np.testing.assert_array_equal(packed, np_pack(codes, bits))
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), codes)


def test_pack_rejects_bad_bits_and_sizes():
    with pytest.raises(ValueError, match="bits"):
        quant.pack(np.zeros((4,), np.uint8), 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        quant.pack(np.zeros((6,), np.uint8), 2)


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**31),
    log_scale=st.floats(-6, 3),
    offset=st.floats(-100, 100),
)
def test_quantization_error_at_most_half_a_step(bits, seed, log_scale, offset):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 8)) * 10.0**log_scale + offset).astype(np.float32)
    codes, scale, zero = quant.quantize_groups(x, bits)
    assert scale.dtype == np.float16 and zero.dtype == np.float16
    xhat = np.asarray(quant.dequantize_groups(codes, scale, zero, bits))
    s32 = np.asarray(scale, np.float32)[..., None]
    # half a grid step, plus f32 rounding of x - zero and of code * scale + zero
    slack = 4 * np.finfo(np.float32).eps * (np.abs(x) + np.abs(np.asarray(zero, np.float32))[..., None] + s32)
    assert np.all(np.abs(xhat - x) <= s32 / 2 + slack)
    ref_s, ref_z = np_grid(x, bits)
    np.testing.assert_array_equal(np.asarray(zero), ref_z)
    # f32 division may land one ulp either side of an f16 value: the rounded-up scale may differ by one ulp
    ulp = np.abs(np.nextafter(ref_s, np.float16(np.inf)).astype(np.float32) - ref_s.astype(np.float32))
    assert np.all(np.abs(np.asarray(scale, np.float32) - ref_s.astype(np.float32)) <= ulp)
    # codes are computed against the stored f16 grid (exact rounding ties are the only freedom)
    z32 = np.asarray(zero, np.float32)[..., None]
    ref_c = np.clip(np.round((x.astype(np.float64) - z32) / s32), 0, (1 << bits) - 1)
    assert np.mean(np.asarray(quant.unpack(codes, bits)) == ref_c) > 0.99


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from([2, 4]), value=st.floats(-6e4, 6e4, allow_nan=False, width=16))
def test_constant_groups_are_exact_and_nan_free(bits, value):
    x = np.full((2, 8), value, np.float32)  # float16-representable constants
    codes, scale, zero = quant.quantize_groups(x, bits)
    xhat = np.asarray(quant.dequantize_groups(codes, scale, zero, bits))
    assert np.all(np.isfinite(xhat))
    np.testing.assert_array_equal(np.asarray(scale), np.ones(2, np.float16))
    np.testing.assert_array_equal(xhat, x)


@pytest.mark.parametrize("bits", [2, 4])
def test_keys_per_channel_values_per_token(bits):
    rng = np.random.default_rng(0)
    w, d = 8, 16
    # channel c of the keys lives on its own scale: a per-token grid would be far off
    k = (rng.standard_normal((3, w, d)) * np.logspace(-2, 2, d)).astype(np.float32)
    kc, ks, kz = quant.quantize_keys(k, bits)
    assert kc.shape == (3, d, w * bits // 8) and ks.shape == (3, d) and kz.shape == (3, d)
    ref_c, ref_s, ref_z = np_quantize(np.swapaxes(k, -1, -2), bits)
    np.testing.assert_array_equal(np.asarray(ks), ref_s)
    np.testing.assert_array_equal(np.asarray(kz), ref_z)
    np.testing.assert_array_equal(np.asarray(kc), np_pack(ref_c, bits))
    khat = np.asarray(quant.dequantize_keys(kc, ks, kz, bits))
    assert khat.shape == k.shape
    assert np.all(np.abs(khat - k) <= np.asarray(ks, np.float32)[:, None, :] / 2 * (1 + 1e-3) + 1e-6)

    v = (rng.standard_normal((3, w, d)) * np.logspace(-2, 2, w)[:, None]).astype(np.float32)
    vc, vs, vz = quant.quantize_values(v, bits)
    assert vc.shape == (3, w, d * bits // 8) and vs.shape == (3, w)
    ref_c, ref_s, ref_z = np_quantize(v, bits)
    np.testing.assert_array_equal(np.asarray(vs), ref_s)
    np.testing.assert_array_equal(np.asarray(vc), np_pack(ref_c, bits))
    vhat = np.asarray(quant.dequantize_values(vc, vs, vz, bits))
    assert np.all(np.abs(vhat - v) <= np.asarray(vs, np.float32)[:, :, None] / 2 * (1 + 1e-3) + 1e-6)


class QuantizeJittedAndNot(chex.TestCase):
    """``quantize_groups`` / ``dequantize_groups`` jitted and un-jitted against the float64 bound and the
    numpy grid, with the shapes of their contract."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(2, 4)
    def test_round_trip_within_half_a_step(self, bits):
        x = (np.random.default_rng(bits).standard_normal((3, 5, 8)) * 3.0).astype(np.float32)
        quantize = self.variant(functools.partial(quant.quantize_groups, bits=bits))
        dequantize = self.variant(functools.partial(quant.dequantize_groups, bits=bits))
        codes, scale, zero = quantize(x)
        chex.assert_shape([codes, scale, zero], [(3, 5, 8 * bits // 8), (3, 5), (3, 5)])
        chex.assert_type([codes, scale, zero], [np.uint8, np.float16, np.float16])
        xhat = np.asarray(dequantize(codes, scale, zero), np.float64)
        step = np.asarray(scale, np.float64)[..., None]
        assert np.all(np.abs(xhat - x) <= step / 2 + 1e-5 * (1 + np.abs(x)))
        chex.assert_trees_all_equal(np.asarray(zero), np_grid(x, bits)[1])
