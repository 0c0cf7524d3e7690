"""Decode attention over every tier of the cache, ``sink | F | Q (ledger) | local``, for one new query token.

Implementation: **split-K per tier plus a combine** (not one fused kernel). Each tier is one Pallas launch
that writes flash-decoding partials ``(out, m, l)`` and its per-slot ``exp(s - m)`` sums:

- the full-precision tiers (sink, F, local) share one kernel, ``dense_slot_attention``, over keys and
  values laid out as slots of W tokens ``[B, Hkv, N, W, D]`` (F is already that; sink and local are viewed
  as slots of one token, a free reshape), with a validity flag per slot;
- the Q tier is ``pallas_kernels.ledger_attention.ledger_attention`` (packed INT2/INT4 codes);
- ``pallas_kernels.reference.merge_tiers`` merges the four partials into the normalized output and the
  head-mean attention mass per F slot, Q slot, local token and sink token.

Everything stays in the cache's own layout: no tier is concatenated, copied or dequantized into device
memory. ``pallas_kernels.reference.tier_attention_reference`` is the pure-jnp equivalent (tests compare the
two; the window engine runs it with the CPU ledger kernel on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.dispatch import resolve_interpret
from pallas_kernels.ledger_attention import (
    Running,
    SplitPlan,
    combine_splits,
    default_block_slots,
    ledger_attention,
    masked_load,
    online_step,
    pad_slots,
    plan_splits,
    running_init,
    split_call,
    write_running,
)
from pallas_kernels.quant import QuantFormat
from pallas_kernels.reference import DenseTier, Partial, QuantTier, TierAttention, empty_partial, merge_tiers

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
    tier: DenseTier,
    *,
    interpret: bool | None = None,
    block_slots: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    poison: bool = False,
) -> Partial:
    """Attention partial of one decode query per head over full-precision slots (Pallas kernel).

    q: [B, Hkv, G, D] post-RoPE query (unscaled); tier: k, v [B, Hkv, N, W, D] (or [B, Hkv, N, D] tokens)
    post-RoPE keys and values (any float dtype), valid [B, N] bool per slot. Returns a ``Partial`` (mass
    per slot [B, Hkv, G, N]) in float32, as ``pallas_kernels.reference.slot_partial``.
    """
    k, v, slot_valid = tier
    if k.ndim == 4:  # single tokens: slots of one token (a free reshape)
        k, v = k[:, :, :, None], v[:, :, :, None]
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


# ----------------------------------------------------------------------------------------------------------
# all tiers


def _check_tiers(q, sink: DenseTier, fp: DenseTier, ledger: QuantTier, local: DenseTier) -> None:
    b, hkv, _, d = q.shape
    for name, tier in (("sink", sink), ("fp", fp), ("local", local)):
        if tier.k.shape[:2] != (b, hkv) or tier.k.shape[-1] != d or tier.v.shape != tier.k.shape:
            raise ValueError(f"{name}: k {tier.k.shape}, v {tier.v.shape} do not match q {q.shape}")
        if tier.valid.shape != (b, tier.k.shape[2]):
            raise ValueError(f"{name}: valid {tier.valid.shape} is not [B, N] = {(b, tier.k.shape[2])}")
    kc = ledger.codes.k_codes
    if kc.shape[:2] != (b, hkv):  # the rest is the ledger kernel's check (it knows the format)
        raise ValueError(f"ledger codes {kc.shape} do not match q {q.shape}")
    if not sink.k.shape[2] + fp.k.shape[2] + kc.shape[2] + local.k.shape[2]:
        raise ValueError("every tier is empty")


@functools.partial(
    jax.jit,
    static_argnames=("window", "fmt", "interpret", "block_slots", "num_splits", "num_warps", "poison"),
)
def fused_partials(
    q: jax.Array,
    sink: DenseTier,
    fp: DenseTier,
    ledger: QuantTier,
    local: DenseTier,
    inv_freq: jax.Array,
    *,
    window: int,
    fmt: QuantFormat,
    interpret: bool | None = None,
    block_slots: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    poison: bool = False,
) -> list[Partial]:
    """The (sink, F, Q, local) partials of ``fused_attention`` (its arguments), one Pallas launch per tier,
    before ``merge_tiers``: per (row, KV head), so they run per shard of a mesh as they are
    (``qevict_jax.core.sharding.on_shards``)."""
    _check_tiers(q, sink, fp, ledger, local)
    opts = dict(interpret=interpret, poison=poison)
    if num_warps is not None:
        opts["num_warps"] = num_warps
    split = dict(block_slots=block_slots, num_splits=num_splits)
    return [
        dense_slot_attention(q, sink, **opts),
        dense_slot_attention(q, fp, **opts),
        ledger_attention(q, ledger, inv_freq, window=window, fmt=fmt, **split, **opts),
        dense_slot_attention(q, local, **opts),
    ]


@functools.partial(
    jax.jit,
    static_argnames=("window", "fmt", "interpret", "block_slots", "num_splits", "num_warps", "poison"),
)
def fused_attention(
    q: jax.Array,
    sink: DenseTier,
    fp: DenseTier,
    ledger: QuantTier,
    local: DenseTier,
    inv_freq: jax.Array,
    *,
    window: int,
    fmt: QuantFormat,
    interpret: bool | None = None,
    block_slots: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    poison: bool = False,
) -> TierAttention:
    """Decode attention of q over ``sink | F | Q | local`` (Pallas kernels per tier + a jnp combine).

    q: [B, Hkv, G, D] post-RoPE query of the new token (unscaled). sink: [B, Hkv, S, D] tokens; fp:
    [B, Hkv, NF, W, D] slots (valid per slot); ledger: the Q tier, as in ``ledger_attention``; local:
    [B, Hkv, NR, D] tokens. Same arguments as ``pallas_kernels.reference.tier_attention_reference``.
    ``block_slots`` / ``num_splits`` apply to the ledger kernel (dense tiers use their defaults);
    ``num_warps`` (default: each kernel's own) to every kernel.
    Returns ``TierAttention`` (normalized output and head-mean masses per tier): ``merge_tiers`` of
    ``fused_partials``.
    """
    opts = dict(interpret=interpret, block_slots=block_slots, num_splits=num_splits, num_warps=num_warps)
    parts = fused_partials(q, sink, fp, ledger, local, inv_freq, window=window, fmt=fmt, poison=poison, **opts)
    return merge_tiers(parts)
