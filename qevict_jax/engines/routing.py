"""Routing plans of the window engine (docs/design.md §7): which tier every window goes to, decided on metadata
alone; ``migrate`` moves the data as a plan says.

``plan_routing`` works on one batch row's metadata (window ids and scores of F slots, ledger slots and
candidate windows) and decides the new tier of every window, which slots newcomers go to, and the new
metadata; it is cheap and testable on its own. ``plan_row`` gathers the candidates of a decode routing
event (``Candidates``: the windows that left the recent region) and plans them.

Ranking: F ∪ active Q ∪ candidates by score (stable: ties keep the order F slots, ledger slots,
candidates). Top NF -> F, next NQ -> Q (fewer when dormant entries fill the ledger, see below), the rest
are evicted. Without promotion, Q windows are not eligible for F: F takes the top NF of F ∪ candidates,
then Q the top NQ of everything left.

Ledger: an entry is free (win -1), active (in Q) or dormant (the codes of a window promoted to F, kept so
that its next demotion reactivates them bit for bit). A window's codes are computed once, when it is first
quantized (candidate -> Q, or the first F -> Q of a window that came into F as a candidate), and they are
the only codes it ever has until it is evicted: a dormant entry is never reclaimed while its window is in
F; it is freed when the window is evicted from F and reactivated when the window is demoted to Q. The
ledger room is shared instead: the Q tier holds at most ``min(nq, NL - dormant)`` windows, dormant = the
entries that are dormant after the event (F windows staying in F that have one, plus the Q windows
promoted in this event), so when the ledger is full the lowest-ranked Q window is evicted rather than a
dormant copy dropped. New entries only take free slots (lowest index first); active entries are never
displaced.

Hence a window demoted F -> Q without a dormant entry was never quantized before: a window enters F either
as a candidate (never quantized) or by promotion from Q (its entry turns dormant); it leaves F only to Q
(reactivating that entry) or to E (never to return); and while it stays in F its dormant entry stays. So
every F window that was ever quantized holds a dormant entry, and only the others are quantized at
demotion, from their F copy, which is the original KV (in the cache dtype). Re-quantizing a dequantized
copy, which would drift by one rounding per promote/demote cycle, never happens. Without promotion no
entry is ever dormant and the Q tier holds ``nq`` windows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from qevict_jax.core.q_keys import BY_SCORE, QKey
from qevict_jax.rankings.windows import key_norm_score, spilled_key


class Candidates(NamedTuple):
    """The windows an event routes, with their data: one row's k, v [Hkv, K, W, D] (post-RoPE keys) and win
    [K] window ids (-1 = none); batched rows carry leading axes."""

    k: jax.Array
    v: jax.Array
    win: jax.Array


class RoutingPlan(NamedTuple):
    """The outcome of one routing event for one batch row (NF F slots, NL ledger slots, K candidates).

    f_win, f_score: [NF] new F metadata. ledger_win, ledger_score: [NL]; ledger_active: [NL] bool.
    promote_slot: [NL] F slot receiving ledger slot l's window (promotion), NF = none.
    admit_f_slot: [K] F slot receiving candidate j, NF = none.
    demote_slot: [NF] ledger slot receiving F slot f's window freshly quantized, NL = none (a demotion that
        reactivates a dormant entry needs no data and has no target).
    admit_q_slot: [K] ledger slot receiving candidate j quantized, NL = none.
    promotions, demotions, evictions: [] int32 counts of Q->F, F->Q and windows evicted.
    ledger_norm_score: [NL | 0] new ``Ledger.norm_score`` (0 wide unless the Q tier is ranked by key norm).
    """

    f_win: jax.Array
    f_score: jax.Array
    ledger_win: jax.Array
    ledger_active: jax.Array
    ledger_score: jax.Array
    promote_slot: jax.Array
    admit_f_slot: jax.Array
    demote_slot: jax.Array
    admit_q_slot: jax.Array
    promotions: jax.Array
    demotions: jax.Array
    evictions: jax.Array
    ledger_norm_score: jax.Array


class NormScores(NamedTuple):
    """Minus the mean key norm of the windows of one routing event (``key_norm_score``), for a Q tier
    ranked by key norm (``q_keys.QKey.reads_key_norm``): f [NF] of the F slots, ledger [NL] as stored, cand [K]."""

    f: jax.Array
    ledger: jax.Array
    cand: jax.Array


def _rank(key: jax.Array) -> jax.Array:
    """Rank [N] of each entry by key [N], descending, ties in index order (0 = best)."""
    order = jnp.argsort(-key, stable=True)
    return jnp.zeros(key.shape, jnp.int32).at[order].set(jnp.arange(key.shape[0], dtype=jnp.int32))


def top_members(key: jax.Array, eligible: jax.Array, k: int, cap: jax.Array | int | None = None) -> jax.Array:
    """[N] bool: the ``min(k, cap)`` eligible entries with the largest ``key`` [N] (ties: lower index first,
    as a stable descending sort orders them). One ``lax.top_k`` instead of a sort of every entry."""
    n = key.shape[0]
    k = min(k, n)
    if k == 0:
        return jnp.zeros((n,), bool)
    vals, idx = jax.lax.top_k(jnp.where(eligible, key.astype(jnp.float32), -jnp.inf), k)
    take = vals > -jnp.inf
    if cap is not None:
        take &= jnp.arange(k) < cap
    return jnp.zeros((n,), bool).at[jnp.where(take, idx, n)].set(True, mode="drop") & eligible


def compact(mask: jax.Array, size: int) -> jax.Array:
    """Indices [size] of the first ``size`` True entries of ``mask`` [N], in order; N pads the rest."""
    n = mask.shape[0]
    rank = jnp.cumsum(mask.astype(jnp.int32)) - 1
    return (
        jnp.full((size,), n, jnp.int32)
        .at[jnp.where(mask, rank, size)]
        .set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    )


def assign_slots(free: jax.Array, newcomer: jax.Array) -> jax.Array:
    """Targets [M] for newcomers [M] bool among slots [N] where ``free`` [N] bool (N = none).

    The i-th newcomer gets the i-th free slot (index order). The caller guarantees enough free slots.
    """
    n = free.shape[0]
    if n == 0:
        return jnp.zeros(newcomer.shape, jnp.int32)
    slots = compact(free, n)
    rank = jnp.cumsum(newcomer.astype(jnp.int32)) - 1
    return jnp.where(newcomer, slots[jnp.clip(rank, 0, n - 1)], n)


def plan_routing(
    f_win: jax.Array,
    f_score: jax.Array,
    ledger_win: jax.Array,
    ledger_active: jax.Array,
    ledger_score: jax.Array,
    *,
    cand_win: jax.Array,
    cand_score: jax.Array,
    nq: int,
    promotion: bool,
    spill: int = 0,
    q_spill: int | None = None,
    num_windows: int = 0,
    q_rank: QKey = BY_SCORE,
    norms: NormScores | None = None,
) -> RoutingPlan:
    """Plan one routing event for one row.

    f_win, f_score: [NF] (win -1 = empty). ledger_win, ledger_score: [NL], ledger_active: [NL] bool.
    cand_win, cand_score: [K] (win -1 = no candidate). nq: the most active Q windows (<= NL); the Q tier
    holds at most ``min(nq, NL - dormant entries after the event)`` (see the module docstring).
    spill: windows are ranked by ``windows.spilled_key`` over the windows taking part (ids < num_windows);
    the scores the plan stores are the windows' own. q_spill: the spill of the Q tier's key (None: ``spill``).
    q_rank: the key of the Q tier among the windows not in F (``q_keys.QKey``: the ranking key as F's, the
    key norm, or a blend of the two); ``norms``: the windows' key-norm scores (needed when the Q key reads
    them, ``q_rank.reads_key_norm``).
    """
    nf, nl, k = f_win.shape[0], ledger_win.shape[0], cand_win.shape[0]
    f_valid = f_win >= 0
    q_valid = ledger_active & (ledger_win >= 0)
    c_valid = cand_win >= 0
    valid = jnp.concatenate([f_valid, q_valid, c_valid])
    score = jnp.concatenate([f_score, ledger_score, cand_score]).astype(jnp.float32)
    wins = jnp.concatenate([f_win, ledger_win, cand_win])
    key = spilled_key(wins, score, valid, spill, num_windows)
    is_q = jnp.concatenate([jnp.zeros(nf, bool), jnp.ones(nl, bool), jnp.zeros(k, bool)])
    f_eligible = valid if promotion else valid & ~is_q
    in_f = top_members(key, f_eligible, nf)
    f_in_f, q_in_f, c_in_f = jnp.split(in_f, [nf, nf + nl])

    # ledger: each F window's dormant entry, if it has one; which entries are dormant after the event
    dormant = (ledger_win >= 0) & ~ledger_active
    match = (f_win[:, None] == ledger_win[None, :]) & f_valid[:, None] & dormant[None, :]  # [NF, NL]
    has_dormant = match.any(axis=1)
    keep_dormant = (match & f_in_f[:, None]).any(axis=0)  # [NL] F window stays in F: entry stays dormant
    promoted = q_valid & q_in_f  # [NL] turns dormant
    # the Q tier gets the ledger room the dormant entries leave (a traced scalar, <= nq)
    q_cap = jnp.minimum(nq, nl - jnp.sum(keep_dormant | promoted, dtype=jnp.int32))

    q_eligible = valid & ~in_f
    q_spill = spill if q_spill is None else q_spill
    q_key = key if q_spill == spill else spilled_key(wins, score, valid, q_spill, num_windows)
    norm_key = None
    if q_rank.reads_key_norm:
        # spilled as the score is: a needle's continuation keeps the tier its start earns by key norm
        norm = jnp.concatenate([norms.f, norms.ledger, norms.cand])
        norm_key = spilled_key(wins, norm, valid, q_spill, num_windows)
    q_key = q_rank.key(q_key, norm_key, q_eligible)
    in_q = top_members(q_key, q_eligible, nq, q_cap)
    gone = valid & ~in_f & ~in_q
    f_in_q, q_in_q, c_in_q = jnp.split(in_q, [nf, nf + nl])
    f_gone, q_gone, _ = jnp.split(gone, [nf, nf + nl])
    q_score = ledger_score.astype(jnp.float32)

    # F slots: frees first (F -> Q, F -> E), then promotions and candidates take the free slots
    f_free = ~f_valid | f_in_q | f_gone
    f_new = jnp.concatenate([q_in_f, c_in_f])
    f_target = assign_slots(f_free, f_new)
    promote_slot, admit_f_slot = jnp.split(f_target, [nl])
    new_fp_win = jnp.where(f_in_f, f_win, -1)
    new_fp_win = new_fp_win.at[f_target].set(jnp.concatenate([ledger_win, cand_win]), mode="drop")
    new_fp_score = jnp.where(f_in_f, f_score, 0.0)
    new_fp_score = new_fp_score.at[f_target].set(jnp.concatenate([q_score, cand_score]), mode="drop")

    # ledger slots: everything not kept (evicted Q windows, dormant entries of windows evicted from F, free
    # slots, and any dormant entry without its F window) is free; newcomers take free slots only
    reactivate = (match & f_in_q[:, None]).any(axis=0)  # [NL]
    keep_active = q_valid & q_in_q
    freed = ~(keep_active | reactivate | keep_dormant | promoted)
    q_new = jnp.concatenate([f_in_q & ~has_dormant, c_in_q])
    q_target = assign_slots(freed, q_new)
    demote_slot, admit_q_slot = jnp.split(q_target, [nf])

    react_score = jnp.sum(jnp.where(match & f_in_q[:, None], f_score[:, None], 0.0), axis=0)
    new_led_win = jnp.where(freed, -1, ledger_win)
    new_led_win = new_led_win.at[q_target].set(jnp.concatenate([f_win, cand_win]), mode="drop")
    new_led_active = keep_active | reactivate
    new_led_active = new_led_active.at[q_target].set(True, mode="drop")
    new_led_score = jnp.where(reactivate, react_score, jnp.where(keep_active, q_score, 0.0))
    new_led_score = new_led_score.at[q_target].set(jnp.concatenate([f_score, cand_score]), mode="drop")

    # a window's key-norm score moves with its codes: set at quantization, kept while the entry is kept
    if norms is None:
        new_led_norm = jnp.zeros((0,), jnp.float32)
    else:
        new_led_norm = jnp.where(freed, 0.0, norms.ledger.astype(jnp.float32))
        new_led_norm = new_led_norm.at[q_target].set(jnp.concatenate([norms.f, norms.cand]), mode="drop")

    count = lambda x: jnp.sum(x, dtype=jnp.int32)
    return RoutingPlan(
        f_win=new_fp_win,
        f_score=new_fp_score,
        ledger_win=new_led_win,
        ledger_active=new_led_active,
        ledger_score=new_led_score,
        promote_slot=promote_slot,
        admit_f_slot=admit_f_slot,
        demote_slot=demote_slot,
        admit_q_slot=admit_q_slot,
        promotions=count(promoted),
        demotions=count(f_valid & f_in_q),
        evictions=count(gone),
        ledger_norm_score=new_led_norm,
    )


def plan_counts(plan: RoutingPlan, nl: int) -> jax.Array:
    """[...] int32: the F windows a plan quantizes (fresh demotions) or dequantizes (promotions), the larger."""
    fresh = jnp.sum(plan.demote_slot < nl, axis=-1, dtype=jnp.int32)
    return jnp.maximum(fresh, plan.promotions)


def ring_candidates(row: Any) -> tuple[jax.Array, jax.Array]:
    """Windows that left the recent region of one row: (cand_win [K] (-1 = none), ring window slot [K]).

    Window w is a candidate once it ends at least R tokens before the current length n
    (``S + (w + 1) W <= n - R``) and has not been routed yet (``w >= next_win``).
    """
    caps = row.caps
    k = caps.max_candidates
    first = row.next_win
    last = jnp.maximum(first, jnp.floor_divide(row.length - caps.sink - caps.recent, caps.window))
    wins = first + jnp.arange(k, dtype=jnp.int32)
    cand = jnp.where(wins < last, wins, -1)
    return cand, wins % caps.ring_windows


def plan_for_row(
    row: Any,
    cand_win: jax.Array,
    cand_score: jax.Array,
    promotion: bool,
    spill: int = 0,
    *,
    q_spill: int | None = None,
    cand_norm: jax.Array | None = None,
) -> RoutingPlan:
    """``plan_routing`` of one row of a ``TieredCache`` against candidates cand_win, cand_score [K];
    cand_norm [K]: their key-norm scores (``key_norm_score``), needed when ``caps.norm_scored``."""
    caps = row.caps
    norms = None
    if caps.norm_scored:
        norms = NormScores(key_norm_score(row.f_k.swapaxes(0, 1)), row.ledger.norm_score, cand_norm)
    return plan_routing(
        row.f_win,
        row.f_score,
        row.ledger.win,
        row.ledger.active,
        row.ledger.score,
        cand_win=cand_win,
        cand_score=cand_score.astype(jnp.float32),
        nq=row.caps.nq,
        promotion=promotion,
        spill=spill,
        q_spill=q_spill,
        num_windows=caps.nw_max,
        q_rank=caps.q_rank,
        norms=norms,
    )


def plan_row(row: Any, ranking: Any, promotion: bool) -> tuple[RoutingPlan, Candidates]:
    """The plan of one decode routing event for one row, and its candidates (the windows that left the
    recent region)."""
    caps = row.caps
    cand_win, ring_slot = ring_candidates(row)
    hkv, _, d = row.ring_k.shape
    cand_k = row.ring_k.reshape(hkv, caps.ring_windows, caps.window, d)[:, ring_slot]
    cand_v = row.ring_v.reshape(hkv, caps.ring_windows, caps.window, d)[:, ring_slot]
    cand_score = ranking.candidate_score(row.ring_score[ring_slot], cand_k.swapaxes(0, 1))
    cand_norm = key_norm_score(cand_k.swapaxes(0, 1)) if caps.norm_scored else None
    plan = plan_for_row(
        row, cand_win, cand_score, promotion, ranking.spill, q_spill=ranking.q_spill, cand_norm=cand_norm
    )
    return plan, Candidates(cand_k, cand_v, cand_win)


def idle_plan(row: Any) -> tuple[RoutingPlan, Candidates]:
    """``plan_row``'s outputs for a step without an event: nothing moves, the metadata stays, no candidate."""
    caps = row.caps
    nf, nl, k = row.f_win.shape[0], row.ledger.win.shape[0], caps.max_candidates
    hkv, _, d = row.ring_k.shape
    zero = jnp.int32(0)
    plan = RoutingPlan(
        f_win=row.f_win,
        f_score=row.f_score.astype(jnp.float32),
        ledger_win=row.ledger.win,
        ledger_active=row.ledger.active,
        ledger_score=row.ledger.score.astype(jnp.float32),
        promote_slot=jnp.full((nl,), nf, jnp.int32),
        admit_f_slot=jnp.full((k,), nf, jnp.int32),
        demote_slot=jnp.full((nf,), nl, jnp.int32),
        admit_q_slot=jnp.full((k,), nl, jnp.int32),
        promotions=zero,
        demotions=zero,
        evictions=zero,
        ledger_norm_score=row.ledger.norm_score,
    )
    cand = jnp.zeros((hkv, k, caps.window, d), row.ring_k.dtype)
    return plan, Candidates(cand, cand, jnp.full((k,), -1, jnp.int32))
