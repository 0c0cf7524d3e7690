"""Decode attention over the packed INT2/INT4 ledger (the Q tier) as a Pallas kernel (docs/design.md §9).

``ledger_attention`` has the signature and outputs of ``pallas_kernels.reference.ledger_partial``.
It reads the packed codes and the f16 grids once, dequantizes in registers, re-rotates the keys at their
own positions in-kernel and never materializes a dequantized cache in device memory.

Kernel structure (flash-decoding split-K):

- grid ``(B, Hkv, splits)``; one program handles all G query heads of one KV head (GQA) over a contiguous
  range of ``chunks * block`` ledger slots, looping over ``chunks`` steps of ``block`` slots (``W`` tokens
  each) with an online softmax (running max, sum and output per query head, kept in registers);
- each program writes a partial ``(out [G, D], m [G], l [G])``, the per-slot sums ``exp(s - m_i)`` of
  every step and the running max ``m_i`` they are relative to; a small jnp combine (``combine_splits``)
  rescales all of them to the global max.

Triton lowering (what keeps every in-kernel array a power of two and avoids unsupported ops):

- no ``dot``: the G query heads are a static Python loop and logits are broadcast-multiply-reduce over D
  (decode attention is memory-bound; this avoids Triton's >= 16 dot dims, so G needs no padding). Block
  arrays have shapes ``[block, D/2, W]`` (keys), ``[block, W, D]`` (values), ``[block, W]`` (logits);
  block, W, D must be powers of two for the Triton lowering (interpret mode has no such limit);
- codes are unpacked with a broadcast shift ``(codes[..., None] >> [0, bits, ...]) & mask`` and a reshape
  that merges the last two axes, which reproduces the packing order (element i at byte i // (8 // bits),
  shift (i % (8 // bits)) * bits);
- the key halves ``[:D/2]`` and ``[D/2:]`` needed by the rotate-half RoPE are loaded as two ref slices,
  so no register-level slicing or concatenation is needed;
- all big loads are masked by slot validity (``pltriton.load(mask=...)``): invalid slots (dormant ledger
  entries, free slots, the ragged tail past NL) are never read and contribute exactly 0 even if their
  memory holds NaN; only the small ``slot_start`` / ``slot_valid`` arrays are padded in the wrapper.

RoPE in-kernel: the angle ``a = fl(fl(p) * theta)`` (exactly what ``models.attention.apply_rope`` computes)
is evaluated per token, but its cosine and sine come from the angle-addition formula
``a = base + off + eps`` with ``base = fl(start * theta)`` per slot, ``off = fl(t * theta)`` per in-window
offset and a tiny residual ``eps = (a - base) - off``. This needs ``D/2`` transcendentals per *slot*
(plus ``W * D/2`` per program) instead of ``D`` per token, and matches ``cos(a)`` / ``sin(a)`` to about
1e-6 (second-order in ``eps``, which is a few ulps of ``a``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.formats import ChannelKeys, QuantFormat, RotatedTokens
from pallas_kernels.quant import QuantizedWindows
from pallas_kernels.splitk import (
    DEFAULT_LAUNCH,
    Launch,
    PartialRefs,
    SplitPlan,
    masked_load,
    online_softmax,
    pad_slots,
    split_attention,
    unpack_last,
)
from pallas_kernels.tiers import Partial, QuantTier, empty_partial, rotate_values_back, rotated_partial

LEDGER_WARPS = 8  # Triton warps of the ledger kernels unless the launch names some


# ----------------------------------------------------------------------------------------------------------
# in-kernel RoPE


def window_cos_sin(start: jax.Array, theta: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [BS, D/2, W] of the angles ``fl(fl(start + t) * theta)`` for t < W (see the module docstring).

    start: [BS] int32 first position of each slot; theta: [D/2] f32 inverse frequencies.
    """
    th = theta[None, :, None]  # [1, D/2, 1]
    t = jnp.arange(window, dtype=jnp.int32)[None, None, :]  # [1, 1, W]
    angle = (start[:, None, None] + t).astype(jnp.float32) * th  # [BS, D/2, W], as apply_rope
    base = start.astype(jnp.float32)[:, None, None] * th  # [BS, D/2, 1]
    off = t.astype(jnp.float32) * th  # [1, D/2, W]
    eps = (angle - base) - off  # few ulps of angle
    cb, sb = jnp.cos(base), jnp.sin(base)
    co, so = jnp.cos(off), jnp.sin(off)
    e2 = 1.0 - 0.5 * eps * eps  # cos(eps); sin(eps) ~ eps
    c_off = co * e2 - so * eps
    s_off = so * e2 + co * eps
    return cb * c_off - sb * s_off, sb * c_off + cb * s_off


