"""Asymmetric low-bit quantization with bit packing, and the ledger's codes as one pytree (``QuantizedWindows``).

A *group* is the set of elements that share one grid ``(scale, zero)``:

- keys (pre-RoPE): one grid per channel over a window, ``k [..., W, D]`` -> codes ``[..., D, W*bits/8]``;
- values: one grid per token over head_dim, ``v [..., W, D]`` -> codes ``[..., W, D*bits/8]``.

Grid: ``scale = (max - min) / (2^bits - 1)`` (1 where max == min), stored with ``min`` in float16. The f16
grid is rounded *outward* (min rounded down, scale rounded up) so that it still covers ``[min, max]``; codes
are computed against that f16 grid, hence ``|x - x_hat| <= scale_f16 / 2`` for every element (up to f32
rounding). Dequantization is ``x_hat = code * scale + zero`` in float32.

Packing: element ``i`` of a group goes to byte ``i // (8 // bits)`` at bit shift ``(i % (8 // bits)) * bits``.
3-bit codes (per-token groups only, ``pack_tokens``) are two planes: the low 2 bits packed as 2-bit codes,
then the high bit packed 8 per byte (element i at byte i // 8, shift i % 8), ``3 N / 8`` bytes per group.

The ledger formats that use them (how a window's keys and values become codes, and back) are in
``pallas_kernels.formats``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

SUPPORTED_BITS = (2, 4)
TOKEN_BITS = (2, 3, 4)  # code widths of per-token groups (``pack_tokens``)


def codes_per_byte(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 8 // bits


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack codes [..., N] (integers in [0, 2^bits)) into bytes [..., N * bits / 8] uint8."""
    per = codes_per_byte(bits)
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"group size {n} is not a multiple of {per} (needed to pack {bits}-bit codes)")
    c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], n // per, per)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    shifted = jnp.left_shift(c, shifts)
    # the shifted fields are disjoint, so a sum is a bitwise or
    return jnp.sum(shifted, axis=-1, dtype=jnp.uint8)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Unpack bytes [..., M] uint8 into codes [..., M * 8 / bits] uint8."""
    per = codes_per_byte(bits)
    shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
    mask = jnp.uint8((1 << bits) - 1)
    fields = jnp.right_shift(packed.astype(jnp.uint8)[..., None], shifts) & mask
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _round_down_f16(x: jax.Array) -> jax.Array:
    """Largest float16 <= x (x float32)."""
    h = x.astype(jnp.float16)
    return jnp.where(h.astype(jnp.float32) > x, jnp.nextafter(h, jnp.float16(-jnp.inf)), h)


def _round_up_f16(x: jax.Array) -> jax.Array:
    """Smallest float16 >= x (x float32)."""
    h = x.astype(jnp.float16)
    return jnp.where(h.astype(jnp.float32) < x, jnp.nextafter(h, jnp.float16(jnp.inf)), h)


def quantize_groups(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantize each group x [..., N] (last axis = one group) to ``bits`` bits (2 or 4).

    Returns (codes [..., N * bits / 8] uint8 packed, scale [...] float16, zero [...] float16).
    """
    codes, scale, zero = grid_codes(x, bits)
    return pack(codes, bits), scale, zero


def grid_codes(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The f16 grid of each group x [..., N] and the codes on it: (codes [..., N] uint8 unpacked, scale [...]
    f16, zero [...] f16), ``|x - (code * scale + zero)| <= scale / 2``."""
    levels = (1 << bits) - 1
    xf = x.astype(jnp.float32)
    lo = jnp.min(xf, axis=-1)
    hi = jnp.max(xf, axis=-1)
    zero = _round_down_f16(lo)
    raw = (hi - zero.astype(jnp.float32)) / levels
    scale = _round_up_f16(raw)
    # the f32 division can fall short by an ulp; the grid must still reach max
    short = zero.astype(jnp.float32) + levels * scale.astype(jnp.float32) < hi
    scale = jnp.where(short, jnp.nextafter(scale, jnp.float16(jnp.inf)), scale)
    # constant groups (and ranges so small that the f16 scale underflows) get scale 1
    scale = jnp.where((hi == lo) | (scale == 0), jnp.float16(1.0), scale)
    s32 = scale.astype(jnp.float32)[..., None]
    z32 = zero.astype(jnp.float32)[..., None]
    codes = jnp.clip(jnp.round((xf - z32) / s32), 0, levels).astype(jnp.uint8)
    return codes, scale, zero


def dequantize_groups(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``quantize_groups``: codes [..., N * bits / 8], scale, zero [...] -> x_hat [..., N] f32."""
    c = unpack(codes, bits).astype(jnp.float32)
    return c * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]


