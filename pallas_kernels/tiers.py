"""Decode attention over the tiered cache as the engines run it: the tier types, the flash-decoding partials
of the full-precision tiers, and their merge.

Decode attention over the tiered cache is computed per tier as a *partial* (flash-decoding style): for one
query per head, ``out = sum_j exp(s_j - m) v_j`` (unnormalized), ``m = max_j s_j`` and
``l = sum_j exp(s_j - m)`` over the tier's valid keys, plus per-key (or per-slot) sums of
``exp(s_j - m)`` for scoring. Partials of all tiers are merged by ``combine_partials``.
A tier with no valid key has ``m = NEG_INF`` and ``l = 0``.
Logits are ``s_j = (q . k_j) / sqrt(D)``.

The Q tier's partial comes from a ``LedgerAttention``: the jnp reference (``pallas_kernels.reference``),
the CPU kernel (``pallas_kernels.cpu_ledger``) or the Pallas kernel (``pallas_kernels.ledger_attention``),
picked by ``pallas_kernels.dispatch``; the dense tiers' from ``slot_partial`` or the Pallas kernel
(``pallas_kernels.fused_attention``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from models.attention import NEG_INF
from pallas_kernels.formats import ChannelKeys, QuantFormat, RotatedTokens, channel_rotation
from pallas_kernels.quant import QuantizedWindows


class Partial(NamedTuple):
    """Flash-decoding partial of attention over one tier (all float32; leading query axes ``Q``, e.g.
    [B, Hkv, G] or [B, Hkv, G, T]).

    out: [Q..., D] unnormalized ``sum_j exp(s_j - m) v_j``; m: [Q...] max logit (NEG_INF without a valid
    key); l: [Q...] ``sum_j exp(s_j - m)``; mass: [Q..., N] the same sums per key or per slot of W keys.
    """

    out: jax.Array
    m: jax.Array
    l: jax.Array  # noqa: E741
    mass: jax.Array


class DenseTier(NamedTuple):
    """A full-precision tier of the cache as one argument: k, v [B, Hkv, N, W, D] (slots of W tokens) or
    [B, Hkv, N, D] (single tokens), post-RoPE; valid [B, N] per slot, or [B, N, W] per token."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array


class QuantTier(NamedTuple):
    """The Q tier as one argument: codes, the ledger's ``QuantizedWindows`` [B, Hkv, NL, ...] in its format;
    slot_start [B, NL] int32 position of each slot's first token (the "channel" format's pre-RoPE keys are
    re-rotated there); slot_valid [B, NL] bool, the slots that take part (active Q windows)."""

    codes: QuantizedWindows
    slot_start: jax.Array
    slot_valid: jax.Array


class TierAttention(NamedTuple):
    """Result of one decode-attention pass over all tiers ``sink | F | Q | ring`` (all float32).

    out: [B, Hkv, G, D] normalized attention output.
    sink_mass [B, S], f_mass [B, NF], q_mass [B, NL], ring_mass [B, NR]: attention probability mass per
    sink token, F slot, Q (ledger) slot and ring token, averaged over all H = Hkv * G query heads (each
    head's probabilities sum to 1 over all tiers, so the masses of a row sum to 1 when any key is valid);
    or, from ``merge_tiers(..., head_mean=False)``, per KV head (averaged over its G query heads):
    [B, Hkv, S], [B, Hkv, NF], ...
    """

    out: jax.Array
    sink_mass: jax.Array
    f_mass: jax.Array
    q_mass: jax.Array
    ring_mass: jax.Array


LedgerAttention = Callable[..., Partial]
"""``(q, tier: QuantTier, inv_freq, *, window, fmt) -> Partial`` (``reference.ledger_partial``, the CPU kernel
or the Pallas kernel)."""


RotatedAttention = Callable[[jax.Array, jax.Array, QuantTier, jax.Array, RotatedTokens], Partial]
"""``(q, q_rot, tier, inv_freq, fmt) -> Partial`` with the output in the rotated basis: the part of a ledger
attention that reads a ``RotatedTokens`` ledger (``rotated_partial`` turns it into a ``LedgerAttention``'s
result). q [B, Hkv, G, D] f32 is the query, q_rot = q R; the logits are ``q_rot . codes`` (plus
``q . RoPE_t(mean)`` in the centered format)."""


SlotAttention = Callable[[jax.Array, DenseTier], Partial]


def empty_partial(q: jax.Array, n: int = 0) -> Partial:
    """The partial of a tier without keys for queries q [Q..., D]: out 0, m NEG_INF, l 0, mass [Q..., n]."""
    lead, d = q.shape[:-1], q.shape[-1]
    return Partial(
        jnp.zeros((*lead, d), jnp.float32),
        jnp.full(lead, NEG_INF, jnp.float32),
        jnp.zeros(lead, jnp.float32),
        jnp.zeros((*lead, n), jnp.float32),
    )


