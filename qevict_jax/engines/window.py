"""The window engine (QEvict, R1-R4, StreamingLLM, KIVI): prefill compression into the F and Q tiers and
decode attention over sink | F | Q | ring (docs/design.md §6-§7); routing between the tiers is ``qevict_jax.engines.routing``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from models.model import LayerContext
from pallas_kernels.dispatch import ledger_attention
from pallas_kernels.fused_attention import fused_partials
from pallas_kernels.tiers import DenseTier, Partial, QuantTier, TierAttention, merge_tiers, tier_partials
from qevict_jax.core.cache import (
    TieredCache,
    fill_sink_and_ring,
    ring_positions,
    ring_valid,
    shared_prompt_attention,
    window_mask,
    write_token,
)
from qevict_jax.core.config import CacheConfig
from qevict_jax.core.sharding import REPLICATED, ROW_HEADS, ROWS, on_shards
from qevict_jax.engines.migrate import apply_plan
from qevict_jax.engines.routing import Candidates, RoutingPlan, compact, plan_for_row
from qevict_jax.rankings.scoring import PromptPass, Ranking
from qevict_jax.rankings.windows import key_norm_score, prompt_windows

# ---------------------------------------------------------------------------------------------- prefill


def prefill_layer(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: TieredCache,
    ctx: LayerContext,
    *,
    ranking: Ranking,
    config: CacheConfig,
) -> tuple[jax.Array, TieredCache]:
    """Prompt attention for one layer and routing of the prompt's KV into the tiers (docs/design.md §6).

    q [B, T, H, D], k, v [B, T, Hkv, D] post-RoPE, rows right-padded (row b: positions < cache.length[b]).
    Returns (out [B, T, H, D], cache). The ranking scores every prompt window, and the windows ending at
    least R tokens before the prompt end are placed by their ranking key (``windows.spilled_key``): top NF
    -> F, next NQ -> Q, rest evicted; the tail stays in the ring. ``config``: promotion, prefill_chunk.
    """
    caps = cache.caps
    s, w = caps.sink, caps.window
    b, t = q.shape[:2]
    lengths = cache.length
    out, mass, q, k, v = shared_prompt_attention(q, k, v, lengths, ctx, config.prefill_chunk)
    num_prompt_windows = max(0, -(-(t - s) // w))
    prompt = PromptPass.of_layer(q, k, v, lengths=lengths, column_mass=mass, ctx=ctx)
    scores = ranking.prefill_window_scores(
        prompt, sink=s, window=w, num_windows=num_prompt_windows
    )  # [B, NWP]

    routed = jnp.maximum(0, jnp.floor_divide(lengths - s - caps.recent, w))  # [B] windows leaving the prompt
    win_ids = jnp.arange(num_prompt_windows, dtype=jnp.int32)
    cand_win = jnp.where(win_ids[None] < routed[:, None], win_ids[None], -1)  # [B, NWP]
    # the tiers are empty: no window is demoted or promoted, so only candidates move (F copy or quantized)
    norms = None  # the prompt windows' key-norm scores, for a Q tier ranked by them
    if caps.norm_scored:
        norms = key_norm_score(prompt_windows(k, s, w, num_prompt_windows).swapaxes(2, 3))  # [B, NWP]
    plan = jax.vmap(
        lambda row, c_win, c_score, c_norm: plan_for_row(
            row, c_win, c_score, config.promotion, ranking.spill, q_spill=ranking.q_spill, cand_norm=c_norm
        )
    )(cache, cand_win, scores, norms)
    plan, kept = kept_windows(plan, cand_win, k, v, sink=s, window=w, nf=caps.nf, nl=caps.nl)
    cache = jax.vmap(lambda row, p, c: apply_plan(row, p, c, ctx.inv_freq, bound=0))(cache, plan, kept)

    # sinks and the ring tail
    cache, _ = fill_sink_and_ring(cache, k, v, lengths, routed)
    rw = caps.ring_windows
    slot_ids = jnp.arange(rw, dtype=jnp.int32)
    slot_win = routed[:, None] + jnp.mod(slot_ids[None] - routed[:, None], rw)  # [B, RW]
    ring_score = jnp.take_along_axis(
        jnp.pad(scores, ((0, 0), (0, 1))), jnp.clip(slot_win, 0, num_prompt_windows), axis=1
    )
    ring_score = jnp.where(s + slot_win * w < lengths[:, None], ring_score, 0.0)
    cache = cache.replace(ring_score=ring_score.astype(jnp.float32))
    return out, cache


def kept_windows(
    plan: RoutingPlan,
    cand_win: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    sink: int,
    window: int,
    nf: int,
    nl: int,
) -> tuple[RoutingPlan, Candidates]:
    """The prompt windows a prefill plan keeps, gathered from the prompt's K/V, and the plan over them.

    plan: [B]-batched ``RoutingPlan`` of the candidates cand_win [B, NWP] (-1 = none); k, v [B, T, Hkv, D].
    Only the M = min(NWP, NF + NL) windows that go to F or Q are copied out of k and v (the others are
    evicted and never read), so the placement's temporaries scale with the cache, not with the prompt.
    Returns (the plan with ``admit_f_slot``/``admit_q_slot`` over them [B, M]; the candidates: their keys and
    values [B, Hkv, M, W, D] and window ids [B, M], -1 = none).
    """
    b, num_prompt_windows = cand_win.shape
    m = min(num_prompt_windows, nf + nl)
    keep = (plan.admit_f_slot < nf) | (plan.admit_q_slot < nl)  # [B, NWP]
    pick = jax.vmap(lambda row: compact(row, m))(keep)  # [B, M], NWP = none
    sel = jnp.clip(pick, 0, max(num_prompt_windows - 1, 0))
    none = pick >= num_prompt_windows
    take = lambda a, fill: jnp.where(none, fill, jnp.take_along_axis(a, sel, axis=1))
    plan = plan._replace(admit_f_slot=take(plan.admit_f_slot, nf), admit_q_slot=take(plan.admit_q_slot, nl))
    tok = (sink + sel[:, :, None] * window + jnp.arange(window, dtype=jnp.int32)).reshape(b, m * window)
    tok = jnp.clip(tok, 0, k.shape[1] - 1)[:, :, None, None]

    def windows(x):  # [B, T, Hkv, D] -> [B, Hkv, M, W, D]
        xw = jnp.take_along_axis(x, tok, axis=1).reshape(b, m, window, *x.shape[2:])
        return xw.transpose(0, 3, 1, 2, 4)

    return plan, Candidates(windows(k), windows(v), take(cand_win, -1))


# ---------------------------------------------------------------------------------------------- decode


def tier_attention(
    q: jax.Array,
    cache: TieredCache,
    q_pos: jax.Array,
    inv_freq: jax.Array,
    sliding_window: int | None,
    use_kernel: bool = False,
) -> TierAttention:
    """Attention of one decode query per head q [B, Hkv, G, D] (post-RoPE, at q_pos [B]) over all tiers:
    the normalized output and the head-mean mass per sink token, F slot, ledger slot and ring window
    (``ring_mass`` [B, RW]: the ring's W-token windows, window w in slot w % RW).

    The cache must already hold the current token (in the sink or the ring) and ``length = q_pos + 1``.
    ``use_kernel``: the Pallas kernels (``pallas_kernels.fused_attention.fused_partials()``; not with a
    sliding window, whose token-level masks they do not take), else the jnp reference with the fastest
    ledger attention here. On a mesh (``sharding.mesh_context``) the partials run per shard.
    """
    caps = cache.caps
    s, w = caps.sink, caps.window
    b, nf = cache.f_win.shape
    sink_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    sink_ok = (sink_pos <= q_pos[:, None]) & window_mask(q_pos, sink_pos, sliding_window)
    f_ok = cache.f_win >= 0  # [B, NF]
    if sliding_window is not None:
        f_pos = (s + cache.f_win[:, :, None] * w + jnp.arange(w, dtype=jnp.int32)).reshape(b, nf * w)
        f_ok = f_ok[:, :, None] & window_mask(q_pos, f_pos, sliding_window).reshape(b, nf, w)
    ledger = cache.ledger
    start = ledger.slot_start(s, w)
    # a Q window takes part while its last token is inside the sliding window (slot granularity)
    ledger_ok = ledger.active & window_mask(q_pos, start + w - 1, sliding_window)
    ring_pos = ring_positions(cache.length, caps)
    ring_ok = ring_valid(cache.length, cache.next_win, caps) & window_mask(q_pos, ring_pos, sliding_window)
    tiers = (
        DenseTier(cache.sink_k, cache.sink_v, sink_ok),
        DenseTier(cache.f_k, cache.f_v, f_ok),
        QuantTier(ledger.codes, start, ledger_ok),
        DenseTier(cache.ring_k, cache.ring_v, ring_ok),
    )
    if use_kernel and sliding_window is None:
        partials = functools.partial(fused_partials(), window=w, fmt=caps.format)
    else:
        partials = functools.partial(
            tier_partials, window=w, fmt=caps.format, ledger_attention=ledger_attention
        )
    # on a mesh every device attends over its own rows and KV heads (the kernels have no partitioning rule:
    # XLA would gather the tiers); the merge, a softmax combine per head and a head mean, runs after
    dense = DenseTier(ROW_HEADS, ROW_HEADS, ROWS)
    specs = (ROW_HEADS, (dense, dense, QuantTier(ROW_HEADS, ROWS, ROWS), dense), REPLICATED)

    def shard_partials(q_, tiers_, f):
        sink, f_tier, q_tier, ring = partials(q_, *tiers_, f)
        # the ring's mass per window (all the scores take), summed before the head mean: on a mesh the
        # cross-device reduction of the masses carries W times fewer ring values
        ring = ring._replace(mass=ring.mass.reshape(*ring.mass.shape[:-1], -1, w).sum(-1))
        return [sink, f_tier, q_tier, ring]

    per_shard = on_shards(
        shard_partials,
        in_specs=specs,
        out_specs=[Partial(ROW_HEADS, ROW_HEADS, ROW_HEADS, ROW_HEADS)] * 4,
    )
    return merge_tiers(
        per_shard(q, tiers, inv_freq),
        head_mean=not caps.deferred_head_mean,
        q_logit_bias=caps.q_logit_bias,
        biased_mass=caps.q_biased_mass,
        q_bias_gate=caps.q_bias_gate,
    )


def decode_layer(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: TieredCache,
    ctx: LayerContext,
    *,
    ranking: Ranking,
    use_kernel: bool = False,
) -> tuple[jax.Array, TieredCache]:
    """One decode step of one layer: q [B, 1, H, D], k, v [B, 1, Hkv, D] post-RoPE -> (out [B, 1, H, D],
    cache).

    Writes the token into the sink or the ring, attends over all tiers (``tier_attention``), adds the
    head-mean window masses to the scores (the routing event every Ω steps runs after the layer scan:
    ``decode_route``). ``use_kernel``: attend with the Pallas kernels.
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
    cache = cache.replace(ring_score=jnp.where(fresh, 0.0, cache.ring_score))
    qg = q[:, 0].reshape(b, hkv, h // hkv, d)
    att = tier_attention(qg, cache, pos, ctx.inv_freq, ctx.cfg.sliding_window, use_kernel)
    # deferred head mean: per KV head, on its own device, the scores take this step's dynamics with no mass
    # (a linear ranking's update(s, m) = update(s, 0) + update(0, m)) and the running masses take the mass
    deferred = caps.deferred_head_mean
    mass = lambda m, score: jnp.zeros_like(score) if deferred else m
    cache = cache.replace(
        f_score=ranking.update(cache.f_score, mass(att.f_mass, cache.f_score)),
        ledger=cache.ledger.replace(
            score=ranking.update(cache.ledger.score, mass(att.q_mass, cache.ledger.score))
        ),
        ring_score=ranking.update(cache.ring_score, mass(att.ring_mass, cache.ring_score)),  # [B, RW]
        steps=cache.steps + 1,
    )
    if deferred:
        cache = cache.replace(
            f_pending=ranking.update(cache.f_pending, att.f_mass),
            q_pending=ranking.update(cache.q_pending, att.q_mass),
            ring_pending=ranking.update(jnp.where(fresh[:, None], 0.0, cache.ring_pending), att.ring_mass),
        )
    return att.out.reshape(b, 1, h, d).astype(q.dtype), cache


def fold_head_means(cache: TieredCache, due: jax.Array | None = None) -> TieredCache:
    """The scores with the head mean of the running masses (``caps.deferred_head_mean``) added and the
    running masses zeroed, when ``due`` [] bool holds (None: always); the cache unchanged otherwise. Any
    layout whose KV-head axis is the one before the last (one layer [B, Hkv, N], stacked [L, B, Hkv, N]).

    With ``due`` the fold is a conditional over the score arrays alone: on a mesh that splits the KV heads
    its cross-device mean runs on routing steps only, and the tier buffers are not operands of the branch."""
    if not cache.caps.deferred_head_mean:
        return cache

    def fold(parts):
        scores, pending = parts
        summed = tuple(s + jnp.mean(p, axis=-2) for s, p in zip(scores, pending, strict=True))
        return summed, tuple(jnp.zeros_like(p) for p in pending)

    parts = (
        (cache.f_score, cache.ledger.score, cache.ring_score),
        (cache.f_pending, cache.q_pending, cache.ring_pending),
    )
    scores, pending = fold(parts) if due is None else jax.lax.cond(due, fold, lambda x: x, parts)
    return cache.replace(
        f_score=scores[0],
        ledger=cache.ledger.replace(score=scores[1]),
        ring_score=scores[2],
        f_pending=pending[0],
        q_pending=pending[1],
        ring_pending=pending[2],
    )
