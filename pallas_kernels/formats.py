"""The ledger formats of the Q tier: how a window's keys and values become ``QuantizedWindows`` and back.

Ledger formats (``QuantFormat``; ``FORMATS`` names them, ``quant_format(name, bits)`` picks one by the
``CacheConfig.quant`` name):

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

from models.attention import rope_cos_sin, rotate_half
from pallas_kernels.quant import (
    TOKEN_BITS,
    QuantizedWindows,
    codes_per_byte,
    dequantize_keys,
    dequantize_tokens,
    grid_codes,
    pack_tokens,
    quantize_keys,
)


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
        codes_per_byte(self.bits)
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
        per = codes_per_byte(self.bits)
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

FORMATS: dict[str, QuantFormat] = {
    fmt.name: fmt
    for fmt in (
        ChannelKeys(),  # "channel": its width is the cache's ``bits`` (``quant_format``)
        *(RotatedTokens(k, v, center_keys=True) for k, v in ((4, 3), (4, 4), (3, 4), (3, 3))),
        *(ChannelKeys(2, v_bits=v, rotate_values=True) for v in (3, 4, 2)),
        *(RotatedTokens(k, v) for k, v in ((4, 4), (4, 3), (4, 2), (3, 3), (2, 2))),
    )
}
"""Every ledger format by its name (``CacheConfig.quant``): the formats declare their names, so a new format
is one entry here."""
QUANT_NAMES = tuple(FORMATS)


def quant_format(name: str, bits: int = 2) -> QuantFormat:
    """The ledger format named ``name`` (``FORMATS``): "channel" is built at ``bits``; every other name fixes
    its widths."""
    if name not in FORMATS:
        raise ValueError(f"unknown ledger format quant={name!r}; available: {', '.join(QUANT_NAMES)}")
    fmt = FORMATS[name]
    return ChannelKeys(bits) if fmt == ChannelKeys() else fmt