def dequantize_tokens(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """Per-token groups of ``pack_tokens`` codes [..., N, D*bits/8], scale and zero [..., N] -> [..., N, D]
    f32 (``bits`` in (2, 3, 4))."""
    c = unpack_tokens(codes, bits).astype(jnp.float32)
    return c * scale.astype(jnp.float32)[..., None] + zero.astype(jnp.float32)[..., None]


def quantize_keys(k: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-channel quantization of pre-RoPE keys over a window.

    k [..., W, D] -> (codes [..., D, W * bits / 8] uint8, scale [..., D] f16, zero [..., D] f16).
    """
    return quantize_groups(jnp.swapaxes(k, -1, -2), bits)


def dequantize_keys(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """codes [..., D, W * bits / 8], scale, zero [..., D] -> pre-RoPE keys [..., W, D] float32."""
    return jnp.swapaxes(dequantize_groups(codes, scale, zero, bits), -1, -2)


def quantize_values(v: jax.Array, bits: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-token quantization of values over head_dim.

    v [..., W, D] -> (codes [..., W, D * bits / 8] uint8, scale [..., W] f16, zero [..., W] f16).
    """
    return quantize_groups(v, bits)


def dequantize_values(codes: jax.Array, scale: jax.Array, zero: jax.Array, bits: int) -> jax.Array:
    """codes [..., W, D * bits / 8], scale, zero [..., W] -> values [..., W, D] float32."""
    return dequantize_groups(codes, scale, zero, bits)


@struct.dataclass
class QuantizedWindows:
    """N windows of W tokens in packed low-bit codes, one pytree (the ledger's data; leading axes ``...``).

    Keys are pre-RoPE with one grid per channel over the window, values one grid per token over head_dim:
    k_codes [..., N, D, W*bits/8] uint8, k_scale / k_zero [..., N, D] f16, v_codes [..., N, W, D*bits/8]
    uint8, v_scale / v_zero [..., N, W] f16 (the other formats' layouts: their ``field_shapes``). k_mean
    [..., N, D] f16: each window's per-channel mean of its pre-RoPE keys, in the centered format only (None,
    no leaf, in the others). ``take`` and ``put`` index the window axis N.
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    k_mean: jax.Array | None = None

    def dequantize(self, bits: int) -> tuple[jax.Array, jax.Array]:
        """(pre-RoPE keys, values), each [..., N, W, D] float32."""
        k = dequantize_keys(self.k_codes, self.k_scale, self.k_zero, bits)
        return k, dequantize_values(self.v_codes, self.v_scale, self.v_zero, bits)

    def trailing_axes(self) -> QuantizedWindows:
        """The number of axes after the window axis N, per field (same structure as ``self``)."""
        return QuantizedWindows(2, 1, 1, 2, 1, 1, None if self.k_mean is None else 1)

    def take(self, idx: jax.Array) -> QuantizedWindows:
        """The windows at ``idx`` [M] of the window axis."""
        return jax.tree.map(lambda x, t: jnp.take(x, idx, axis=x.ndim - t - 1), self, self.trailing_axes())

    def put(self, idx: jax.Array, other: QuantizedWindows) -> QuantizedWindows:
        """``other``'s windows [..., M, ...] written at ``idx`` [M] of the window axis (out-of-range = dropped)."""

        def put_one(x, y, t):
            at = (slice(None),) * (x.ndim - t - 1) + (idx,)
            return x.at[at].set(y.astype(x.dtype), mode="drop")

        return jax.tree.map(put_one, self, other, self.trailing_axes())


def quantize_windows(k: jax.Array, v: jax.Array, bits: int) -> QuantizedWindows:
    """k (pre-RoPE), v [..., N, W, D] -> their ``QuantizedWindows``."""
    return QuantizedWindows(*quantize_keys(k, bits), *quantize_values(v, bits))


def pack_tokens(codes: jax.Array, bits: int) -> jax.Array:
    """Pack per-token codes [..., D] of ``bits`` in (2, 3, 4) into [..., D * bits / 8] uint8 (3 bits: a 2-bit
    plane then a 1-bit plane, see the module docstring)."""
    if bits != 3:
        return pack(codes, bits)
    c = codes.astype(jnp.uint8)
    n = c.shape[-1]
    if n % 8:
        raise ValueError(f"group size {n} is not a multiple of 8 (needed to pack 3-bit codes)")
    high = (c >> 2).reshape(*c.shape[:-1], n // 8, 8)
    shifts = jnp.arange(8, dtype=jnp.uint8)
    high = jnp.sum(jnp.left_shift(high, shifts), axis=-1, dtype=jnp.uint8)
    return jnp.concatenate([pack(c & jnp.uint8(3), 2), high], axis=-1)


def unpack_tokens(packed: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``pack_tokens``: [..., D * bits / 8] uint8 -> codes [..., D] uint8."""
    if bits != 3:
        return unpack(packed, bits)
    n = packed.shape[-1] * 8 // 3
    low = unpack(packed[..., : n // 4], 2)
    shifts = jnp.arange(8, dtype=jnp.uint8)
    high = (jnp.right_shift(packed[..., n // 4 :, None], shifts) & jnp.uint8(1)).reshape(low.shape)
    return low | jnp.left_shift(high, jnp.uint8(2))
