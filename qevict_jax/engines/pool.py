"""The token-pool engine of the per-head eviction baselines (H2O, TOVA, key-norm, SnapKV, PyramidKV, Ada-KV,
CriticalKV, ReST-KV): sinks, the ring, and a pool of token slots each owned by one KV head, so that every
head keeps its own tokens (uniform, layer-varying or head-adaptive budgets) while the memory is the pool
itself, sized by the budget. A policy (``qevict_jax.methods.baselines``) is a ranking (``scoring.TokenRanking``: the
per-head token scores of the prompt and their decode-time update, the same objects the window engine ranks
its windows with) and an allocation rule (``Allocation``: how the slots go to the heads and the layers).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from models.model import LayerContext
from pallas_kernels.tiers import combine_partials, dense_partial
from qevict_jax.core.budget import pyramid_layer_caps
from qevict_jax.core.cache import (
    PoolCache,
    fill_sink_and_ring,
    ring_positions,
    ring_valid,
    shared_prompt_attention,
    write_token,
)
from qevict_jax.engines.migrate import mark_routed
from qevict_jax.engines.routing import _rank, assign_slots, ring_candidates
from qevict_jax.rankings.attention_scores import head_top_mask
from qevict_jax.rankings.scoring import PromptPass, TokenRanking


class PoolAttention(struct.PyTreeNode):
    """Attention of T queries over the pool layout: out [B, T, H, D] (query dtype); probabilities
    pool [B, Hkv, G, T, NP] and ring [B, Hkv, G, T, RING] (f32)."""

    out: jax.Array
    pool: jax.Array
    ring: jax.Array


def pool_attention(q: jax.Array, q_pos: jax.Array, cache: PoolCache, sliding_window) -> PoolAttention:
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
    p_sink = dense_partial(qg, cache.sink_k, cache.sink_v, causal(sink_pos))
    owner = (
        cache.pool_head.astype(jnp.int32)[:, None, None, None, :] == jnp.arange(hkv)[None, :, None, None, None]
    )
    p_pool = dense_partial(qg, cache.pool_k, cache.pool_v, causal(cache.pool_pos) & owner)
    ring_pos = ring_positions(cache.length, caps)
    ring_pos = jnp.where(ring_valid(cache.length, cache.next_win, caps), ring_pos, -1)
    p_ring = dense_partial(qg, cache.ring_k, cache.ring_v, causal(ring_pos))
    parts = (p_sink, p_pool, p_ring)
    out, weights = combine_partials(parts)
    probs = [p.mass * wt[..., None] for p, wt in zip(parts, weights, strict=True)]
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
    return PoolAttention(out=out, pool=probs[1], ring=probs[2])


@dataclasses.dataclass(frozen=True)
class Allocation:
    """How a layer's pool slots go to its KV heads, and the pool's fill per layer (static, hashable).

    adaptive=False: each head keeps its top ``layer_cap`` (<= per_head) tokens in its own ``per_head`` slots
    (slot = head * per_head + rank). adaptive=True (Ada-KV, arXiv 2407.11550): every head first secures its
    top ``int(safeguard * per_head)`` tokens, then the layer's ``Hkv * per_head`` slots go to the top scores
    over all heads together; a slot records its owner head. pyramid_beta: PyramidKV's layer-varying fill
    (``budget.pyramid_layer_caps`` of steepness beta), else every layer fills ``per_head`` slots per head.
    """

    adaptive: bool = False
    safeguard: float = 0.2
    pyramid_beta: float | None = None

    def layer_caps(self, per_head: int, num_layers: int, prefix: int) -> tuple[int, ...]:
        """Per-layer pool fill; () = every layer fills ``per_head`` slots per head. PyramidKV: the largest
        mean per-layer budget whose pyramid fits the ``per_head`` slots (``prefix``: the prompt tokens)."""
        if self.pyramid_beta is None:
            return ()
        for mean in range(per_head, 0, -1):
            caps = pyramid_layer_caps(float(mean), num_layers, prefix, self.pyramid_beta)
            if max(caps) <= per_head:
                return caps
        return tuple(0 for _ in range(num_layers))

    def select(
        self, scores: jax.Array, eligible: jax.Array, per_head: int, layer_cap: jax.Array | int
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Choose the pool content from token scores [B, Hkv, T] (higher = keep) over ``eligible`` [B, T].

        Returns (position [B, NP] int32, -1 = empty; owner head [B, NP] int32; score [B, NP] f32).
        """
        b, hkv, t = scores.shape
        s = jnp.where(eligible[:, None, :], scores.astype(jnp.float32), -jnp.inf)
        k = min(per_head, t)
        if not self.adaptive:
            vals, idx = jax.lax.top_k(s, k)  # [B, Hkv, k]
            ok = (jnp.arange(k) < layer_cap)[None, None] & (vals > -jnp.inf)
            pos = jnp.where(ok, idx, -1).astype(jnp.int32)
            head = jnp.broadcast_to(jnp.arange(hkv, dtype=jnp.int32)[None, :, None], pos.shape)
            pad = per_head - k
            pos = jnp.pad(pos, ((0, 0), (0, 0), (0, pad)), constant_values=-1)
            head = jnp.pad(head, ((0, 0), (0, 0), (0, pad)), mode="edge") if pad else head
            vals = jnp.pad(jnp.where(ok, vals, 0.0), ((0, 0), (0, 0), (0, pad)))
            return pos.reshape(b, -1), head.reshape(b, -1), vals.reshape(b, -1)
        n_safe = int(per_head * self.safeguard)
        forced = s
        if n_safe:  # every head's top n_safe tokens first
            forced = jnp.where(head_top_mask(s, n_safe), jnp.finfo(jnp.float32).max, s)
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


