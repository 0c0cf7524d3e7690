"""Asymmetric low-bit quantization with bit packing, and the two formats of the ledger (the Q tier).

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

Ledger formats (``QuantFormat``; ``quant_format(name, bits)`` builds one from the ``CacheConfig.quant`` name):

- ``ChannelKeys`` ("channel", KIVI's): pre-RoPE keys with one grid per channel over the window, values one
  grid per token, both ``bits`` wide; attention re-rotates the keys at their positions. "kch2-rotv3" and the
  like keep those keys (2 bits) and store the values rotated by ``R`` (below) with their own width (3 bits):
  the rotation spreads the values' outlier channels, the per-channel keys keep Qwen2's per-channel offsets
  that a per-token grid cannot (docs/quant_study.md); attention rotates the value output back once;
- ``RotatedTokens`` ("rot-k4v3" and the like): post-RoPE keys and values with every head's channels
  rotated by one fixed orthogonal matrix ``R`` (a randomized Hadamard, QuaRot-style: it spreads outlier
  channels over all channels, so one grid per token fits), one grid per token for both, ``k_bits`` /
  ``v_bits`` wide. Attention reads them as they are: ``q R`` once per step against the rotated keys
  (``(qR).(kR) = q.k``), and the value output ``(sum p vR) R^T`` rotated back once. "crot-k4v3" centers the
  keys first: each window's pre-RoPE channel mean is stored in f16 and taken out (RoPE'd at each token)
  before the rotation, and attention adds ``q . RoPE_t(mean)`` back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.attention import rope_cos_sin, rotate_half

SUPPORTED_BITS = (2, 4)
TOKEN_BITS = (2, 3, 4)  # code widths of the per-token groups of ``RotatedTokens``


def _per_byte(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 8 // bits


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Pack codes [..., N] (integers in [0, 2^bits)) into bytes [..., N * bits / 8] uint8."""
    per = _per_byte(bits)
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
    per = _per_byte(bits)
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


# ---------------------------------------------------------------------------------------------- ledger formats


def rope_windows(x: jax.Array, starts: jax.Array, inv_freq: jax.Array, sign: int) -> jax.Array:
    """RoPE-rotate windows x [..., N, W, D] whose first tokens sit at ``starts`` [N] (or [..., N]), float32.

    sign=+1 rotates (pre-RoPE -> post-RoPE), sign=-1 un-rotates.
    """
    pos = starts[..., None] + jnp.arange(x.shape[-2], dtype=jnp.int32)  # [..., N, W]
    cos, sin = rope_cos_sin(sign * pos, inv_freq)  # [..., N, W, D/2]
    return rotate_half(x, cos, sin)


@functools.cache
def channel_rotation(d: int) -> np.ndarray:
    """The fixed orthogonal rotation ``R`` [D, D] float32 of ``RotatedTokens``: a Hadamard matrix with
    randomized column signs, ``H diag(s) / sqrt(D)``, when D is a power of two; else the Q factor of a seeded
    Gaussian matrix. The same for every layer, head and run (seed 0)."""
    rng = np.random.default_rng(0)
    if d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        r = h * rng.choice([-1.0, 1.0], d)[None, :] / np.sqrt(d)
    else:
        r, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return r.astype(np.float32)


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


