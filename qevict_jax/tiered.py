"""The tiered QEvict cache: pytree, prefill compression and decode attention (DESIGN §4-§6).

Per layer and batch row the cache holds sink tokens, a local ring (recent region + the window being
filled + the windows that left the recent region since the last routing event), the F tier (full-precision
windows, post-RoPE) and the ledger (INT2/INT4 windows, keys pre-RoPE; active = Q tier, dormant = codes kept
for a promoted window). Window w covers absolute positions ``[S + wW, S + (w+1)W)``; positions are never
renumbered.

Deviation from DESIGN §4: scores are kept per slot (``fp_score`` [B, NF], ``led_score`` [B, NL], ``loc_score``
[B, RING/W]) and move with their window, instead of one ``score [B, NWmax]`` array indexed by window id.
Evicted windows never come back, so nothing is lost, and the cache size no longer grows with the maximum
sequence length: at a fixed byte budget NF and NQ are the same for any length.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import NEG_INF, prompt_attention
from models.config import ModelConfig
from models.model import LayerContext
from pallas_kernels.dispatch import ledger_attention
from pallas_kernels.fused_attention import fused_attention
from pallas_kernels.reference import combine_partials
from qevict_jax.config import Capacities
from qevict_jax.routing import (
    LEDGER_FIELDS,
    _rank,
    assign_slots,
    plan_routing,
    quantize_windows,
    ring_candidates,
)
from qevict_jax.scoring import Ranking, prompt_windows


@struct.dataclass
class TieredCache:
    """One layer's tiered cache (stacked caches carry a leading [L] axis on every array field).

    S = sink, RING = ring slots, RW = RING / W, NF = F slots, NL = ledger slots, Wb = W*bits/8, Db = D*bits/8.
    """

    sink_k: jax.Array  # [B, Hkv, S, D] model dtype, post-RoPE, slot = position
    sink_v: jax.Array  # [B, Hkv, S, D]
    local_k: jax.Array  # [B, Hkv, RING, D] post-RoPE; position p >= S lives in slot (p - S) % RING
    local_v: jax.Array  # [B, Hkv, RING, D]
    loc_score: jax.Array  # [B, RW] f32 score of the window in each ring window slot (window w -> w % RW)
    fp_k: jax.Array  # [B, Hkv, NF, W, D] F tier, post-RoPE
    fp_v: jax.Array  # [B, Hkv, NF, W, D]
    fp_win: jax.Array  # [B, NF] int32 window id in each F slot, -1 = empty
    fp_score: jax.Array  # [B, NF] f32
    led_kc: jax.Array  # [B, Hkv, NL, D, Wb] uint8 key codes, pre-RoPE, per-channel grid over the window
    led_ks: jax.Array  # [B, Hkv, NL, D] f16 key scale
    led_kz: jax.Array  # [B, Hkv, NL, D] f16 key min
    led_vc: jax.Array  # [B, Hkv, NL, W, Db] uint8 value codes, per-token grid over head_dim
    led_vs: jax.Array  # [B, Hkv, NL, W] f16 value scale
    led_vz: jax.Array  # [B, Hkv, NL, W] f16 value min
    led_win: jax.Array  # [B, NL] int32 window id, -1 = free
    led_active: jax.Array  # [B, NL] bool: True = in Q, False (with win >= 0) = dormant copy of an F window
    led_score: jax.Array  # [B, NL] f32 (meaningful for active entries)
    length: jax.Array  # [B] int32 tokens seen
    next_win: jax.Array  # [B] int32 first window id still in the ring (lower ids have been routed)
    steps: jax.Array  # [B] int32 decode steps since prefill
    routing_events: jax.Array  # [B] int32 decode routing events
    promotions: jax.Array  # [B] int32 Q -> F transitions
    demotions: jax.Array  # [B] int32 F -> Q transitions
    evictions: jax.Array  # [B] int32 windows evicted (prefill included)
    # head pool (pool layout, NP = Hkv * pool_per_head token slots; zero-sized in the other layouts)
    hp_k: jax.Array  # [B, NP, D] post-RoPE key of one KV head at one position
    hp_v: jax.Array  # [B, NP, D]
    hp_pos: jax.Array  # [B, NP] int32 absolute position, -1 = empty
    hp_head: jax.Array  # [B, NP] int8 owning KV head
    hp_score: jax.Array  # [B, NPS] f32 running score (NPS = NP with decode-time eviction, else 0)
    ring_hscore: jax.Array  # [B, Hkv, RS] f32 per-head score of each ring slot (RS = RING or 0, as NPS)
    caps: Capacities = struct.field(pytree_node=False)


def init_cache(
    caps: Capacities,
    model_cfg: ModelConfig,
    batch: int,
    dtype: Any,
    lengths: jax.Array | None = None,
) -> TieredCache:
    """An empty stacked cache: every array field has a leading [L] axis. lengths: [B] tokens seen."""
    L, hkv, d = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim
    b, w, nf, nl = batch, caps.window, caps.nf, caps.nl
    per = 8 // caps.bits

    def z(shape, dt):
        return jnp.zeros((L, b, *shape), dt)

    if lengths is None:
        lengths = jnp.zeros((b,), jnp.int32)
    counter = z((), jnp.int32)
    npool = hkv * caps.pool_per_head
    nps = npool if caps.pool_scores else 0
    return TieredCache(
        sink_k=z((hkv, caps.sink, d), dtype),
        sink_v=z((hkv, caps.sink, d), dtype),
        local_k=z((hkv, caps.ring, d), dtype),
        local_v=z((hkv, caps.ring, d), dtype),
        loc_score=z((caps.ring_windows,), jnp.float32),
        fp_k=z((hkv, nf, w, d), dtype),
        fp_v=z((hkv, nf, w, d), dtype),
        fp_win=jnp.full((L, b, nf), -1, jnp.int32),
        fp_score=z((nf,), jnp.float32),
        led_kc=z((hkv, nl, d, w // per), jnp.uint8),
        led_ks=z((hkv, nl, d), jnp.float16),
        led_kz=z((hkv, nl, d), jnp.float16),
        led_vc=z((hkv, nl, w, d // per), jnp.uint8),
        led_vs=z((hkv, nl, w), jnp.float16),
        led_vz=z((hkv, nl, w), jnp.float16),
        led_win=jnp.full((L, b, nl), -1, jnp.int32),
        led_active=z((nl,), bool),
        led_score=z((nl,), jnp.float32),
        length=jnp.broadcast_to(lengths.astype(jnp.int32), (L, b)),
        next_win=counter,
        steps=counter,
        routing_events=counter,
        promotions=counter,
        demotions=counter,
        evictions=counter,
        hp_k=z((npool, d), dtype),
        hp_v=z((npool, d), dtype),
        hp_pos=jnp.full((L, b, npool), -1, jnp.int32),
        hp_head=jnp.broadcast_to(
            (jnp.arange(npool, dtype=jnp.int32) // max(1, caps.pool_per_head)).astype(jnp.int8), (L, b, npool)
        ),
        hp_score=z((nps,), jnp.float32),
        ring_hscore=z((hkv, caps.ring if caps.pool_scores else 0), jnp.float32),
        caps=caps,
    )


class SizedByCapacities:
    """Mixin of the methods whose cache is a ``TieredCache`` sized by their ``capacities(...)``."""

    def init_cache(
        self,
        model_cfg: ModelConfig,
        prompt_lengths: jax.Array,
        prompt_capacity: int,
        max_new_tokens: int,
        dtype: Any,
        budget_tokens: int,
    ) -> TieredCache:
        """Empty stacked cache sized for ``budget_tokens`` tokens per row; ``prompt_lengths`` [B] int32."""
        b = prompt_lengths.shape[0]
        caps = self.capacities(model_cfg, b, prompt_capacity, max_new_tokens, dtype, budget_tokens)
        return init_cache(caps, model_cfg, b, dtype, prompt_lengths)

    def decode_route(self, cache: TieredCache, inv_freq: jax.Array) -> TieredCache:
        """After a decode step of every layer: a routing event (``route``) of every layer and row when the
        step count reaches a multiple of Ω. Outside the layer scan, so a step without one copies nothing."""
        if not cache.caps.decode_routing:
            return cache
        due = jnp.mod(cache.steps[0, 0], cache.caps.omega) == 0
        return jax.lax.cond(due, lambda c: self.route(c, inv_freq), lambda c: c, cache)


def abstract_cache(caps: Capacities, model_cfg: ModelConfig, batch: int, dtype: Any) -> TieredCache:
    """Shapes and dtypes of the stacked cache, without allocating (``jax.eval_shape``)."""
    return jax.eval_shape(lambda: init_cache(caps, model_cfg, batch, dtype))


# ---------------------------------------------------------------------------------------------- helpers


def ring_positions(length: jax.Array, caps: Capacities) -> jax.Array:
    """Absolute position held by each ring slot: [B] lengths -> [B, RING] (the newest position <= n - 1
    congruent to the slot; may be < S, i.e. never written)."""
    j = jnp.arange(caps.ring, dtype=jnp.int32)
    n1 = length[:, None] - 1
    return n1 - jnp.mod(n1 - caps.sink - j, caps.ring)


def ring_valid(length: jax.Array, next_win: jax.Array, caps: Capacities) -> jax.Array:
    """[B, RING] bool: slot holds a token of a window not routed yet."""
    pos = ring_positions(length, caps)
    return (pos >= caps.sink) & (pos >= caps.sink + next_win[:, None] * caps.window)


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


def _window_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """[B, N] keys within the sliding window of the query at q_pos [B] (all True without one)."""
    if sliding_window is None:
        return jnp.ones(k_pos.shape, bool)
    return q_pos[:, None] - k_pos < sliding_window


def _write_slot(buf: jax.Array, x: jax.Array, slot: jax.Array, enabled: jax.Array) -> jax.Array:
    """buf [B, Hkv, N, D] with x [B, Hkv, D] written at slot [B] where enabled [B]."""
    hit = (jnp.arange(buf.shape[2])[None, :] == slot[:, None]) & enabled[:, None]
    return jnp.where(hit[:, None, :, None], x[:, :, None, :].astype(buf.dtype), buf)


# ---------------------------------------------------------------------------------------------- prefill


def shared_prompt_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, ctx: LayerContext, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """(out [B, T, H, D], column mass [B, Hkv, G, T]) of the prompt pass: ``ctx.prompt_attention`` when a
    shared prefill computed it, else ``models.attention.prompt_attention``."""
    if ctx.prompt_attention is not None:
        return ctx.prompt_attention
    return prompt_attention(q, k, v, ctx.positions, lengths, ctx.cfg.sliding_window, chunk)


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
        plan = plan_routing(
            row.fp_win,
            row.fp_score,
            row.led_win,
            row.led_active,
            row.led_score,
            c_win,
            c_score,
            nq=caps.nq,
            promotion=promotion,
        )
        fp_k = row.fp_k.at[:, plan.c2f_target].set(c_k.astype(row.fp_k.dtype), mode="drop")
        fp_v = row.fp_v.at[:, plan.c2f_target].set(c_v.astype(row.fp_v.dtype), mode="drop")
        ledger = {}
        if caps.nl:
            entries = quantize_windows(c_k, c_v, s + c_win * w, ctx.inv_freq, caps.bits)
            for name, x in zip(LEDGER_FIELDS, entries, strict=True):
                ledger[name] = getattr(row, name).at[:, plan.c2q_target].set(x, mode="drop")
        return row.replace(
            fp_k=fp_k,
            fp_v=fp_v,
            fp_win=plan.fp_win,
            fp_score=plan.fp_score,
            led_win=plan.led_win,
            led_active=plan.led_active,
            led_score=plan.led_score,
            evictions=row.evictions + plan.evictions,
            **ledger,
        )

    cache = jax.vmap(place)(cache, cand_win, scores, kw, vw)

    # sinks and the ring tail
    sink_pos = jnp.arange(s, dtype=jnp.int32)
    kt = k.swapaxes(1, 2)  # [B, Hkv, T, D]
    vt = v.swapaxes(1, 2)
    take = lambda x, idx: jnp.take_along_axis(x, jnp.clip(idx, 0, t - 1)[:, None, :, None], axis=2)
    sink_ok = (sink_pos[None] < lengths[:, None])[:, None, :, None]
    sink_idx = jnp.broadcast_to(sink_pos, (b, s))
    ring_pos = ring_positions(lengths, caps)
    ring_ok = ring_valid(lengths, routed, caps)[:, None, :, None]
    rw = caps.ring_windows
    slot_ids = jnp.arange(rw, dtype=jnp.int32)
    slot_win = routed[:, None] + jnp.mod(slot_ids[None] - routed[:, None], rw)  # [B, RW]
    loc_score = jnp.take_along_axis(jnp.pad(scores, ((0, 0), (0, 1))), jnp.clip(slot_win, 0, nwp), axis=1)
    loc_score = jnp.where(s + slot_win * w < lengths[:, None], loc_score, 0.0)
    cache = cache.replace(
        sink_k=jnp.where(sink_ok, take(kt, sink_idx), 0).astype(cache.sink_k.dtype),
        sink_v=jnp.where(sink_ok, take(vt, sink_idx), 0).astype(cache.sink_v.dtype),
        local_k=jnp.where(ring_ok, take(kt, ring_pos), 0).astype(cache.local_k.dtype),
        local_v=jnp.where(ring_ok, take(vt, ring_pos), 0).astype(cache.local_v.dtype),
        loc_score=loc_score.astype(jnp.float32),
        next_win=routed.astype(jnp.int32),
    )
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
    sink_ok = (sink_pos <= q_pos[:, None]) & _window_mask(q_pos, sink_pos, sliding_window)
    p_sink = dense_partial(q, cache.sink_k, cache.sink_v, sink_ok)

    fp_pos = (s + cache.fp_win[:, :, None] * w + jnp.arange(w, dtype=jnp.int32)).reshape(b, nf * w)
    fp_ok = jnp.repeat(cache.fp_win >= 0, w, axis=1) & _window_mask(q_pos, fp_pos, sliding_window)
    p_fp = dense_partial(
        q, cache.fp_k.reshape(b, hkv, nf * w, d), cache.fp_v.reshape(b, hkv, nf * w, d), fp_ok
    )

    if nl:
        start = s + cache.led_win * w
        # a Q window takes part while its last token is inside the sliding window (slot granularity)
        led_ok = cache.led_active & _window_mask(q_pos, start + w - 1, sliding_window)
        p_led = ledger_attention(
            q, *(getattr(cache, n) for n in LEDGER_FIELDS), start, led_ok, inv_freq, window=w, bits=caps.bits
        )
    else:
        zeros = jnp.zeros((b, hkv, g), jnp.float32)
        p_led = (jnp.zeros((b, hkv, g, d)), zeros + NEG_INF, zeros, jnp.zeros((b, hkv, g, 0)))

    loc_pos = ring_positions(cache.length, caps)
    loc_ok = ring_valid(cache.length, cache.next_win, caps) & _window_mask(q_pos, loc_pos, sliding_window)
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
    in_sink = pos < s
    ring_slot = jnp.mod(pos - s, caps.ring)
    rw_slot = jnp.mod(jnp.floor_divide(pos - s, w), caps.ring_windows)
    starts_window = ~in_sink & (jnp.mod(pos - s, w) == 0)
    fresh = (jnp.arange(caps.ring_windows)[None] == rw_slot[:, None]) & starts_window[:, None]
    cache = cache.replace(
        sink_k=_write_slot(cache.sink_k, kx, pos, in_sink),
        sink_v=_write_slot(cache.sink_v, vx, pos, in_sink),
        local_k=_write_slot(cache.local_k, kx, ring_slot, ~in_sink),
        local_v=_write_slot(cache.local_v, vx, ring_slot, ~in_sink),
        loc_score=jnp.where(fresh, 0.0, cache.loc_score),
        length=pos + 1,
    )
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


# ---------------------------------------------------------------------------------------------- head pool
# The pool layout (eviction baselines): sinks, the ring, and a pool of token slots each owned by one KV head,
# so that every head keeps its own tokens (uniform, layer-varying or head-adaptive budgets) while the memory
# is the pool itself, sized by the budget. A *policy* (``qevict_jax.baselines``) supplies the scores.


def pool_partial(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Attention partial of queries q [B, Hkv, G, T, D] over keys k, v [B, Hkv, N, D] (per-head keys) or
    [B, N, D] (pool keys shared by every head, owner masked) with mask [B, Hkv, G, T, N] (broadcastable).

    Returns (out [B, Hkv, G, T, D], m, l [B, Hkv, G, T], exp sums [B, Hkv, G, T, N]), all f32.
    """
    b, hkv, g, t, d = q.shape
    n = k.shape[-2]
    if n == 0:
        zeros = jnp.zeros((b, hkv, g, t), jnp.float32)
        return jnp.zeros((b, hkv, g, t, d)), zeros + NEG_INF, zeros, jnp.zeros((b, hkv, g, t, 0))
    qs = q.astype(jnp.float32) * d**-0.5
    if k.ndim == 3:
        s = jnp.einsum("bkgtd,bnd->bkgtn", qs, k.astype(jnp.float32))
    else:
        s = jnp.einsum("bkgtd,bknd->bkgtn", qs, k.astype(jnp.float32))
    s = jnp.where(mask, s, NEG_INF)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    if v.ndim == 3:
        out = jnp.einsum("bkgtn,bnd->bkgtd", p, v.astype(jnp.float32))
    else:
        out = jnp.einsum("bkgtn,bknd->bkgtd", p, v.astype(jnp.float32))
    return out, m, p.sum(-1), p