UNIFORM = Allocation()
"""Every head its own ``pool_per_head`` slots, every layer full (SnapKV, H2O, ...)."""


def pool_prefill_layer(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: PoolCache,
    ctx: LayerContext,
    *,
    ranking: TokenRanking,
    allocation: Allocation,
    chunk: int,
) -> tuple[jax.Array, PoolCache]:
    """Prompt pass of one layer in the pool layout: q [B, T, H, D], k, v [B, T, Hkv, D] post-RoPE, rows
    right-padded. Returns (out [B, T, H, D], cache).

    The prompt (positions < ``cache.length``) is attended causally and scored by ``ranking``; positions
    ``S <= p < length - R`` compete for the pool (``allocation.select``), the last R tokens stay in the ring.
    """
    caps = cache.caps
    s = caps.sink
    b, t = q.shape[:2]
    hkv = k.shape[2]
    lengths = cache.length
    positions = ctx.positions
    out, mass, q, k, v = shared_prompt_attention(q, k, v, lengths, ctx, chunk)
    prompt = PromptPass.of_layer(q, k, v, lengths=lengths, column_mass=mass, ctx=ctx)
    scores = ranking.prefill_token_scores(prompt, caps)  # [B, Hkv, T]
    routed = jnp.maximum(0, lengths - s - caps.recent)  # tokens leaving the ring: S <= p < S + routed
    eligible = (positions >= s) & (positions < s + routed[:, None])
    layer_cap = jnp.asarray(caps.layer_caps, jnp.int32)[ctx.layer] if caps.layer_caps else caps.pool_per_head
    pos, head, slot_score = allocation.select(scores, eligible, caps.pool_per_head, layer_cap)
    rows = jnp.arange(b)[:, None]
    at = (rows, jnp.clip(pos, 0, t - 1), head)  # slot -> (row, position, KV head) of k, v [B, T, Hkv, D]
    ok = (pos >= 0)[..., None]
    pool_k = jnp.where(ok, k[at], 0).astype(cache.pool_k.dtype)  # [B, NP, D], no transposed copy of the prompt
    pool_v = jnp.where(ok, v[at], 0).astype(cache.pool_v.dtype)
    kept = jnp.sum(pos >= 0, axis=1, dtype=jnp.int32)
    evicted = hkv * jnp.sum(eligible, axis=1, dtype=jnp.int32) - kept

    cache, ring_ok = fill_sink_and_ring(cache, k, v, lengths, routed)
    cache = cache.replace(
        pool_k=pool_k,
        pool_v=pool_v,
        pool_pos=pos,
        pool_head=head.astype(jnp.int8),
        evictions=cache.evictions + evicted,
    )
    if caps.pool_scores:
        ring_pos = ring_positions(lengths, caps)
        ring_sc = jnp.take_along_axis(scores, jnp.clip(ring_pos, 0, t - 1)[:, None, :], axis=2)
        cache = cache.replace(
            pool_score=slot_score.astype(jnp.float32),
            ring_head_score=jnp.where(ring_ok[:, None, :], ring_sc, 0.0).astype(jnp.float32),
        )
    return out, cache