def dense_partial(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> Partial:
    """Attention partial of queries q [B, Hkv, G, T, D] over full-precision keys and values.

    k, v: [B, Hkv, N, D] (each KV head its own keys) or [B, N, D] (one set shared by every head; a head's
    own keys are picked by ``mask``). mask: broadcastable to [B, Hkv, G, T, N]. mass: per key.
    """
    n, d = k.shape[-2], q.shape[-1]
    if n == 0:
        return empty_partial(q)
    qs = q.astype(jnp.float32) * d**-0.5
    keys = "bnd" if k.ndim == 3 else "bknd"
    s = jnp.einsum(f"bkgtd,{keys}->bkgtn", qs, k.astype(jnp.float32))
    s = jnp.where(mask, s, NEG_INF)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    out = jnp.einsum(f"bkgtn,{keys}->bkgtd", p, v.astype(jnp.float32))
    return Partial(out, m, p.sum(-1), p)


def slot_partial(q: jax.Array, tier: DenseTier) -> Partial:
    """Attention partial of one decode query per head q [B, Hkv, G, D] over a full-precision tier; mass per
    slot [B, Hkv, G, N]."""
    k, v, valid = tier
    if k.ndim == 4:  # single tokens: slots of one token (a free reshape)
        k, v = k[:, :, :, None], v[:, :, :, None]
    b, hkv, n, w, d = k.shape
    tok = valid if valid.ndim == 3 else jnp.broadcast_to(valid[..., None], (b, n, w))
    part = dense_partial(
        q[:, :, :, None],
        k.reshape(b, hkv, n * w, d),
        jnp.where(tok[:, None, :, :, None], v, 0).reshape(b, hkv, n * w, d),
        tok.reshape(b, 1, 1, 1, n * w),
    )
    mass = part.mass[:, :, :, 0].reshape(b, hkv, q.shape[2], n, w).sum(-1)
    return Partial(part.out[:, :, :, 0], part.m[..., 0], part.l[..., 0], mass)


def rotated_partial(
    q: jax.Array, tier: QuantTier, inv_freq: jax.Array, fmt: RotatedTokens, attend: RotatedAttention
) -> Partial:
    """Attention partial of q [B, Hkv, G, D] over a ``RotatedTokens`` ledger: ``attend`` reads the codes with
    the query rotated once (``q R``); the value output is rotated back once (``out R^T``)."""
    r = jnp.asarray(channel_rotation(q.shape[-1]))
    q = q.astype(jnp.float32)
    part = attend(q, q @ r, tier, inv_freq.astype(jnp.float32), fmt)
    return part._replace(out=part.out @ r.T)


def rotate_values_back(part: Partial, fmt: ChannelKeys) -> Partial:
    """A "channel"-keys partial whose values were read in the stored basis: out R^T when the format rotates
    its values (``ChannelKeys.rotate_values``), else unchanged."""
    if not fmt.rotate_values:
        return part
    return part._replace(out=part.out @ jnp.asarray(channel_rotation(part.out.shape[-1])).T)


def _scales(partials: Sequence[Partial]) -> tuple[list[jax.Array], jax.Array]:
    """(per tier exp(m_t - M), 1 / L) over the tiers' running maxima M and total denominator L."""
    big_m = partials[0].m
    for p in partials[1:]:
        big_m = jnp.maximum(big_m, p.m)
    scales = [jnp.exp(p.m - big_m) for p in partials]
    total_l = sum(sc * p.l for sc, p in zip(scales, partials, strict=True))
    return scales, jnp.where(total_l > 0, 1.0 / jnp.where(total_l > 0, total_l, 1.0), 0.0)


def partial_weights(partials: Sequence[Partial]) -> list[jax.Array]:
    """Per tier [Q...] = exp(m_t - M) / L: a tier's normalized attention probabilities are its ``mass``
    times its weight."""
    scales, inv = _scales(partials)
    return [sc * inv for sc in scales]


def combine_partials(partials: Sequence[Partial]) -> tuple[jax.Array, list[jax.Array]]:
    """Merge per-tier partials into the softmax attention output.

    Returns (out [Q..., D] f32 normalized, weights: ``partial_weights``).
    """
    scales, inv = _scales(partials)
    out = sum(sc[..., None] * p.out for sc, p in zip(scales, partials, strict=True)) * inv[..., None]
    return out, [sc * inv for sc in scales]


def merge_tiers(
    tiers: Sequence[Partial],
    *,
    head_mean: bool = True,
    q_logit_bias: float = 0.0,
    biased_mass: bool = True,
    q_bias_gate: float | None = None,
) -> TierAttention:
    """Combine the (sink, F, Q, ring) partials of one decode query per head into the normalized output and
    the masses: averaged over every query head, or (``head_mean=False``) per KV head over its group only,
    which needs nothing from another KV head's device on a mesh.

    ``q_logit_bias`` (<= 0) is added to every Q-tier logit: the Q tier's share of the softmax is scaled by
    ``exp(q_logit_bias)`` before normalization, so a low-bit window sways the output only when its keys
    match clearly better than the full-precision ones. Shifting the Q partial's max logit is exactly that
    (its ``out`` and ``l`` are relative to the max), so the kernels' partials need no change. The masses are
    those of the biased softmax, or (``biased_mass`` False) of the softmax without the bias.

    ``q_bias_gate`` (a margin g >= 0) keeps the bias only for the query heads whose F partial's max logit
    exceeds the Q partial's by more than g; a head whose best historical key is in Q reads Q unbiased. Each
    head's choice uses its own partials, so it needs nothing from another device on a mesh.
    """
    live = [i for i, t in enumerate(tiers) if t.mass.shape[-1] > 0]
    bias = q_logit_bias
    if q_logit_bias and q_bias_gate is not None:  # [B, Hkv, G]: F's best logit leads Q's by more than g
        bias = jnp.where(tiers[1].m - tiers[2].m > q_bias_gate, q_logit_bias, 0.0)
    read = [t._replace(m=t.m + bias) if i == 2 else t for i, t in enumerate(tiers)] if q_logit_bias else tiers
    out, weights = combine_partials([read[i] for i in live])
    if q_logit_bias and not biased_mass:  # the masses of the softmax without the discount
        weights = partial_weights([tiers[i] for i in live])
    axes = (1, 2) if head_mean else (2,)
    kept = (0,) if head_mean else (0, 1)
    masses = [jnp.zeros([t.mass.shape[a] for a in kept] + list(t.mass.shape[3:]), jnp.float32) for t in tiers]
    for i, wt in zip(live, weights, strict=True):
        masses[i] = jnp.mean(tiers[i].mass * wt[..., None], axis=axes)
    return TierAttention(out, *masses)


def _check_tiers(q: jax.Array, sink: DenseTier, f: DenseTier, ledger: QuantTier, ring: DenseTier) -> None:
    b, hkv, _, d = q.shape
    for name, tier in (("sink", sink), ("f", f), ("ring", ring)):
        if tier.k.shape[:2] != (b, hkv) or tier.k.shape[-1] != d or tier.v.shape != tier.k.shape:
            raise ValueError(f"{name}: k {tier.k.shape}, v {tier.v.shape} do not match q {q.shape}")
        if tier.valid.shape[:2] != (b, tier.k.shape[2]):
            raise ValueError(f"{name}: valid {tier.valid.shape} is not [B, N] = {(b, tier.k.shape[2])}")
    kc = ledger.codes.k_codes
    if kc.shape[:2] != (b, hkv):  # the rest is the ledger attention's check (it knows the format)
        raise ValueError(f"ledger codes {kc.shape} do not match q {q.shape}")
    if not sink.k.shape[2] + f.k.shape[2] + kc.shape[2] + ring.k.shape[2]:
        raise ValueError("every tier is empty")


def tier_partials(
    q: jax.Array,
    sink: DenseTier,
    f: DenseTier,
    ledger: QuantTier,
    ring: DenseTier,
    inv_freq: jax.Array,
    *,
    window: int,
    fmt: QuantFormat,
    ledger_attention: LedgerAttention,
    slot_attention: SlotAttention = slot_partial,
) -> list[Partial]:
    """The (sink, F, Q, ring) partials of one query per head q [B, Hkv, G, D] (post-RoPE, unscaled):
    ``merge_tiers`` of them is decode attention over ``sink | F | Q | ring``. Every partial is per (row, KV
    head), so a shard of rows and KV heads computes its own from its own tiers
    (``qevict_jax.core.sharding.on_shards``).

    sink: [B, Hkv, S, D] tokens; f: [B, Hkv, NF, W, D] slots (valid per slot, or per token with a sliding
    window); ledger: the Q tier; ring: [B, Hkv, NR, D] tokens. ``ledger_attention`` computes the Q tier's
    partial (``pallas_kernels.dispatch.ledger_attention``, the jnp ``reference.ledger_partial`` or a
    kernel) and ``slot_attention`` the dense tiers' (``slot_partial`` by default; the Pallas kernels in
    ``pallas_kernels.fused_attention.fused_partials``).
    """
    _check_tiers(q, sink, f, ledger, ring)
    parts = [
        slot_attention(q, sink),
        slot_attention(q, f),
        ledger_attention(q, ledger, inv_freq, window=window, fmt=fmt),
        slot_attention(q, ring),
    ]
    lead = q.shape[:3]  # [B, Hkv, G]
    counts = (sink.k.shape[2], f.k.shape[2], ledger.codes.k_codes.shape[2], ring.k.shape[2])
    chex.assert_shape([p.mass for p in parts], [(*lead, n) for n in counts])
    return parts
