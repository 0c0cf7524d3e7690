"""Decode attention over every tier of the cache, ``sink | F | Q (ledger) | local``, for one new query token.

Implementation: **split-K per tier plus a combine** (not one fused kernel). Each tier is one Pallas launch
that writes flash-decoding partials ``(out, m, l)`` and its per-slot ``exp(s - m)`` sums:

- the full-precision tiers (sink, F, local) share one kernel, ``dense_slot_attention``, over keys and
  values laid out as slots of W tokens ``[B, Hkv, N, W, D]`` (F is already that; sink and local are viewed
  as slots of one token, a free reshape), with a validity flag per slot;
- the Q tier is ``pallas_kernels.ledger_attention.ledger_attention`` (packed INT2/INT4 codes);
- ``pallas_kernels.reference.combine_partials`` merges the four partials into the normalized output and
  gives each tier's weight, from which the normalized, head-mean attention mass per F slot, Q slot, local
  token and sink token follows.

Everything stays in the cache's own layout: no tier is concatenated, copied or dequantized into device
memory. ``fused_attention_reference`` is the pure-jnp equivalent (tests compare the two).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.attention import NEG_INF
from pallas_kernels.dispatch import resolve_interpret
from pallas_kernels.ledger_attention import (
    Running,
    SplitPlan,
    combine_splits,
    default_block_slots,
    empty_partial,
    ledger_attention,
    masked_load,
    online_step,
    pad_slots,
    plan_splits,
    running_init,
    split_call,
    write_running,
)
from pallas_kernels.reference import combine_partials, ledger_attention_reference

Partial4 = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # (out, m, l, slot_mass [B, Hkv, G, N])


class TierAttention(NamedTuple):
    """Result of one decode-attention pass over all tiers (all float32).

    out: [B, Hkv, G, D] normalized attention output.
    sink_mass [B, S], fp_mass [B, NF], q_mass [B, NL], local_mass [B, NR]: attention probability mass per
    sink token, F slot, Q (ledger) slot and local token, averaged over all H = Hkv * G query heads (each
    head's probabilities sum to 1 over all tiers, so the masses of a row sum to 1 when any key is valid).
    """

    out: jax.Array
    sink_mass: jax.Array
    fp_mass: jax.Array
    q_mass: jax.Array
    local_mass: jax.Array


# ----------------------------------------------------------------------------------------------------------
# full-precision tiers: one kernel over slots of W tokens


def _dense_kernel(
    q_ref,  # [G, D]
    k_ref,  # [CH, W, D]
    v_ref,  # [CH, W, D]
    valid_ref,  # [CH] int32
    out_ref,  # [G, D]
    m_ref,  # [G]
    l_ref,  # [G]
    mass_ref,  # [G, CH]
    cm_ref,  # [G, C]
    *,
    plan: SplitPlan,
):
    groups, d = q_ref.shape
    _, w, _ = k_ref.shape
    bs = plan.block
    qs = [q_ref[g, :].astype(jnp.float32) * d**-0.5 for g in range(groups)]

    def step(i, state: Running) -> Running:
        rows = pl.ds(i * bs, bs)
        valid = valid_ref[rows] != 0  # [BS]
        mask = jnp.broadcast_to(valid[:, None, None], (bs, w, d))
        k = masked_load(k_ref.at[rows], mask).astype(jnp.float32)  # [BS, W, D]
        v = masked_load(v_ref.at[rows], mask).astype(jnp.float32)
        logits = [jnp.sum(qs[g][None, None, :] * k, axis=2) for g in range(groups)]  # [BS, W]
        tok_valid = jnp.broadcast_to(valid[:, None], (bs, w))
        return online_step(state, logits, tok_valid, v, i, bs, mass_ref, cm_ref)

    state = jax.lax.fori_loop(0, plan.chunks, step, running_init(groups, d))
    write_running(state, out_ref, m_ref, l_ref)


@functools.partial(
    jax.jit,
    static_argnames=("interpret", "block_slots", "num_splits", "num_warps", "num_stages", "poison"),
)
def dense_slot_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_valid: jax.Array,
    *,
    interpret: bool | None = None,
    block_slots: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    poison: bool = False,
) -> Partial4:
    """Attention partial of one decode query per head over full-precision slots (Pallas kernel).

    q: [B, Hkv, G, D] post-RoPE query (unscaled); k, v: [B, Hkv, N, W, D] post-RoPE keys and values (any
    float dtype); slot_valid: [B, N] bool. Returns (out [B, Hkv, G, D] unnormalized, m [B, Hkv, G],
    l [B, Hkv, G], slot_mass [B, Hkv, G, N]) in float32, as ``ledger_attention``.
    """
    b, hkv, g, d = q.shape
    n, w = k.shape[2], k.shape[3]
    if k.shape != (b, hkv, n, w, d) or v.shape != k.shape or slot_valid.shape != (b, n):
        raise ValueError(f"shapes q {q.shape}, k {k.shape}, v {v.shape}, slot_valid {slot_valid.shape}")
    if n == 0:
        return empty_partial(q)
    plan = plan_splits(n, b * hkv, block_slots or default_block_slots(w), num_splits)
    ch = plan.per_program
    valid = pad_slots(slot_valid.astype(jnp.int32), plan.padded, 0)
    in_specs = [
        pl.BlockSpec((None, None, g, d), lambda i, j, s: (i, j, 0, 0)),
        pl.BlockSpec((None, None, ch, w, d), lambda i, j, s: (i, j, s, 0, 0)),
        pl.BlockSpec((None, None, ch, w, d), lambda i, j, s: (i, j, s, 0, 0)),
        pl.BlockSpec((None, ch), lambda i, j, s: (i, s)),
    ]
    parts = split_call(
        functools.partial(_dense_kernel, plan=plan),
        (q, k, v, valid),
        in_specs,
        q,
        plan,
        interpret=resolve_interpret(interpret),
        num_warps=num_warps,
        num_stages=num_stages,
        poison=poison,
        name="dense_slot_attention",
    )
    return combine_splits(*parts, n)


def dense_slot_attention_reference(
    q: jax.Array, k: jax.Array, v: jax.Array, slot_valid: jax.Array
) -> Partial4:
    """Pure-jnp ``dense_slot_attention``: q [B, Hkv, G, D], k, v [B, Hkv, N, W, D], slot_valid [B, N]."""
    d = q.shape[-1]
    if k.shape[2] == 0:
        return empty_partial(q)
    qs = q.astype(jnp.float32) * d**-0.5
    s = jnp.einsum("bkgd,bkntd->bkgnt", qs, k.astype(jnp.float32))
    mask = slot_valid[:, None, None, :, None]
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=(-1, -2))
    p = jnp.where(mask, jnp.exp(s - m[..., None, None]), 0.0)
    slot_mass = p.sum(-1)
    v32 = jnp.where(slot_valid[:, None, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bkgnt,bkntd->bkgd", p, v32)
    return out, m, slot_mass.sum(-1), slot_mass


# ----------------------------------------------------------------------------------------------------------
# all tiers


def _as_slots(x: jax.Array) -> jax.Array:
    """[B, Hkv, T, D] -> [B, Hkv, T, 1, D] (tokens as slots of one token; a free reshape)."""
    return x[:, :, :, None, :]


def _merge_tiers(tiers: list[Partial4]) -> TierAttention:
    """Combine (sink, F, Q, local) partials into the normalized output and head-mean masses."""
    live = [i for i, t in enumerate(tiers) if t[3].shape[-1] > 0]
    out, weights = combine_partials([tiers[i][:3] for i in live])
    masses = [jnp.zeros(t[3].shape[:1] + t[3].shape[3:], jnp.float32) for t in tiers]
    for i, wt in zip(live, weights, strict=True):
        masses[i] = jnp.mean(tiers[i][3] * wt[..., None], axis=(1, 2))
    return TierAttention(out, *masses)


def _check_tiers(q, sink_k, fp_k, kc, local_k, local_pos) -> None:
    b, hkv, _, d = q.shape
    if sink_k.shape[:2] != (b, hkv) or sink_k.shape[-1] != d:
        raise ValueError(f"sink_k {sink_k.shape} does not match q {q.shape}")
    if fp_k.shape[:2] != (b, hkv) or fp_k.shape[-1] != d:
        raise ValueError(f"fp_k {fp_k.shape} does not match q {q.shape}")
    if kc.shape[:2] != (b, hkv) or kc.shape[3] != d:
        raise ValueError(f"kc {kc.shape} does not match q {q.shape}")
    if local_k.shape[:2] != (b, hkv) or local_pos.shape != (b, local_k.shape[2]):
        raise ValueError(f"local_k {local_k.shape} / local_pos {local_pos.shape} do not match q {q.shape}")
    if not sink_k.shape[2] + fp_k.shape[2] + kc.shape[2] + local_k.shape[2]:
        raise ValueError("every tier is empty")


@functools.partial(
    jax.jit,
    static_argnames=("window", "bits", "interpret", "block_slots", "num_splits", "num_warps", "poison"),
)
def fused_attention(
    q: jax.Array,
    sink_k: jax.Array,
    sink_v: jax.Array,
    sink_valid: jax.Array,
    fp_k: jax.Array,
    fp_v: jax.Array,
    fp_valid: jax.Array,
    kc: jax.Array,
    ks: jax.Array,
    kz: jax.Array,
    vc: jax.Array,
    vs: jax.Array,
    vz: jax.Array,
    slot_start: jax.Array,
    slot_valid: jax.Array,
    inv_freq: jax.Array,
    local_k: jax.Array,
    local_v: jax.Array,
    local_pos: jax.Array,
    *,
    window: int,
    bits: int,
    interpret: bool | None = None,
    block_slots: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    poison: bool = False,
) -> TierAttention:
    """Decode attention of q over ``sink | F | Q | local`` (Pallas kernels per tier + a jnp combine).

    q: [B, Hkv, G, D] post-RoPE query of the new token (unscaled).
    sink_k, sink_v: [B, Hkv, S, D] post-RoPE; sink_valid: [B, S] bool.
    fp_k, fp_v: [B, Hkv, NF, W, D] post-RoPE; fp_valid: [B, NF] bool.
    kc, ks, kz, vc, vs, vz, slot_start, slot_valid, inv_freq: the ledger, as in ``ledger_attention``.
    local_k, local_v: [B, Hkv, NR, D] post-RoPE; local_pos: [B, NR] int32, -1 = empty.
    ``block_slots`` / ``num_splits`` apply to the ledger kernel (dense tiers use their defaults);
    ``num_warps`` (default: each kernel's own) to every kernel.
    Returns ``TierAttention`` (normalized output and head-mean masses per tier).
    """
    _check_tiers(q, sink_k, fp_k, kc, local_k, local_pos)
    opts = dict(interpret=interpret, poison=poison)
    if num_warps is not None:
        opts["num_warps"] = num_warps
    tiers = [
        dense_slot_attention(q, _as_slots(sink_k), _as_slots(sink_v), sink_valid, **opts),
        dense_slot_attention(q, fp_k, fp_v, fp_valid, **opts),
        ledger_attention(
            q,
            kc,
            ks,
            kz,
            vc,
            vs,
            vz,
            slot_start,
            slot_valid,
            inv_freq,
            window=window,
            bits=bits,
            block_slots=block_slots,
            num_splits=num_splits,
            **opts,
        ),
        dense_slot_attention(q, _as_slots(local_k), _as_slots(local_v), local_pos >= 0, **opts),
    ]
    return _merge_tiers(tiers)


@functools.partial(jax.jit, static_argnames=("window", "bits"))
def fused_attention_reference(
    q: jax.Array,
    sink_k: jax.Array,
    sink_v: jax.Array,
    sink_valid: jax.Array,
    fp_k: jax.Array,
    fp_v: jax.Array,
    fp_valid: jax.Array,
    kc: jax.Array,
    ks: jax.Array,
    kz: jax.Array,
    vc: jax.Array,
    vs: jax.Array,
    vz: jax.Array,
    slot_start: jax.Array,
    slot_valid: jax.Array,
    inv_freq: jax.Array,
    local_k: jax.Array,
    local_v: jax.Array,
    local_pos: jax.Array,
    *,
    window: int,
    bits: int,
) -> TierAttention:
    """Pure-jnp ``fused_attention`` (same arguments, without the kernel options)."""
    _check_tiers(q, sink_k, fp_k, kc, local_k, local_pos)
    if kc.shape[2]:
        q_tier = ledger_attention_reference(
            q, kc, ks, kz, vc, vs, vz, slot_start, slot_valid, inv_freq, window=window, bits=bits
        )
    else:
        q_tier = empty_partial(q)
    tiers = [
        dense_slot_attention_reference(q, _as_slots(sink_k), _as_slots(sink_v), sink_valid),
        dense_slot_attention_reference(q, fp_k, fp_v, fp_valid),
        q_tier,
        dense_slot_attention_reference(q, _as_slots(local_k), _as_slots(local_v), local_pos >= 0),
    ]
    return _merge_tiers(tiers)
