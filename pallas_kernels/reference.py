"""Pure-jnp reference of the ledger (Q tier) decode-attention kernels: ``ledger_partial`` has the signature
and the result of the CPU kernel (``pallas_kernels.cpu_ledger``) and the Pallas kernel
(``pallas_kernels.ledger_attention``), and is what ``pallas_kernels.dispatch`` runs where neither applies.
The tier types, the dense tiers' partials and the merge are ``pallas_kernels.tiers``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import NEG_INF
from pallas_kernels.formats import ChannelKeys, QuantFormat, RotatedTokens, channel_rotation
from pallas_kernels.tiers import Partial, QuantTier, empty_partial, rotate_values_back, rotated_partial


def window_rope_tables(starts: jax.Array, window: int, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., W, D/2] of RoPE angles at positions ``starts [...] + 0..W-1``, by angle addition from
    the angles of the window starts and of the offsets: 2 (N + W) D/2 transcendentals instead of N W D/2.
    The four small tables are materialized (``optimization_barrier``) so that XLA does not recompute them
    inside every fused consumer."""
    ang_s = starts.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)  # [..., D/2]
    ang_o = jnp.arange(window, dtype=jnp.float32)[:, None] * inv_freq.astype(jnp.float32)  # [W, D/2]
    cs, ss, co, so = jax.lax.optimization_barrier(
        (jnp.cos(ang_s), jnp.sin(ang_s), jnp.cos(ang_o), jnp.sin(ang_o))
    )
    cs, ss = cs[..., None, :], ss[..., None, :]
    return cs * co - ss * so, ss * co + cs * so


def _slots_partial(q: jax.Array, k: jax.Array, v: jax.Array, slot_valid: jax.Array) -> Partial:
    """Partial of q [B, Hkv, G, D] (unscaled) over slots k, v [B, Hkv, NL, W, D] f32; mass per slot."""
    qs = q.astype(jnp.float32) * q.shape[-1] ** -0.5
    s = jnp.einsum("bkgd,bkntd->bkgnt", qs, k)
    mask = slot_valid[:, None, None, :, None]
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=(-1, -2))
    p = jnp.where(mask, jnp.exp(s - m[..., None, None]), 0.0)
    slot_mass = p.sum(-1)
    out = jnp.einsum("bkgnt,bkntd->bkgd", p, v)
    return Partial(out, m, slot_mass.sum(-1), slot_mass)


def rotated_reference(
    q: jax.Array, q_rot: jax.Array, tier: QuantTier, inv_freq: jax.Array, fmt: RotatedTokens
) -> Partial:
    """``RotatedAttention`` in jnp: q_rot [B, Hkv, G, D] against the dequantized rotated keys (their means
    RoPE'd and rotated into the same basis, in the centered format) and values."""
    k, v = fmt.rotated(tier.codes)  # [B, Hkv, NL, W, D]
    if fmt.center_keys:
        starts = tier.slot_start[:, None]  # [B, 1, NL]: every KV head's windows start there
        mean = fmt.mean_keys(tier.codes.k_mean, starts, inv_freq, k.shape[-2])
        k = k + mean @ jnp.asarray(channel_rotation(k.shape[-1]))
    return _slots_partial(q_rot, k, v, tier.slot_valid)


def ledger_partial(
    q: jax.Array, tier: QuantTier, inv_freq: jax.Array, *, window: int, fmt: QuantFormat
) -> Partial:
    """Attention partial of one decode query per head over the packed ledger (Q tier), GQA-grouped.

    Args:
      q: [B, Hkv, G, D] post-RoPE query (unscaled; the 1/sqrt(D) scale is applied here), any float dtype.
      tier: codes in format ``fmt``, slot_start (token i of a slot is at slot_start + i; "channel" keys are
        dequantized and re-rotated there) and slot_valid (invalid slots contribute nothing), see ``QuantTier``.
      inv_freq: [D/2] float32 RoPE inverse frequencies.
      window: W (static). fmt: the ledger format (static, ``pallas_kernels.formats``).

    Returns a ``Partial`` over the valid slots' tokens, mass per slot [B, Hkv, G, NL] (0 for invalid slots).
    """
    codes, slot_start, slot_valid = tier
    if codes.k_codes.shape[2] == 0:
        return empty_partial(q)
    if isinstance(fmt, RotatedTokens):
        return rotated_partial(q, tier, inv_freq, fmt, rotated_reference)
    if not isinstance(fmt, ChannelKeys):
        raise TypeError(f"unknown ledger format {fmt!r}")
    d = q.shape[-1]
    k, v = fmt.stored(codes)  # [B, Hkv, NL, W, D]
    cos, sin = window_rope_tables(slot_start, window, inv_freq)  # [B, NL, W, D/2]
    half = d // 2
    k1, k2 = k[..., :half], k[..., half:]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, NL, W, D/2]
    k_rot = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)  # [B, Hkv, NL, W, D]
    return rotate_values_back(_slots_partial(q, k_rot, v, slot_valid), fmt)
