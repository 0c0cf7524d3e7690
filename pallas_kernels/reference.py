"""Pure-jnp references of the decode-attention kernels (a Pallas kernel with the same signature replaces
each).

Decode attention over the tiered cache is computed per tier as a *partial* (flash-decoding style): for one
query per head, ``out = sum_j exp(s_j - m) v_j`` (unnormalized), ``m = max_j s_j`` and
``l = sum_j exp(s_j - m)`` over the tier's valid keys, plus per-key (or per-slot) sums of
``exp(s_j - m)`` for scoring. Partials of all tiers are merged by ``combine_partials``.
A tier with no valid key has ``m = NEG_INF`` and ``l = 0``.
Logits are ``s_j = (q . k_j) / sqrt(D)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from models.attention import NEG_INF
from pallas_kernels.quant import dequantize_keys, dequantize_values

Partial = tuple[jax.Array, jax.Array, jax.Array]  # (out [B, Hkv, G, D] f32, m [B, Hkv, G], l [B, Hkv, G])


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


def ledger_attention_reference(
    q: jax.Array,
    kc: jax.Array,
    ks: jax.Array,
    kz: jax.Array,
    vc: jax.Array,
    vs: jax.Array,
    vz: jax.Array,
    slot_start: jax.Array,
    slot_valid: jax.Array,
    inv_freq: jax.Array,
    *,
    window: int,
    bits: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Attention partial of one decode query per head over the packed ledger (Q tier), GQA-grouped.

    Args:
      q: [B, Hkv, G, D] post-RoPE query (unscaled; the 1/sqrt(D) scale is applied here), any float dtype.
      kc: [B, Hkv, NL, D, W*bits/8] uint8 key codes, pre-RoPE, one grid per channel over the slot's window.
      ks, kz: [B, Hkv, NL, D] float16 key scale and min.
      vc: [B, Hkv, NL, W, D*bits/8] uint8 value codes, one grid per token over head_dim.
      vs, vz: [B, Hkv, NL, W] float16 value scale and min.
      slot_start: [B, NL] int32 absolute position of each slot's first token (token i is at slot_start + i);
        keys are dequantized and re-rotated (RoPE) at these positions.
      slot_valid: [B, NL] bool, slots that take part (active Q windows); invalid slots contribute nothing.
      inv_freq: [D/2] float32 RoPE inverse frequencies.
      window: W (static). bits: 2 or 4 (static). Packing as in ``pallas_kernels.quant``.

    Returns (all float32):
      out: [B, Hkv, G, D] unnormalized output ``sum exp(s - m) v_hat`` over valid slots' tokens.
      m: [B, Hkv, G] max logit over valid tokens (NEG_INF when there is none).
      l: [B, Hkv, G] ``sum exp(s - m)`` over valid tokens (0 when there is none).
      slot_mass: [B, Hkv, G, NL] per-slot ``sum exp(s - m)`` (0 for invalid slots).
    """
    b, hkv, g, d = q.shape
    k = dequantize_keys(kc, ks, kz, bits)  # [B, Hkv, NL, W, D]
    v = dequantize_values(vc, vs, vz, bits)  # [B, Hkv, NL, W, D]
    cos, sin = window_rope_tables(slot_start, window, inv_freq)  # [B, NL, W, D/2]
    half = d // 2
    k1, k2 = k[..., :half], k[..., half:]
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, NL, W, D/2]
    k_rot = jnp.concatenate([k1 * cos - k2 * sin, k2 * cos + k1 * sin], axis=-1)  # [B, Hkv, NL, W, D]
    qs = q.astype(jnp.float32) * d**-0.5
    s = jnp.einsum("bkgd,bkntd->bkgnt", qs, k_rot)
    mask = slot_valid[:, None, None, :, None]
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=(-1, -2))
    p = jnp.where(mask, jnp.exp(s - m[..., None, None]), 0.0)
    slot_mass = p.sum(-1)
    out = jnp.einsum("bkgnt,bkntd->bkgd", p, v)
    return out, m, slot_mass.sum(-1), slot_mass


def combine_partials(partials: Sequence[Partial]) -> tuple[jax.Array, list[jax.Array]]:
    """Merge per-tier partials into the softmax attention output.

    partials: (out [B, Hkv, G, D], m [B, Hkv, G], l [B, Hkv, G]) per tier.
    Returns (out [B, Hkv, G, D] f32 normalized, weights: per tier [B, Hkv, G] = exp(m_t - M) / L), so that a
    tier's normalized attention probabilities are its raw ``exp(s - m_t)`` sums times its weight.
    """
    big_m = partials[0][1]
    for _, m, _ in partials[1:]:
        big_m = jnp.maximum(big_m, m)
    scales = [jnp.exp(m - big_m) for _, m, _ in partials]
    total_l = sum(sc * part[2] for sc, part in zip(scales, partials, strict=True))
    inv = jnp.where(total_l > 0, 1.0 / jnp.where(total_l > 0, total_l, 1.0), 0.0)
    out = sum(sc[..., None] * o for sc, (o, _, _) in zip(scales, partials, strict=True)) * inv[..., None]
    return out, [sc * inv for sc in scales]