class PoolAttention(struct.PyTreeNode):
    """Attention of T queries over the pool layout: out [B, T, H, D] (query dtype); probabilities
    pool [B, Hkv, G, T, NP] and ring [B, Hkv, G, T, RING] (f32)."""

    out: jax.Array
    pool: jax.Array
    ring: jax.Array


def pool_attention(q: jax.Array, q_pos: jax.Array, cache: TieredCache, sliding_window) -> PoolAttention:
    """Queries q [B, T, H, D] (post-RoPE) at q_pos [B, T] (-1 = padding) over sinks, the head pool and the
    ring of one layer, causal by absolute position. The cache must already hold the current tokens."""
    caps = cache.caps
    b, t, h, d = q.shape
    hkv = cache.sink_k.shape[1]
    g = h // hkv
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]

    def causal(k_pos):  # k_pos [B, N] -> [B, 1, 1, T, N]
        ok = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0) & (q_pos[:, :, None] >= 0)
        if sliding_window is not None:
            ok &= q_pos[:, :, None] - k_pos[:, None, :] < sliding_window
        return ok[:, None, None]

    sink_pos = jnp.broadcast_to(jnp.arange(caps.sink, dtype=jnp.int32), (b, caps.sink))
    sink_pos = jnp.where(sink_pos < cache.length[:, None], sink_pos, -1)
    p_sink = pool_partial(qg, cache.sink_k, cache.sink_v, causal(sink_pos))
    owner = (
        cache.hp_head.astype(jnp.int32)[:, None, None, None, :] == jnp.arange(hkv)[None, :, None, None, None]
    )
    p_pool = pool_partial(qg, cache.hp_k, cache.hp_v, causal(cache.hp_pos) & owner)
    ring_pos = ring_positions(cache.length, caps)
    ring_pos = jnp.where(ring_valid(cache.length, cache.next_win, caps), ring_pos, -1)
    p_ring = pool_partial(qg, cache.local_k, cache.local_v, causal(ring_pos))
    parts = (p_sink, p_pool, p_ring)
    out, weights = combine_partials([p[:3] for p in parts])
    probs = [p[3] * wt[..., None] for p, wt in zip(parts, weights, strict=True)]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
    return PoolAttention(out=out, pool=probs[1], ring=probs[2])