@dataclasses.dataclass(frozen=True)
class ChannelKeys:
    """The KIVI-style ledger format: pre-RoPE keys, one grid per channel over the window, ``bits`` (2 or 4)
    wide; values one grid per token, ``v_bits`` in (2, 3, 4) wide (None: ``bits``), stored times
    ``channel_rotation(D)`` when ``rotate_values``. Fields [..., N, ...]: k_codes [D, W*bits/8], k_scale /
    k_zero [D], v_codes [W, D*v_bits/8], v_scale / v_zero [W]."""

    bits: int = 2
    v_bits: int | None = None
    rotate_values: bool = False

    def __post_init__(self) -> None:
        _per_byte(self.bits)
        if self.value_bits not in TOKEN_BITS:
            raise ValueError(f"value bits must be one of {TOKEN_BITS}, got {self.value_bits}")

    @property
    def value_bits(self) -> int:
        return self.bits if self.v_bits is None else self.v_bits

    @property
    def name(self) -> str:
        if self.v_bits is None and not self.rotate_values:
            return "channel"
        return f"kch{self.bits}-{'rot' if self.rotate_values else ''}v{self.value_bits}"

    def field_shapes(self, window: int, d: int) -> QuantizedWindows:
        """Trailing shape (after the window axis N) of every field."""
        per = _per_byte(self.bits)
        vb = d * self.value_bits // 8
        return QuantizedWindows((d, window // per), (d,), (d,), (window, vb), (window,), (window,))

    def encode(self, k: jax.Array, v: jax.Array, starts: jax.Array, inv_freq: jax.Array) -> QuantizedWindows:
        """Codes of windows k (post-RoPE), v [..., N, W, D] whose first tokens are at ``starts`` [N]."""
        keys = quantize_keys(rope_windows(k, starts, inv_freq, -1), self.bits)
        v = v.astype(jnp.float32)
        if self.rotate_values:
            v = v @ jnp.asarray(channel_rotation(v.shape[-1]))
        vc, vs, vz = grid_codes(v, self.value_bits)
        return QuantizedWindows(*keys, pack_tokens(vc, self.value_bits), vs, vz)

    def stored(self, codes: QuantizedWindows) -> tuple[jax.Array, jax.Array]:
        """(pre-RoPE keys, values in the stored basis: times R when ``rotate_values``) [..., N, W, D] f32."""
        k = dequantize_keys(codes.k_codes, codes.k_scale, codes.k_zero, self.bits)
        return k, dequantize_tokens(codes.v_codes, codes.v_scale, codes.v_zero, self.value_bits)

    def decode(
        self, codes: QuantizedWindows, starts: jax.Array, inv_freq: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(post-RoPE keys, values) [..., N, W, D] float32 of the codes."""
        k, v = self.stored(codes)
        if self.rotate_values:
            v = v @ jnp.asarray(channel_rotation(v.shape[-1])).T
        return rope_windows(k, starts, inv_freq, +1), v


@dataclasses.dataclass(frozen=True)
class RotatedTokens:
    """The rotated per-token ledger format: post-RoPE keys and values times ``channel_rotation(D)``, one grid
    per token for both, ``k_bits`` / ``v_bits`` in (2, 3, 4). Fields [..., N, ...]: k_codes [W, D*k_bits/8],
    k_scale / k_zero [W], v_codes [W, D*v_bits/8], v_scale / v_zero [W].

    ``center_keys`` ("crot-k4v3"): each window's per-channel mean of its pre-RoPE keys, mu [D] (k_mean, f16),
    is taken out first: the codes hold ``(k - RoPE_t(mu)) R`` for the token at position t, so that a
    per-token grid does not spend its range on a channel offset that is constant before RoPE (Qwen2's key
    bias, SmolLM2's outlier channels: docs/quant_study.md). Attention adds ``q . RoPE_t(mu)`` per token.
    """

    k_bits: int = 4
    v_bits: int = 3
    center_keys: bool = False

    @property
    def name(self) -> str:
        return f"{'crot' if self.center_keys else 'rot'}-k{self.k_bits}v{self.v_bits}"

    def field_shapes(self, window: int, d: int) -> QuantizedWindows:
        return QuantizedWindows(
            (window, d * self.k_bits // 8),
            (window,),
            (window,),
            (window, d * self.v_bits // 8),
            (window,),
            (window,),
            (d,) if self.center_keys else None,
        )

    def encode(self, k: jax.Array, v: jax.Array, starts: jax.Array, inv_freq: jax.Array) -> QuantizedWindows:
        """Codes of windows k (post-RoPE), v [..., N, W, D] whose first tokens are at ``starts`` [N] (read by
        the centered format only: plain rotated keys stay post-RoPE)."""
        r = jnp.asarray(channel_rotation(k.shape[-1]))
        k = k.astype(jnp.float32)
        mean = None
        if self.center_keys:
            mean = jnp.mean(rope_windows(k, starts, inv_freq, -1), axis=-2).astype(jnp.float16)  # [..., N, D]
            k = k - self.mean_keys(mean, starts, inv_freq, k.shape[-2])
        kc, ks, kz = grid_codes(k @ r, self.k_bits)
        vc, vs, vz = grid_codes(v.astype(jnp.float32) @ r, self.v_bits)
        packed = (pack_tokens(kc, self.k_bits), ks, kz, pack_tokens(vc, self.v_bits), vs, vz)
        return QuantizedWindows(*packed, mean)

    @staticmethod
    def mean_keys(mean: jax.Array, starts: jax.Array, inv_freq: jax.Array, window: int) -> jax.Array:
        """RoPE_t(mu) [..., N, W, D] f32 of the windows' pre-RoPE key means mu [..., N, D] at their tokens'
        positions (first ones at ``starts`` [N])."""
        per_token = jnp.broadcast_to(mean.astype(jnp.float32)[..., None, :], (*mean.shape[:-1], window, mean.shape[-1]))
        return rope_windows(per_token, starts, inv_freq, +1)

    def rotated(self, codes: QuantizedWindows) -> tuple[jax.Array, jax.Array]:
        """(keys, values) [..., N, W, D] float32 in the rotated basis, as attention reads them (the centered
        format's keys without their means)."""
        return (
            dequantize_tokens(codes.k_codes, codes.k_scale, codes.k_zero, self.k_bits),
            dequantize_tokens(codes.v_codes, codes.v_scale, codes.v_zero, self.v_bits),
        )

    def decode(
        self, codes: QuantizedWindows, starts: jax.Array, inv_freq: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(post-RoPE keys, values) [..., N, W, D] float32 of the codes (rotated back, means added back)."""
        k, v = self.rotated(codes)
        r = jnp.asarray(channel_rotation(k.shape[-1]))
        k = k @ r.T
        if self.center_keys:
            k = k + self.mean_keys(codes.k_mean, starts, inv_freq, k.shape[-2])
        return k, v @ r.T


QuantFormat = ChannelKeys | RotatedTokens
QUANT_NAMES = (
    "channel", "crot-k4v3", "crot-k4v4", "crot-k3v3", "kch2-rotv3", "kch2-rotv4", "kch2-rotv2",
    "rot-k4v4", "rot-k4v3", "rot-k4v2", "rot-k3v3", "rot-k2v2",
)  # fmt: skip


def quant_format(name: str, bits: int = 2) -> QuantFormat:
    """The ledger format named ``name`` ("channel" takes ``bits``; "kch2-rotvY" and "rot-kXvY" their own
    widths)."""
    if name == "channel":
        _per_byte(bits)
        return ChannelKeys(bits)
    if name not in QUANT_NAMES:
        raise ValueError(f"unknown ledger format quant={name!r}; available: {', '.join(QUANT_NAMES)}")
    if name.startswith("kch"):
        return ChannelKeys(int(name[3]), v_bits=int(name[-1]), rotate_values=True)
    return RotatedTokens(int(name[-3]), int(name[-1]), center_keys=name.startswith("crot"))