# ----------------------------------------------------------------------------------------------------------
# the ledger kernel


def _dequant_rows(codes_ref, scale_ref, zero_ref, valid: jax.Array, bits: int) -> jax.Array:
    """Dequantize slots whose grid runs along the last axis: codes [BS, R, N*bits/8], scale and zero [BS, R]
    (masked by valid [BS]) -> [BS, R, N] f32. Keys: R = channels C, N = the window's W tokens (per-channel
    grid); values: R = the W tokens, N = head_dim D (per-token grid)."""
    bs, r, nb = codes_ref.shape
    codes = masked_load(codes_ref, jnp.broadcast_to(valid[:, None, None], (bs, r, nb)))
    grid_mask = jnp.broadcast_to(valid[:, None], (bs, r))
    scale = masked_load(scale_ref, grid_mask).astype(jnp.float32)
    zero = masked_load(zero_ref, grid_mask).astype(jnp.float32)
    return unpack_last(codes, bits).astype(jnp.float32) * scale[:, :, None] + zero[:, :, None]


def _ledger_kernel(
    q_ref,
    kc_ref,
    ks_ref,
    kz_ref,
    vc_ref,
    vs_ref,
    vz_ref,
    start_ref,
    valid_ref,
    freq_ref,
    outs: PartialRefs,
    *,
    window: int,
    bits: int,
    v_bits: int,
    plan: SplitPlan,
):
    """One program of the "channel" format (``ChannelKeys``). q [G, D]; keys: codes [CH, D, W*bits/8],
    scale and zero [CH, D] per channel; values: codes [CH, W, D*v_bits/8] (``pack_tokens``), scale and zero
    [CH, W] per token, in the stored basis; start, valid [CH] int32; freq [D/2] f32."""
    groups, d = q_ref.shape
    half = d // 2
    scale = d**-0.5
    theta = freq_ref[...].astype(jnp.float32)
    q1 = [q_ref[g, pl.ds(0, half)].astype(jnp.float32) * scale for g in range(groups)]
    q2 = [q_ref[g, pl.ds(half, half)].astype(jnp.float32) * scale for g in range(groups)]
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    def load(rows, valid):
        k1 = _dequant_rows(kc_ref.at[rows, lo], ks_ref.at[rows, lo], kz_ref.at[rows, lo], valid, bits)
        k2 = _dequant_rows(kc_ref.at[rows, hi], ks_ref.at[rows, hi], kz_ref.at[rows, hi], valid, bits)
        cos, sin = window_cos_sin(start_ref[rows], theta, window)  # [BS, D/2, W]
        kr1 = k1 * cos - k2 * sin
        kr2 = k2 * cos + k1 * sin
        v = _dequant_tokens(vc_ref, vs_ref, vz_ref, rows, valid, v_bits)  # [BS, W, D]
        logits = [
            jnp.sum(q1[g][None, :, None] * kr1 + q2[g][None, :, None] * kr2, axis=1) for g in range(groups)
        ]
        return logits, v

    online_softmax(load, valid_ref=valid_ref, outs=outs, plan=plan, groups=groups, window=window, d=d)