def select_pool(
    scores: jax.Array,
    eligible: jax.Array,
    per_head: int,
    layer_cap: jax.Array | int,
    adaptive: bool,
    alpha_safeguard: float = 0.2,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Choose the pool content from token scores [B, Hkv, T] (higher = keep) over ``eligible`` [B, T].

    Uniform (``adaptive=False``): each head keeps its top ``layer_cap`` (<= per_head) tokens in its own
    ``per_head`` slots (slot = head * per_head + rank). Adaptive (Ada-KV, arXiv 2407.11550): every head
    first secures its top ``int(alpha_safeguard * per_head)`` tokens, then the layer's ``Hkv * per_head``
    slots go to the top scores over all heads together; a slot records its owner head.
    Returns (position [B, NP] int32, -1 = empty; owner head [B, NP] int32; score [B, NP] f32).
    """
    b, hkv, t = scores.shape
    s = jnp.where(eligible[:, None, :], scores.astype(jnp.float32), -jnp.inf)
    k = min(per_head, t)
    if not adaptive:
        vals, idx = jax.lax.top_k(s, k)  # [B, Hkv, k]
        ok = (jnp.arange(k) < layer_cap)[None, None] & (vals > -jnp.inf)
        pos = jnp.where(ok, idx, -1).astype(jnp.int32)
        head = jnp.broadcast_to(jnp.arange(hkv, dtype=jnp.int32)[None, :, None], pos.shape)
        pad = per_head - k
        pos = jnp.pad(pos, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
        head = jnp.pad(head, ((0, 0), (0, 0), (0, pad)), mode="edge") if pad else head
        vals = jnp.pad(jnp.where(ok, vals, 0.0), ((0, 0), (0, 0), (0, pad)))
        return pos.reshape(b, -1), head.reshape(b, -1), vals.reshape(b, -1)
    n_safe = int(per_head * alpha_safeguard)
    forced = s
    if n_safe:
        _, top = jax.lax.top_k(s, min(n_safe, t))
        hit = (
            jnp.zeros(s.shape, bool)
            .at[jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None], top]
            .set(True)
        )
        forced = jnp.where(hit & (s > -jnp.inf), jnp.finfo(jnp.float32).max, s)
    total = hkv * per_head
    kk = min(total, hkv * t)
    vals, idx = jax.lax.top_k(forced.reshape(b, hkv * t), kk)
    ok = vals > -jnp.inf
    head = (idx // t).astype(jnp.int32)
    pos = jnp.where(ok, idx % t, -1).astype(jnp.int32)
    true_score = jnp.take_along_axis(s.reshape(b, hkv * t), idx, axis=1)
    pad = total - kk
    pos = jnp.pad(pos, ((0, 0), (0, pad)), constant_values=-1)
    head = jnp.pad(head, ((0, 0), (0, pad)))
    return pos, head, jnp.pad(jnp.where(ok, true_score, 0.0), ((0, 0), (0, pad)))


def pool_prefill_layer(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: TieredCache, ctx: LayerContext, policy: Any, chunk: int
) -> tuple[jax.Array, TieredCache]:
    """Prompt pass of one layer in the pool layout: q [B, T, H, D], k, v [B, T, Hkv, D] post-RoPE, rows
    right-padded. Returns (out [B, T, H, D], cache).

    The prompt (positions < ``cache.length``) is attended causally and scored by ``policy``; positions
    ``S <= p < length - R`` compete for the pool, the last R tokens stay in the ring.
    """
    caps = cache.caps
    s = caps.sink
    b, t = q.shape[:2]
    hkv = k.shape[2]
    lengths = cache.length
    positions = ctx.positions
    out, mass = shared_prompt_attention(q, k, v, lengths, ctx, chunk)
    scores = policy.prefill_scores(q, k, v, positions, lengths, mass, ctx, caps)  # [B, Hkv, T]
    routed = jnp.maximum(0, lengths - s - caps.recent)  # tokens leaving the ring: S <= p < S + routed
    eligible = (positions >= s) & (positions < s + routed[:, None])
    layer_cap = jnp.asarray(caps.layer_caps, jnp.int32)[ctx.layer] if caps.layer_caps else caps.pool_per_head
    pos, head, slot_score = select_pool(
        scores, eligible, caps.pool_per_head, layer_cap, policy.adaptive, policy.alpha_safeguard
    )
    flat = head * t + jnp.clip(pos, 0, t - 1)  # [B, NP]
    kt = k.swapaxes(1, 2).reshape(b, hkv * t, -1)  # [B, Hkv*T, D]
    vt = v.swapaxes(1, 2).reshape(b, hkv * t, -1)
    ok = (pos >= 0)[..., None]
    hp_k = jnp.where(ok, jnp.take_along_axis(kt, flat[..., None], axis=1), 0).astype(cache.hp_k.dtype)
    hp_v = jnp.where(ok, jnp.take_along_axis(vt, flat[..., None], axis=1), 0).astype(cache.hp_v.dtype)
    kept = jnp.sum(pos >= 0, axis=1, dtype=jnp.int32)
    evicted = hkv * jnp.sum(eligible, axis=1, dtype=jnp.int32) - kept

    kt4, vt4 = k.swapaxes(1, 2), v.swapaxes(1, 2)  # [B, Hkv, T, D]
    take = lambda x, idx: jnp.take_along_axis(x, jnp.clip(idx, 0, t - 1)[:, None, :, None], axis=2)
    sink_pos = jnp.arange(s, dtype=jnp.int32)
    sink_ok = (sink_pos[None] < lengths[:, None])[:, None, :, None]
    sink_idx = jnp.broadcast_to(sink_pos, (b, s))
    ring_pos = ring_positions(lengths, caps)
    ring_ok = ring_valid(lengths, routed, caps)
    cache = cache.replace(
        sink_k=jnp.where(sink_ok, take(kt4, sink_idx), 0).astype(cache.sink_k.dtype),
        sink_v=jnp.where(sink_ok, take(vt4, sink_idx), 0).astype(cache.sink_v.dtype),
        local_k=jnp.where(ring_ok[:, None, :, None], take(kt4, ring_pos), 0).astype(cache.local_k.dtype),
        local_v=jnp.where(ring_ok[:, None, :, None], take(vt4, ring_pos), 0).astype(cache.local_v.dtype),
        hp_k=hp_k,
        hp_v=hp_v,
        hp_pos=pos,
        hp_head=head.astype(jnp.int8),
        next_win=routed.astype(jnp.int32),
        evictions=cache.evictions + evicted,
    )
    if caps.pool_scores:
        ring_sc = jnp.take_along_axis(scores, jnp.clip(ring_pos, 0, t - 1)[:, None, :], axis=2)
        cache = cache.replace(
            hp_score=slot_score.astype(jnp.float32),
            ring_hscore=jnp.where(ring_ok[:, None, :], ring_sc, 0.0).astype(jnp.float32),
        )
    return out, cache


def pool_decode_layer(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: TieredCache, ctx: LayerContext, policy: Any
) -> tuple[jax.Array, TieredCache]:
    """One decode step in the pool layout: q [B, 1, H, D], k, v [B, 1, Hkv, D] -> (out [B, 1, H, D], cache).

    The token goes to the sink or the ring; attention reads sinks, pool and ring. With decode-time eviction
    the policy's per-head attention statistic updates the slot and ring scores; every Ω steps, after the
    layer scan (``decode_route``), the tokens that left the recent region compete with each head's pool
    slots (``route_pool_row``).
    """
    caps = cache.caps
    s = caps.sink
    pos = ctx.positions[:, 0]
    kx, vx = k[:, 0], v[:, 0]
    in_sink = pos < s
    ring_slot = jnp.mod(pos - s, caps.ring)
    cache = cache.replace(
        sink_k=_write_slot(cache.sink_k, kx, pos, in_sink),
        sink_v=_write_slot(cache.sink_v, vx, pos, in_sink),
        local_k=_write_slot(cache.local_k, kx, ring_slot, ~in_sink),
        local_v=_write_slot(cache.local_v, vx, ring_slot, ~in_sink),
        length=pos + 1,
        steps=cache.steps + 1,
    )
    att = pool_attention(q, ctx.positions, cache, ctx.cfg.sliding_window)
    if not caps.decode_routing:
        return att.out, cache
    fresh = (jnp.arange(caps.ring)[None] == ring_slot[:, None]) & ~in_sink[:, None]  # [B, RING]
    ring_score = jnp.where(fresh[:, None], 0.0, cache.ring_hscore)
    own = att.pool[:, :, :, 0].mean(axis=2)  # [B, Hkv, NP] group mean
    own = jnp.take_along_axis(own, cache.hp_head.astype(jnp.int32)[:, None, :], axis=1)[:, 0]  # owner's
    slot_mass = policy.slot_mass(own, caps.pool_per_head)  # [B, NP]
    cache = cache.replace(
        hp_score=jnp.where(cache.hp_pos >= 0, policy.update(cache.hp_score, slot_mass), 0.0),
        ring_hscore=policy.update(ring_score, policy.decode_mass(att.ring[:, :, :, 0])),
    )
    return att.out, cache


def route_pool_row(row: Any, policy: Any) -> Any:
    """Decode-time eviction for one batch row of the pool layout (uniform per-head slots).

    The tokens that left the recent region (``ring_candidates`` with W = 1) compete, head by head, with
    the head's ``pool_per_head`` slots: the top ``pool_per_head`` scores stay (ties: pool slots first, then
    older candidates), newcomers take the freed slots.
    """
    caps = row.caps
    pph = caps.pool_per_head
    cand_win, ring_slot = ring_candidates(row)  # [K]
    hkv, _, d = row.local_k.shape
    cand_k = row.local_k[:, ring_slot]  # [Hkv, K, D]
    cand_v = row.local_v[:, ring_slot]
    cand_score = policy.candidate_score(row.ring_hscore[:, ring_slot], cand_k)  # [Hkv, K]
    cand_pos = caps.sink + cand_win

    def per_head(slot_pos, slot_score, c_score):
        valid = jnp.concatenate([slot_pos >= 0, cand_win >= 0])
        score = jnp.concatenate([slot_score, c_score]).astype(jnp.float32)
        keep = valid & (_rank(jnp.where(valid, score, -jnp.inf)) < pph)
        keep_slot, keep_cand = jnp.split(keep, [pph])
        target = assign_slots(~keep_slot, keep_cand)  # [K], pph = none
        new_pos = jnp.where(keep_slot, slot_pos, -1).at[target].set(cand_pos, mode="drop")
        new_score = jnp.where(keep_slot, slot_score, 0.0).at[target].set(c_score, mode="drop")
        return new_pos, new_score, target, jnp.sum(valid & ~keep, dtype=jnp.int32)

    pos, score, target, gone = jax.vmap(per_head)(
        row.hp_pos.reshape(hkv, pph), row.hp_score.reshape(hkv, pph), cand_score
    )
    slot = (jnp.arange(hkv)[:, None] * pph + jnp.where(target < pph, target, hkv * pph)).reshape(-1)
    hp_k = row.hp_k.at[slot].set(cand_k.reshape(-1, d).astype(row.hp_k.dtype), mode="drop")
    hp_v = row.hp_v.at[slot].set(cand_v.reshape(-1, d).astype(row.hp_v.dtype), mode="drop")
    new_next = jnp.maximum(row.next_win, jnp.max(jnp.where(cand_win >= 0, cand_win + 1, 0)))
    return row.replace(
        hp_k=hp_k,
        hp_v=hp_v,
        hp_pos=pos.reshape(-1),
        hp_score=score.reshape(-1),
        next_win=new_next,
        routing_events=row.routing_events + 1,
        evictions=row.evictions + gone.sum(),
    )
