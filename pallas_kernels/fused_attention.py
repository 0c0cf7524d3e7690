"""Decode attention over every tier of the cache, ``sink | F | Q (ledger) | ring``, for one new query token.

Implementation: **split-K per tier plus a combine** (not one fused kernel). Each tier is one Pallas launch
that writes flash-decoding partials ``(out, m, l)`` and its per-slot ``exp(s - m)`` sums:

- the full-precision tiers (sink, F, ring) share one kernel, ``dense_slot_attention``, over keys and
  values laid out as slots of W tokens ``[B, Hkv, N, W, D]`` (F is already that; sink and ring are viewed
  as slots of one token, a free reshape), with a validity flag per slot;
- the Q tier is ``pallas_kernels.ledger_attention.ledger_attention`` (packed INT2/INT4 codes);
- ``pallas_kernels.tiers.merge_tiers`` merges the four partials into the normalized output and the
  head-mean attention mass per F slot, Q slot, ring token and sink token.

Everything stays in the cache's own layout: no tier is concatenated, copied or dequantized into device
memory. ``fused_partials()`` is ``pallas_kernels.tiers.tier_partials`` with these kernels in place of
its jnp partials (tests compare the two; the window engine runs the reference with the CPU ledger kernel on a
CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import splitk
from pallas_kernels.ledger_attention import ledger_attention
from pallas_kernels.splitk import DEFAULT_LAUNCH, Launch
from pallas_kernels.tiers import DenseTier, Partial, empty_partial, tier_partials

DENSE_WARPS = 4  # Triton warps of the dense kernel unless the launch names some


def _dense_kernel(q_ref, k_ref, v_ref, valid_ref, outs: splitk.PartialRefs, *, plan: splitk.SplitPlan):
    """One program: q [G, D]; k, v [CH, W, D]; valid [CH] int32."""
    groups, d = q_ref.shape
    _, w, _ = k_ref.shape
    qs = [q_ref[g, :].astype(jnp.float32) * d**-0.5 for g in range(groups)]

    def load(rows, valid):
        mask = jnp.broadcast_to(valid[:, None, None], (plan.block, w, d))
        k = splitk.masked_load(k_ref.at[rows], mask).astype(jnp.float32)  # [BS, W, D]
        v = splitk.masked_load(v_ref.at[rows], mask).astype(jnp.float32)
        return [jnp.sum(qs[g][None, None, :] * k, axis=2) for g in range(groups)], v  # [BS, W] per head

    splitk.online_softmax(load, valid_ref=valid_ref, outs=outs, plan=plan, groups=groups, window=w, d=d)


@functools.partial(jax.jit, static_argnames=("launch",))
def dense_slot_attention(q: jax.Array, tier: DenseTier, *, launch: Launch = DEFAULT_LAUNCH) -> Partial:
    """Attention partial of one decode query per head over full-precision slots (Pallas kernel).

    q: [B, Hkv, G, D] post-RoPE query (unscaled); tier: k, v [B, Hkv, N, W, D] (or [B, Hkv, N, D] tokens)
    post-RoPE keys and values (any float dtype), valid [B, N] bool per slot. Returns a ``Partial`` (mass
    per slot [B, Hkv, G, N]) in float32, as ``pallas_kernels.tiers.slot_partial``. ``launch``: as
    ``ledger_attention``'s (4 warps by default).
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
    plan = launch.plan(slots=n, rows=b * hkv, window=w)
    return splitk.split_attention(
        functools.partial(_dense_kernel, plan=plan),
        q=q,
        slot_inputs=[k, v],
        row_inputs=[splitk.pad_slots(slot_valid.astype(jnp.int32), plan.padded, 0)],
        slots=n,
        plan=plan,
        launch=launch,
        default_warps=DENSE_WARPS,
        name="dense_slot_attention",
    )


def fused_partials(*, launch: Launch = DEFAULT_LAUNCH) -> Callable[..., list[Partial]]:
    """``tiers.tier_partials`` with the Pallas kernels in place of its jnp partials (the same arguments
    and result): one Pallas launch per tier, the (sink, F, Q, ring) partials that ``tiers.merge_tiers``
    turns into the attention. The slot split of ``launch`` applies to the ledger kernel (the dense tiers
    use their defaults); its other options to every kernel."""
    dense = dataclasses.replace(launch, block_slots=None, num_splits=None)
    return functools.partial(
        tier_partials,
        slot_attention=functools.partial(dense_slot_attention, launch=dense),
        ledger_attention=functools.partial(ledger_attention, launch=launch),
    )