def _dequant_tokens(codes_ref, scale_ref, zero_ref, rows, valid: jax.Array, bits: int) -> jax.Array:
    """Dequantize the slots ``rows`` (a ``pl.ds``) of per-token groups of ``pack_tokens`` codes
    [CH, W, D*bits/8] (3 bits: the 2-bit plane of D/4 bytes, then the 1-bit plane of D/8, loaded as two ref
    slices), scale and zero [CH, W] -> [BS, W, D]. Every ref is indexed once (Triton lowers one indexer per
    load)."""
    if bits != 3:
        return _dequant_rows(codes_ref.at[rows], scale_ref.at[rows], zero_ref.at[rows], valid, bits)
    _, w, nb = codes_ref.shape
    bs = valid.shape[0]
    d = nb * 8 // 3
    low_ref, high_ref = codes_ref.at[rows, :, pl.ds(0, d // 4)], codes_ref.at[rows, :, pl.ds(d // 4, d // 8)]
    low = unpack_last(masked_load(low_ref, jnp.broadcast_to(valid[:, None, None], (bs, w, d // 4))), 2)
    high = unpack_last(masked_load(high_ref, jnp.broadcast_to(valid[:, None, None], (bs, w, d // 8))), 1)
    grid_mask = jnp.broadcast_to(valid[:, None], (bs, w))
    scale = masked_load(scale_ref.at[rows], grid_mask).astype(jnp.float32)
    zero = masked_load(zero_ref.at[rows], grid_mask).astype(jnp.float32)
    codes = (low | jnp.left_shift(high, jnp.uint8(2))).astype(jnp.float32)
    return codes * scale[:, :, None] + zero[:, :, None]


def _rotated_kernel(
    q_ref,
    kc_ref,
    ks_ref,
    kz_ref,
    vc_ref,
    vs_ref,
    vz_ref,
    valid_ref,
    outs: PartialRefs,
    *,
    window: int,
    fmt: RotatedTokens,
    plan: SplitPlan,
):
    """One program of ``RotatedTokens``. q [G, D] rotated query; keys and values: codes [CH, W, D*bits/8],
    scale and zero [CH, W] per token; valid [CH] int32."""
    groups, d = q_ref.shape
    qs = [q_ref[g, :].astype(jnp.float32) * d**-0.5 for g in range(groups)]

    def load(rows, valid):
        k = _dequant_tokens(kc_ref, ks_ref, kz_ref, rows, valid, fmt.k_bits)
        v = _dequant_tokens(vc_ref, vs_ref, vz_ref, rows, valid, fmt.v_bits)
        return [jnp.sum(qs[g][None, None, :] * k, axis=-1) for g in range(groups)], v  # [BS, W] per head

    online_softmax(load, valid_ref=valid_ref, outs=outs, plan=plan, groups=groups, window=window, d=d)


def _centered_kernel(
    q_ref,
    kc_ref,
    ks_ref,
    kz_ref,
    vc_ref,
    vs_ref,
    vz_ref,
    km_ref,
    start_ref,
    valid_ref,
    freq_ref,
    outs: PartialRefs,
    *,
    window: int,
    fmt: RotatedTokens,
    plan: SplitPlan,
):
    """One program of ``RotatedTokens`` with centered keys. q [G, 2D]: the rotated query, then the query;
    codes as ``_rotated_kernel``'s; km [CH, D] f16 each window's pre-RoPE key mean; start, valid [CH] int32;
    freq [D/2] f32. Logits: ``q_rot . codes + q . RoPE_t(mean)``, the mean re-rotated in-kernel."""
    groups, d = q_ref.shape[0], q_ref.shape[1] // 2
    half, scale = d // 2, d**-0.5
    theta = freq_ref[...].astype(jnp.float32)
    qs = [q_ref[g, pl.ds(0, d)].astype(jnp.float32) * scale for g in range(groups)]
    q1 = [q_ref[g, pl.ds(d, half)].astype(jnp.float32) * scale for g in range(groups)]
    q2 = [q_ref[g, pl.ds(d + half, half)].astype(jnp.float32) * scale for g in range(groups)]

    def load(rows, valid):
        k = _dequant_tokens(kc_ref, ks_ref, kz_ref, rows, valid, fmt.k_bits)
        v = _dequant_tokens(vc_ref, vs_ref, vz_ref, rows, valid, fmt.v_bits)
        mask = jnp.broadcast_to(valid[:, None], (valid.shape[0], half))
        m1 = masked_load(km_ref.at[rows, pl.ds(0, half)], mask).astype(jnp.float32)[
            :, :, None
        ]  # [BS, D/2, 1]
        m2 = masked_load(km_ref.at[rows, pl.ds(half, half)], mask).astype(jnp.float32)[:, :, None]
        cos, sin = window_cos_sin(start_ref[rows], theta, window)  # [BS, D/2, W]
        r1, r2 = m1 * cos - m2 * sin, m2 * cos + m1 * sin
        logits = [
            jnp.sum(qs[g][None, None, :] * k, axis=-1)
            + jnp.sum(q1[g][None, :, None] * r1 + q2[g][None, :, None] * r2, axis=1)
            for g in range(groups)
        ]
        return logits, v

    online_softmax(load, valid_ref=valid_ref, outs=outs, plan=plan, groups=groups, window=window, d=d)


def _rotated_call(
    q: jax.Array,
    q_rot: jax.Array,
    tier: QuantTier,
    inv_freq: jax.Array,
    fmt: RotatedTokens,
    *,
    launch: Launch,
) -> Partial:
    """``tiers.RotatedAttention`` by ``_rotated_kernel``, or ``_centered_kernel`` for centered keys
    (split-K over the slots, as the channel kernel)."""
    codes, slot_start, slot_valid = tier
    b, hkv, _, d = q_rot.shape
    nl, w = codes.k_codes.shape[2], codes.k_codes.shape[3]
    plan = launch.plan(slots=nl, rows=b * hkv, window=w)
    valid = pad_slots(slot_valid.astype(jnp.int32), plan.padded, 0)
    kernel, query, rows, shared = _rotated_kernel, q_rot, [valid], []
    if fmt.center_keys:
        kernel, query = _centered_kernel, jnp.concatenate([q_rot, q], axis=-1)
        rows, shared = [pad_slots(slot_start.astype(jnp.int32), plan.padded, 0), valid], [inv_freq]
    return split_attention(
        functools.partial(kernel, window=w, fmt=fmt, plan=plan),
        q=query,
        slot_inputs=jax.tree.leaves(codes),
        row_inputs=rows,
        shared_inputs=shared,
        slots=nl,
        plan=plan,
        launch=launch,
        default_warps=LEDGER_WARPS,
        name="centered_ledger_attention" if fmt.center_keys else "rotated_ledger_attention",
        out_dim=d,
    )


def _check_ledger_shapes(
    q, codes: QuantizedWindows, slot_start, slot_valid, inv_freq, window, fmt: QuantFormat
) -> None:
    b, hkv, _, d = q.shape
    nl = codes.k_codes.shape[2]
    trailing = fmt.field_shapes(window, d)
    present = lambda x: x is not None
    fields = [f.name for f in dataclasses.fields(codes)]
    if [present(getattr(codes, n)) for n in fields] != [present(getattr(trailing, n)) for n in fields]:
        raise ValueError(f"the ledger's fields do not match the format {fmt.name}")
    expect = {
        name: (getattr(codes, name), (b, hkv, nl, *getattr(trailing, name)))
        for name in fields
        if getattr(codes, name) is not None
    }
    expect |= {
        "slot_start": (slot_start, (b, nl)),
        "slot_valid": (slot_valid, (b, nl)),
        "inv_freq": (inv_freq, (d // 2,)),
    }
    for name, (x, shape) in expect.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if isinstance(fmt, ChannelKeys) and (fmt.bits not in (2, 4) or window % (8 // fmt.bits) or d % 2):
        raise ValueError(f"unsupported bits={fmt.bits}, window={window}, head_dim={d}")
    if isinstance(fmt, ChannelKeys) and fmt.value_bits == 3 and d % 8:
        raise ValueError(f"3-bit values need head_dim % 8 == 0, got {d}")
    if isinstance(fmt, RotatedTokens) and d % 8:
        raise ValueError(f"the rotated ledger format needs head_dim % 8 == 0, got {d}")


@functools.partial(jax.jit, static_argnames=("window", "fmt", "launch"))
def ledger_attention(
    q: jax.Array,
    tier: QuantTier,
    inv_freq: jax.Array,
    *,
    window: int,
    fmt: QuantFormat,
    launch: Launch = DEFAULT_LAUNCH,
) -> Partial:
    """Attention partial of one decode query per head over the packed ledger (Pallas kernel).

    Same arguments and results as ``pallas_kernels.reference.ledger_partial``: q [B, Hkv, G, D]; tier (codes
    [B, Hkv, NL, ...] in format ``fmt``, slot_start [B, NL] int32, slot_valid [B, NL] bool); inv_freq [D/2]
    f32. ``ChannelKeys`` runs ``_ledger_kernel`` (its output rotated back when the values are rotated); ``RotatedTokens`` runs ``_rotated_kernel`` on the
    rotated query (``tiers.rotated_partial``). Returns a ``Partial`` (out [B, Hkv, G, D] unnormalized,
    m, l [B, Hkv, G], mass per slot [B, Hkv, G, NL]), all f32. ``launch``: interpret mode, Triton options,
    the slot split and NaN poisoning (``splitk.Launch``; 8 warps by default).
    """
    codes, slot_start, slot_valid = tier
    _check_ledger_shapes(q, codes, slot_start, slot_valid, inv_freq, window, fmt)
    b, hkv = q.shape[:2]
    nl = codes.k_codes.shape[2]
    if nl == 0:
        return empty_partial(q)
    if isinstance(fmt, RotatedTokens):
        return rotated_partial(q, tier, inv_freq, fmt, functools.partial(_rotated_call, launch=launch))
    plan = launch.plan(slots=nl, rows=b * hkv, window=window)
    part = split_attention(
        functools.partial(_ledger_kernel, window=window, bits=fmt.bits, v_bits=fmt.value_bits, plan=plan),
        q=q,
        slot_inputs=jax.tree.leaves(codes),
        row_inputs=[pad_slots(x.astype(jnp.int32), plan.padded, 0) for x in (slot_start, slot_valid)],
        shared_inputs=[inv_freq.astype(jnp.float32)],
        slots=nl,
        plan=plan,
        launch=launch,
        default_warps=LEDGER_WARPS,
        name="ledger_attention",
    )
    return rotate_values_back(part, fmt)
