"""Migration of windows between the tiers (docs/design.md §7): the fixed-shape moves that carry out a routing plan
(``routing.plan_routing``): candidates to Q, demotions F -> Q, promotions Q -> F, candidates to F, then the
metadata. Frees come before allocations, scatters use ``.at[].set(mode="drop")``, and a window's codes are
computed only at its first quantization (the ledger's invariant, see ``routing``)."""

from __future__ import annotations

from typing import TypeVar

import jax
import jax.numpy as jnp

from pallas_kernels.formats import QuantFormat
from pallas_kernels.quant import QuantizedWindows
from qevict_jax.core.cache import SinkRingCache, TieredCache
from qevict_jax.core.kv import from_words, to_words
from qevict_jax.engines.routing import Candidates, RoutingPlan, compact, idle_plan, plan_row
from qevict_jax.rankings.scoring import Ranking

RowT = TypeVar("RowT", bound=SinkRingCache)
"""One batch row of either engine's cache (``mark_routed`` serves both)."""


def quantize_windows(
    k: jax.Array, v: jax.Array, starts: jax.Array, inv_freq: jax.Array, fmt: QuantFormat
) -> QuantizedWindows:
    """Ledger codes of windows k, v [Hkv, N, W, D] (keys post-RoPE, first positions ``starts`` [N]) in the
    ledger format ``fmt``. Returns ``QuantizedWindows`` [Hkv, N, ...]."""
    return fmt.encode(k, v, starts, inv_freq)


