"""The window engine (QEvict, R1-R4, StreamingLLM, KIVI): prefill compression into the F and Q tiers and
decode attention over sink | F | Q | ring (DESIGN §5-§6); routing between the tiers is ``qevict_jax.routing``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import NEG_INF
from models.model import LayerContext
from pallas_kernels.dispatch import ledger_attention
from pallas_kernels.fused_attention import fused_attention
from pallas_kernels.reference import combine_partials
from qevict_jax.cache import (
    TieredCache,
    fill_sink_and_ring,
    ring_positions,
    ring_valid,
    shared_prompt_attention,
    window_mask,
    write_token,
)
from qevict_jax.routing import LEDGER_FIELDS, apply_plan, plan_for_row
from qevict_jax.scoring import Ranking, prompt_windows


def dense_partial(
    q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Attention partial of q [B, Hkv, G, D] over k, v [B, Hkv, N, D] with valid [B, N] (or [B, Hkv, G, N]).

    Returns (out [B, Hkv, G, D], m [B, Hkv, G], l [B, Hkv, G], per-key exp sums [B, Hkv, G, N]), all f32.
    """
    b, hkv, g, d = q.shape
    n = k.shape[2]
    if n == 0:
        zeros = jnp.zeros((b, hkv, g), jnp.float32)
        return jnp.zeros((b, hkv, g, d), jnp.float32), zeros + NEG_INF, zeros, jnp.zeros((b, hkv, g, 0))
    mask = valid[:, None, None, :] if valid.ndim == 2 else valid
    s = jnp.einsum("bkgd,bknd->bkgn", q.astype(jnp.float32) * d**-0.5, k.astype(jnp.float32))
    s = jnp.where(mask, s, NEG_INF)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    return jnp.einsum("bkgn,bknd->bkgd", p, v.astype(jnp.float32)), m, p.sum(-1), p


# ---------------------------------------------------------------------------------------------- prefill