def pool_decode_layer(
    q: jax.Array, k: jax.Array, v: jax.Array, cache: PoolCache, ctx: LayerContext, *, ranking: TokenRanking
) -> tuple[jax.Array, PoolCache]:
    """One decode step in the pool layout: q [B, 1, H, D], k, v [B, 1, Hkv, D] -> (out [B, 1, H, D], cache).

    The token goes to the sink or the ring; attention reads sinks, pool and ring. With decode-time eviction
    each head's attention (group mean; the mean over every head when ``ranking.shared_heads``) updates the
    slot and ring scores (``ranking.update``); every Ω steps, after the
    layer scan (``decode_route``), the tokens that left the recent region compete with each head's pool
    slots (``route_pool_row``).
    """
    caps = cache.caps
    s = caps.sink
    pos = ctx.positions[:, 0]
    in_sink = pos < s
    ring_slot = jnp.mod(pos - s, caps.ring)
    cache = write_token(cache, pos, k[:, 0], v[:, 0])
    cache = cache.replace(steps=cache.steps + 1)
    att = pool_attention(q, ctx.positions, cache, ctx.cfg.sliding_window)
    if not caps.decode_routing:
        return att.out, cache
    fresh = (jnp.arange(caps.ring)[None] == ring_slot[:, None]) & ~in_sink[:, None]  # [B, RING]
    ring_score = jnp.where(fresh[:, None], 0.0, cache.ring_head_score)
    own = att.pool[:, :, :, 0].mean(axis=2)  # [B, Hkv, NP] group mean
    own = jnp.take_along_axis(own, cache.pool_head.astype(jnp.int32)[:, None, :], axis=1)[:, 0]  # owner's
    ring_probs = att.ring[:, :, :, 0]  # [B, Hkv, G, RING]
    if ranking.shared_heads:  # every head keeps the same tokens: slot j of each head holds one token
        ring_mass = jnp.broadcast_to(
            ring_probs.mean(axis=(1, 2))[:, None], ring_probs.shape[:2] + ring_probs.shape[3:]
        )
        n, slots_per_head = own.shape[1], caps.pool_per_head
        slot_mass = jnp.tile(own.reshape(-1, n // slots_per_head, slots_per_head).mean(axis=1), (1, n // slots_per_head))
    else:
        ring_mass, slot_mass = ring_probs.mean(axis=2), own
    cache = cache.replace(
        pool_score=jnp.where(cache.pool_pos >= 0, ranking.update(cache.pool_score, slot_mass), 0.0),
        ring_head_score=ranking.update(ring_score, ring_mass),
    )
    return att.out, cache


def route_pool_row(row: Any, ranking: TokenRanking) -> Any:
    """Decode-time eviction for one batch row of the pool layout (uniform per-head slots).

    The tokens that left the recent region (``ring_candidates`` with W = 1) compete, head by head, with
    the head's ``pool_per_head`` slots: the top ``pool_per_head`` scores stay (ties: pool slots first, then
    older candidates), newcomers take the freed slots.
    """
    caps = row.caps
    slots_per_head = caps.pool_per_head
    cand_win, ring_slot = ring_candidates(row)  # [K]
    hkv, _, d = row.ring_k.shape
    cand_k = row.ring_k[:, ring_slot]  # [Hkv, K, D]
    cand_v = row.ring_v[:, ring_slot]
    # each candidate is a window of one token of one KV head: k [Hkv, K, 1, 1, D]
    cand_score = ranking.candidate_score(row.ring_head_score[:, ring_slot], cand_k[:, :, None, None])  # [Hkv, K]
    cand_pos = caps.sink + cand_win

    def per_head(slot_pos, slot_score, c_score):
        valid = jnp.concatenate([slot_pos >= 0, cand_win >= 0])
        score = jnp.concatenate([slot_score, c_score]).astype(jnp.float32)
        keep = valid & (_rank(jnp.where(valid, score, -jnp.inf)) < slots_per_head)
        keep_slot, keep_cand = jnp.split(keep, [slots_per_head])
        target = assign_slots(~keep_slot, keep_cand)  # [K], slots_per_head = none
        new_pos = jnp.where(keep_slot, slot_pos, -1).at[target].set(cand_pos, mode="drop")
        new_score = jnp.where(keep_slot, slot_score, 0.0).at[target].set(c_score, mode="drop")
        return new_pos, new_score, target, jnp.sum(valid & ~keep, dtype=jnp.int32)

    pos, score, target, gone = jax.vmap(per_head)(
        row.pool_pos.reshape(hkv, slots_per_head), row.pool_score.reshape(hkv, slots_per_head), cand_score
    )
    slot = (jnp.arange(hkv)[:, None] * slots_per_head + jnp.where(target < slots_per_head, target, hkv * slots_per_head)).reshape(-1)
    pool_k = row.pool_k.at[slot].set(cand_k.reshape(-1, d).astype(row.pool_k.dtype), mode="drop")
    pool_v = row.pool_v.at[slot].set(cand_v.reshape(-1, d).astype(row.pool_v.dtype), mode="drop")
    row = row.replace(
        pool_k=pool_k,
        pool_v=pool_v,
        pool_pos=pos.reshape(-1),
        pool_score=score.reshape(-1),
        evictions=row.evictions + gone.sum(),
    )
    return mark_routed(row, cand_win)