def dequantize_windows(
    codes: QuantizedWindows, starts: jax.Array, inv_freq: jax.Array, fmt: QuantFormat
) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``quantize_windows``: (post-RoPE keys, values), each [Hkv, N, W, D] float32."""
    return fmt.decode(codes, starts, inv_freq)


def apply_plan(
    row: TieredCache, plan: RoutingPlan, candidates: Candidates, inv_freq: jax.Array, *,
    bound: int | None = None,
) -> TieredCache:
    """Move the data of one row as ``plan`` says; returns the row with new F, ledger and metadata.

    row: one batch row of a ``TieredCache`` (fields without the [B] axis). candidates: the plan's
    candidate windows. bound: quantize and dequantize at most this many F
    windows (the fresh F -> Q demotions and the Q -> F promotions), or as many as there are F slots when
    None; the caller guarantees that the plan's counts fit (``plan_counts``). Both give the same row.
    """
    nf, nl = row.f_win.shape[0], row.ledger.win.shape[0]
    m = nf if bound is None else min(bound, nf)
    row = quantize_candidates(row, plan, candidates, inv_freq)
    if nl and m:
        row = demote_chunk(row, plan, jnp.int32(0), m, inv_freq)
        row = promote_chunk(row, plan, jnp.int32(0), m, inv_freq)
    return place_candidates(row, plan, candidates)


def _chunk(mask: jax.Array, chunk: jax.Array, m: int) -> jax.Array:
    """Entries [chunk * m, chunk * m + m) of the indices where ``mask`` [N] holds, in order (N = none)."""
    n = mask.shape[0]
    return jax.lax.dynamic_slice(compact(mask, -(-n // m) * m), (chunk * m,), (m,))


def demote_chunk(
    row: TieredCache, plan: RoutingPlan, chunk: jax.Array, m: int, inv_freq: jax.Array
) -> TieredCache:
    """Quantize chunk ``chunk`` ([] int32) of ``m`` of the row's fresh F -> Q demotions into their ledger slots.

    Reads F, writes only ledger slots the plan freed (never a promoted window's entry), so every chunk of
    demotions can run before any promotion overwrites an F slot."""
    caps = row.caps
    nf, nl = row.f_win.shape[0], row.ledger.win.shape[0]
    dtype = row.ring_k.dtype  # the KV dtype: the F tier is stored as its words (``TieredCache.f_k_words``)
    sel = _chunk(plan.demote_slot < nl, chunk, m)  # [m] F slots (NF = none)
    fsel = jnp.minimum(sel, nf - 1)
    k, v = from_words(row.f_k_words[:, fsel], dtype), from_words(row.f_v_words[:, fsel], dtype)
    entries = quantize_windows(k, v, caps.sink + row.f_win[fsel] * caps.window, inv_freq, caps.format)
    target = jnp.where(sel < nf, plan.demote_slot[fsel], nl)
    return row.replace(ledger=row.ledger.replace(codes=row.ledger.codes.put(target, entries)))


def promote_chunk(
    row: TieredCache, plan: RoutingPlan, chunk: jax.Array, m: int, inv_freq: jax.Array
) -> TieredCache:
    """Dequantize chunk ``chunk`` ([] int32) of ``m`` of the row's Q -> F promotions into their F slots.

    Reads the ledger (promoted entries stay, dormant), writes F; the row's metadata is still the old one."""
    caps = row.caps
    nf, nl = row.f_win.shape[0], row.ledger.win.shape[0]
    dtype = row.ring_k.dtype
    src = jnp.full((nf,), nl, jnp.int32).at[plan.promote_slot].set(jnp.arange(nl, dtype=jnp.int32), mode="drop")
    dest = _chunk(src < nl, chunk, m)  # [m] F slots receiving a promoted window (NF = none)
    lsel = jnp.minimum(src[jnp.minimum(dest, nf - 1)], nl - 1)
    k, v = dequantize_windows(
        row.ledger.codes.take(lsel), caps.sink + row.ledger.win[lsel] * caps.window, inv_freq, caps.format
    )
    return row.replace(
        f_k_words=row.f_k_words.at[:, dest].set(to_words(k, dtype), mode="drop"),
        f_v_words=row.f_v_words.at[:, dest].set(to_words(v, dtype), mode="drop"),
    )


def quantize_candidates(
    row: TieredCache, plan: RoutingPlan, candidates: Candidates, inv_freq: jax.Array
) -> TieredCache:
    """Candidates going to Q quantized into their ledger slots. The first move of an event: the
    slots are ones the plan freed, distinct from the demotions' and never a promoted window's entry."""
    caps = row.caps
    if not row.ledger.win.shape[0]:
        return row
    c = candidates
    entries = quantize_windows(c.k, c.v, caps.sink + c.win * caps.window, inv_freq, caps.format)
    return row.replace(ledger=row.ledger.replace(codes=row.ledger.codes.put(plan.admit_q_slot, entries)))


def place_candidates(row: TieredCache, plan: RoutingPlan, candidates: Candidates) -> TieredCache:
    """The last move of an event: candidates going to F copied into their slots (after the
    demotions read theirs), and the plan's metadata and counts."""
    dtype = row.ring_k.dtype
    f_k, f_v = row.f_k_words, row.f_v_words
    if row.f_win.shape[0]:
        f_k = f_k.at[:, plan.admit_f_slot].set(to_words(candidates.k, dtype), mode="drop")
        f_v = f_v.at[:, plan.admit_f_slot].set(to_words(candidates.v, dtype), mode="drop")
    return row.replace(
        f_k_words=f_k,
        f_v_words=f_v,
        f_win=plan.f_win,
        f_score=plan.f_score.astype(row.f_score.dtype),
        ledger=row.ledger.replace(
            win=plan.ledger_win,
            active=plan.ledger_active,
            score=plan.ledger_score.astype(row.ledger.score.dtype),
            norm_score=plan.ledger_norm_score.astype(row.ledger.norm_score.dtype),
        ),
        promotions=row.promotions + plan.promotions,
        demotions=row.demotions + plan.demotions,
        evictions=row.evictions + plan.evictions,
    )


ROUTING_CHUNK = 2
"""Windows per row quantized or dequantized per iteration of an event's move loops (``route_stacked``). A
decode event moves one or two windows in a row (measured on SmolLM2 at 2K: the most of any row was 1-2 in
14 of 16 events, 4 in the other two); an event after an appended chunk may move many and loops more."""


def finish_row(
    row: TieredCache, plan: RoutingPlan, candidates: Candidates, inv_freq: jax.Array, *,
    bound: int | None = None,
) -> TieredCache:
    """``apply_plan``, then mark the candidates routed and count the event."""
    return mark_routed(apply_plan(row, plan, candidates, inv_freq, bound=bound), candidates.win)


def mark_routed(row: RowT, cand_win: jax.Array, counted: jax.Array | bool = True) -> RowT:
    """One row after a routing event over candidates cand_win [K] (-1 = none): they left the ring
    (``next_win`` past them) and, when ``counted``, the event is counted. Either engine's row
    (``SinkRingCache``)."""
    new_next = jnp.maximum(row.next_win, jnp.max(jnp.where(cand_win >= 0, cand_win + 1, 0)))
    return row.replace(next_win=new_next, routing_events=row.routing_events + jnp.int32(counted))


def route_row(
    row: TieredCache, inv_freq: jax.Array, ranking: Ranking, promotion: bool
) -> TieredCache:
    """One decode routing event for one batch row of a ``TieredCache`` (fields without the [B] axis)."""
    return finish_row(row, *plan_row(row, ranking, promotion), inv_freq)


def route_stacked(
    cache: TieredCache,
    inv_freq: jax.Array,
    ranking: Ranking,
    promotion: bool,
    due: jax.Array | None = None,
) -> TieredCache:
    """One routing event of every layer and row of a stacked ``TieredCache`` ([L, B] leading axes).

    due: [] bool, whether the event happens (a decode step calls this every step); None = it does. Every row
    is planned first (under a ``lax.cond`` on ``due``, which only reads the cache; the idle plan moves
    nothing). The data then moves in loops of ``ROUTING_CHUNK`` windows per row, as many iterations as the
    busiest row needs (none on an idle step): candidates to Q, all fresh demotions, all promotions, candidates to F.
    The moves are not inside a conditional on purpose: XLA copies every buffer a conditional branch scatters
    into (the whole F tier and ledger, most of an event's time at 8K), and a while loop updates its carry in
    place. Gives the same cache as ``route_row`` on every row.
    """
    rows = lambda f: jax.vmap(jax.vmap(f))
    plan_all = rows(lambda r: plan_row(r, ranking, promotion))
    if due is None:
        due = jnp.bool_(True)
        plan, candidates = plan_all(cache)
    else:
        plan, candidates = jax.lax.cond(due, plan_all, rows(idle_plan), cache)
    nf, nl = cache.caps.nf, cache.caps.nl
    m = min(ROUTING_CHUNK, nf)
    cache = rows(lambda r, p, c: quantize_candidates(r, p, c, inv_freq))(cache, plan, candidates)
    if nl and m:
        iterations = lambda n: (jnp.max(n) + m - 1) // m

        def moves(step):
            return lambda i, c: rows(lambda r, p: step(r, p, i, m, inv_freq))(c, plan)

        cache = jax.lax.fori_loop(
            0, iterations(jnp.sum(plan.demote_slot < nl, axis=-1)), moves(demote_chunk), cache
        )
        cache = jax.lax.fori_loop(0, iterations(plan.promotions), moves(promote_chunk), cache)
    return rows(lambda r, p, c: mark_routed(place_candidates(r, p, c), c.win, due))(cache, plan, candidates)