def prefill_layer(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: TieredCache,
    ctx: LayerContext,
    ranking: Ranking,
    promotion: bool,
    chunk: int,
) -> tuple[jax.Array, TieredCache]:
    """Prompt attention for one layer and routing of the prompt's KV into the tiers (DESIGN §5).

    q [B, T, H, D], k, v [B, T, Hkv, D] post-RoPE, rows right-padded (row b: positions < cache.length[b]).
    Returns (out [B, T, H, D], cache). Windows ending at least R tokens before the prompt end are ranked:
    top NF -> F, next NQ -> Q, rest evicted; the tail stays in the ring.
    """
    caps = cache.caps
    s, w = caps.sink, caps.window
    b, t = q.shape[:2]
    lengths = cache.length
    out, mass = shared_prompt_attention(q, k, v, lengths, ctx, chunk)
    nwp = max(0, -(-(t - s) // w))
    scores = ranking.prefill_window_scores(
        q, k, lengths, mass, s, w, nwp, ctx.cfg.sliding_window, v=v, wo=ctx.wo
    )  # [B, NWP]

    routed = jnp.maximum(0, jnp.floor_divide(lengths - s - caps.recent, w))  # [B] windows leaving the prompt
    win_ids = jnp.arange(nwp, dtype=jnp.int32)
    cand_win = jnp.where(win_ids[None] < routed[:, None], win_ids[None], -1)  # [B, NWP]
    kw = prompt_windows(k, s, w, nwp).transpose(0, 3, 1, 2, 4)  # [B, Hkv, NWP, W, D]
    vw = prompt_windows(v, s, w, nwp).transpose(0, 3, 1, 2, 4)

    def place(row, c_win, c_score, c_k, c_v):
        # the tiers are empty: no window is demoted or promoted, so nothing but the candidates is quantized
        plan = plan_for_row(row, c_win, c_score, promotion)
        return apply_plan(row, plan, c_k, c_v, c_win, ctx.inv_freq, bound=0)

    cache = jax.vmap(place)(cache, cand_win, scores, kw, vw)

    # sinks and the ring tail
    cache, _ = fill_sink_and_ring(cache, k, v, lengths, routed)
    rw = caps.ring_windows
    slot_ids = jnp.arange(rw, dtype=jnp.int32)
    slot_win = routed[:, None] + jnp.mod(slot_ids[None] - routed[:, None], rw)  # [B, RW]
    loc_score = jnp.take_along_axis(jnp.pad(scores, ((0, 0), (0, 1))), jnp.clip(slot_win, 0, nwp), axis=1)
    loc_score = jnp.where(s + slot_win * w < lengths[:, None], loc_score, 0.0)
    cache = cache.replace(loc_score=loc_score.astype(jnp.float32))
    return out, cache


# ---------------------------------------------------------------------------------------------- decode


class TierAttention(struct.PyTreeNode):
    """Decode attention of one layer, split by tier.

    out: [B, Hkv, G, D] f32 normalized output. Attention probabilities per query head:
    sink [B, Hkv, G, S], fp [B, Hkv, G, NF, W], led [B, Hkv, G, NL] (per slot), local [B, Hkv, G, RING].
    """

    out: jax.Array
    sink: jax.Array
    fp: jax.Array
    led: jax.Array
    local: jax.Array


def tier_attention(
    q: jax.Array, cache: TieredCache, q_pos: jax.Array, inv_freq: jax.Array, sliding_window
) -> TierAttention:
    """Attention of one decode query per head q [B, Hkv, G, D] (post-RoPE, at q_pos [B]) over all tiers.

    The cache must already hold the current token (in the sink or the ring) and ``length = q_pos + 1``.
    """
    caps = cache.caps
    s, w = caps.sink, caps.window
    b, hkv, g, d = q.shape
    nf, nl = caps.nf, caps.nl
    sink_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    sink_ok = (sink_pos <= q_pos[:, None]) & window_mask(q_pos, sink_pos, sliding_window)
    p_sink = dense_partial(q, cache.sink_k, cache.sink_v, sink_ok)

    fp_pos = (s + cache.fp_win[:, :, None] * w + jnp.arange(w, dtype=jnp.int32)).reshape(b, nf * w)
    fp_ok = jnp.repeat(cache.fp_win >= 0, w, axis=1) & window_mask(q_pos, fp_pos, sliding_window)
    p_fp = dense_partial(
        q, cache.fp_k.reshape(b, hkv, nf * w, d), cache.fp_v.reshape(b, hkv, nf * w, d), fp_ok
    )

    if nl:
        start = s + cache.led_win * w
        # a Q window takes part while its last token is inside the sliding window (slot granularity)
        led_ok = cache.led_active & window_mask(q_pos, start + w - 1, sliding_window)
        p_led = ledger_attention(
            q, *(getattr(cache, n) for n in LEDGER_FIELDS), start, led_ok, inv_freq, window=w, bits=caps.bits
        )
    else:
        zeros = jnp.zeros((b, hkv, g), jnp.float32)
        p_led = (jnp.zeros((b, hkv, g, d)), zeros + NEG_INF, zeros, jnp.zeros((b, hkv, g, 0)))

    loc_pos = ring_positions(cache.length, caps)
    loc_ok = ring_valid(cache.length, cache.next_win, caps) & window_mask(q_pos, loc_pos, sliding_window)
    p_loc = dense_partial(q, cache.local_k, cache.local_v, loc_ok)

    parts = (p_sink, p_fp, p_led, p_loc)
    out, weights = combine_partials([p[:3] for p in parts])
    probs = [p[3] * wt[..., None] for p, wt in zip(parts, weights, strict=True)]
    return TierAttention(
        out=out, sink=probs[0], fp=probs[1].reshape(b, hkv, g, nf, w), led=probs[2], local=probs[3]
    )


def kernel_tier_attention(
    q: jax.Array, cache: TieredCache, q_pos: jax.Array, inv_freq: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``tier_attention`` through the Pallas kernels (compiled on a GPU, interpreted elsewhere).

    q [B, Hkv, G, D] -> (out [B, Hkv, G, D] f32, head-mean masses per F slot [B, NF], per ledger slot
    [B, NL], per ring token [B, RING]). No sliding window.
    """
    caps = cache.caps
    s, w = caps.sink, caps.window
    sink_valid = jnp.arange(s, dtype=jnp.int32)[None] <= q_pos[:, None]
    loc_pos = ring_positions(cache.length, caps)
    loc_pos = jnp.where(ring_valid(cache.length, cache.next_win, caps), loc_pos, -1)
    att = fused_attention(
        q,
        cache.sink_k,
        cache.sink_v,
        sink_valid,
        cache.fp_k,
        cache.fp_v,
        cache.fp_win >= 0,
        *(getattr(cache, n) for n in LEDGER_FIELDS),
        s + cache.led_win * w,
        cache.led_active,
        inv_freq,
        cache.local_k,
        cache.local_v,
        loc_pos,
        window=w,
        bits=caps.bits,
    )
    return att.out, att.fp_mass, att.q_mass, att.local_mass


def decode_layer(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: TieredCache,
    ctx: LayerContext,
    ranking: Ranking,
    use_kernel: bool = False,
) -> tuple[jax.Array, TieredCache]:
    """One decode step of one layer: q [B, 1, H, D], k, v [B, 1, Hkv, D] post-RoPE -> (out [B, 1, H, D],
    cache).

    Writes the token into the sink or the ring, attends over all tiers, adds the head-mean window masses
    to the scores (the routing event every Ω steps runs after the layer scan: ``decode_route``). ``use_kernel``: attend with the Pallas kernels
    (``pallas_kernels.fused_attention``) instead of the jnp reference (not with a sliding window, whose
    token-level masks the kernels do not take).
    """
    caps = cache.caps
    s, w = caps.sink, caps.window
    b, _, h, d = q.shape
    hkv = k.shape[2]
    pos = ctx.positions[:, 0]
    kx, vx = k[:, 0], v[:, 0]  # [B, Hkv, D]
    rw_slot = jnp.mod(jnp.floor_divide(pos - s, w), caps.ring_windows)
    starts_window = (pos >= s) & (jnp.mod(pos - s, w) == 0)
    fresh = (jnp.arange(caps.ring_windows)[None] == rw_slot[:, None]) & starts_window[:, None]
    cache = write_token(cache, pos, kx, vx)
    cache = cache.replace(loc_score=jnp.where(fresh, 0.0, cache.loc_score))
    qg = q[:, 0].reshape(b, hkv, h // hkv, d)
    if use_kernel and ctx.cfg.sliding_window is None:
        out, fp_mass, led_mass, loc_tok = kernel_tier_attention(qg, cache, pos, ctx.inv_freq)
    else:
        att = tier_attention(qg, cache, pos, ctx.inv_freq, ctx.cfg.sliding_window)
        out = att.out
        fp_mass = att.fp.mean(axis=(1, 2)).sum(-1)  # [B, NF]
        led_mass = att.led.mean(axis=(1, 2))  # [B, NL]
        loc_tok = att.local.mean(axis=(1, 2))  # [B, RING]
    loc_mass = loc_tok.reshape(b, caps.ring_windows, w).sum(-1)  # [B, RW]
    cache = cache.replace(
        fp_score=ranking.update(cache.fp_score, fp_mass),
        led_score=ranking.update(cache.led_score, led_mass),
        loc_score=ranking.update(cache.loc_score, loc_mass),
        steps=cache.steps + 1,
    )
    return out.reshape(b, 1, h, d).astype(q.dtype), cache
