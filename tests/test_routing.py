"""Routing: plan invariants over many random score sequences, and data migration (bit-exact ledger reuse)."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.config import ModelConfig
from qevict_jax.core.cache import init_cache
from qevict_jax.core.config import Capacities, ring_capacity
from qevict_jax.core.q_keys import q_key
from qevict_jax.engines.migrate import ROUTING_CHUNK, route_row, route_stacked
from qevict_jax.engines.routing import NormScores, plan_counts, plan_routing, plan_row
from qevict_jax.rankings.scoring import Ranking

# (NF, NL, NQ, K): F slots, ledger slots, max active Q, candidates per event
SHAPES = [(3, 5, 3, 2), (0, 4, 4, 2), (4, 0, 0, 3), (2, 6, 3, 4), (5, 3, 3, 1)]


NUM_WINDOWS = 128  # window ids of the random sequences stay below this


def plan_of(*metadata, norms=None, **options):
    """``plan_routing`` of the seven metadata arrays in order: the tiers', then cand_win and cand_score;
    norms: the three key-norm score arrays (F, ledger, candidates) or None."""
    *tiers, cand_win, cand_score = metadata
    norms = None if norms is None else NormScores(*norms)
    return plan_routing(*tiers, cand_win=cand_win, cand_score=cand_score, norms=norms, **options)


@functools.cache
def jitted_plan(nq: int, promotion: bool, spill: int = 0, q_rank: str = "score", q_spill: int | None = None):
    return jax.jit(
        functools.partial(
            plan_of, nq=nq, promotion=promotion, spill=spill, num_windows=NUM_WINDOWS, q_rank=q_key(q_rank),
            q_spill=q_spill,
        )  # fmt: skip
    )


def stable_order(keys):
    """Entry indices by descending key, ties in entry order (sorted() is stable)."""
    return sorted(range(len(keys)), key=lambda i: -keys[i])


def reference_assignment(
    entries, nf, nq, nl, promotion, with_dormant=frozenset(), spill=0, q_rank="score", norm=None, q_spill=None
):
    """Tiers after one event by stable ranking: (set in F, set in Q).

    entries: list of (window, score, was_q) in plan order; with_dormant: F windows holding a dormant entry.
    The Q tier holds min(nq, nl - dormant entries after the event): F windows staying in F that hold one,
    plus the Q windows promoted to F. spill: a window is ranked by the highest score among itself and the
    entries of the ``spill`` window ids before it. q_rank: the Q tier's key among the windows not in F:
    the same key ("score"), ``norm`` [window -> key-norm score] spilled the same way ("keynorm"), or the
    better of the two rank shares among those windows ("blend"); q_spill: the spill of the Q tier's keys
    (None: ``spill``).
    """
    spilled = lambda value, n: [max(value[v] for v, _, _ in entries if w - n <= v <= w) for w, _, _ in entries]
    own = {v: s for v, s, _ in entries}
    key = spilled(own, spill)
    q_spill = spill if q_spill is None else q_spill
    q_key = spilled(own, q_spill)
    f_set, q_set = set(), set()
    for i in stable_order(key):
        win, _, was_q = entries[i]
        if len(f_set) < nf and (promotion or not was_q):
            f_set.add(win)
    kept_dormant = sum(1 for win, _, was_q in entries if win in f_set and (was_q or win in with_dormant))
    q_cap = min(nq, nl - kept_dormant)
    rest = [i for i, (win, _, _) in enumerate(entries) if win not in f_set]
    if q_rank == "score":
        order = [rest[j] for j in stable_order([q_key[i] for i in rest])]
    else:
        # the key norm spills as the Q tier's score does
        norm_key = spilled(norm, q_spill)
        by_norm = stable_order([norm_key[i] for i in rest])
        if q_rank == "keynorm":
            order = [rest[j] for j in by_norm]
        else:
            share = lambda ranked: {rest[j]: r / len(rest) for r, j in enumerate(ranked)}
            s_share, n_share = share(stable_order([q_key[i] for i in rest])), share(by_norm)
            order = [rest[j] for j in stable_order([-min(s_share[i], n_share[i]) for i in rest])]
    for i in order:
        if len(q_set) < q_cap:
            q_set.add(entries[i][0])
    return f_set, q_set


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    promotion=st.booleans(),
    seed=st.integers(0, 2**31),
    events=st.integers(1, 25),
    spill=st.sampled_from([0, 1, 2]),
    q_rank=st.sampled_from(["score", "keynorm", "blend"]),
    q_spill=st.sampled_from([None, 0, 2]),
)
def test_plan_invariants_over_random_score_sequences(shape, promotion, seed, events, spill, q_rank, q_spill):
    nf, nl, nq, k = shape
    plan_fn = jitted_plan(nq, promotion, spill, q_rank, q_spill)
    rng = np.random.default_rng(seed)
    # every window's key-norm score, fixed at its creation (coarse: ties are frequent)
    norm = {w: float(x) for w, x in enumerate(rng.integers(-4, 0, NUM_WINDOWS))}
    ledger_norm = np.zeros(nl, np.float32)
    f_win = np.full(nf, -1, np.int32)
    f_score = np.zeros(nf, np.float32)
    ledger_win = np.full(nl, -1, np.int32)
    ledger_active = np.zeros(nl, bool)
    ledger_score = np.zeros(nl, np.float32)
    evicted: set[int] = set()
    quantized: set[int] = set()  # windows that ever had a ledger entry
    next_win = 0
    for _ in range(events):
        n_cand = int(rng.integers(0, k + 1))
        cand_win = np.full(k, -1, np.int32)
        cand_win[:n_cand] = np.arange(next_win, next_win + n_cand)
        next_win += n_cand
        # ties are frequent on purpose (coarse scores), and scores of resident windows drift randomly
        cand_score = rng.integers(0, 4, k).astype(np.float32)
        f_score = np.where(f_win >= 0, rng.integers(0, 4, nf), 0).astype(np.float32)
        ledger_score = np.where(ledger_active, rng.integers(0, 4, nl), 0).astype(np.float32)
        entries = [(int(w), float(s), False) for w, s in zip(f_win, f_score, strict=True) if w >= 0]
        entries += [
            (int(w), float(s), True) for w, s, a in zip(ledger_win, ledger_score, ledger_active, strict=True) if a
        ]
        entries += [(int(w), float(s), False) for w, s in zip(cand_win, cand_score, strict=True) if w >= 0]
        was_q = {int(w) for w, a in zip(ledger_win, ledger_active, strict=True) if a}
        old_dormant = {
            int(w): i for i, (w, a) in enumerate(zip(ledger_win, ledger_active, strict=True)) if w >= 0 and not a
        }
        old_led_win = ledger_win.copy()
        old_f = {int(w) for w in f_win if w >= 0}
        want_f, want_q = reference_assignment(
            entries, nf, nq, nl, promotion, frozenset(old_dormant), spill, q_rank, norm, q_spill
        )
        own = {w: sc for w, sc, _ in entries}

        norms = None
        if q_rank != "score":
            of = lambda wins: np.asarray([norm[int(w)] if w >= 0 else 0.0 for w in wins], np.float32)
            norms = (of(f_win), ledger_norm, of(cand_win))
        metadata = (f_win, f_score, ledger_win, ledger_active, ledger_score, cand_win, cand_score)
        plan = jax.tree.map(np.asarray, plan_fn(*metadata, norms=norms))
        if q_rank != "score":
            ledger_norm = plan.ledger_norm_score
            # an entry keeps the key-norm score of its window (active or dormant)
            assert all(ledger_norm[i] == norm[int(w)] for i, w in enumerate(plan.ledger_win) if w >= 0)
        f_win, f_score, ledger_win, ledger_active, ledger_score = (
            plan.f_win,
            plan.f_score,
            plan.ledger_win,
            plan.ledger_active,
            plan.ledger_score,
        )
        in_f = {int(w) for w in f_win if w >= 0}
        in_q = {int(w) for w, a in zip(ledger_win, ledger_active, strict=True) if a}
        dormant = [int(w) for w, a in zip(ledger_win, ledger_active, strict=True) if w >= 0 and not a]
        # capacities, no duplicates
        assert len(in_f) == int((f_win >= 0).sum()) <= nf
        assert len(in_q) == int(ledger_active.sum()) <= nq
        assert len(set(dormant)) == len(dormant) and set(dormant) <= in_f  # dormant = copies of F windows
        assert not (ledger_active & (ledger_win < 0)).any()
        # top NF ranked windows in F, next min(NQ, NL - dormant) in Q, the rest evicted; the scores they
        # keep are their own (the spilled key only ranks)
        assert in_f == want_f and in_q == want_q
        assert all(f_score[i] == own[int(w)] for i, w in enumerate(f_win) if w >= 0)
        assert all(ledger_score[i] == own[int(w)] for i, w in enumerate(ledger_win) if ledger_active[i])
        evicted |= {w for w, _, _ in entries} - in_f - in_q
        # every window ever created is in exactly one state
        assert not (in_f & in_q) and not (in_f & evicted) and not (in_q & evicted)
        assert in_f | in_q | evicted == set(range(next_win))
        if not promotion:
            assert not (was_q & in_f)
        # a dormant entry stays in its slot while its window stays in F, is reactivated in place when the
        # window is demoted (its first codes), and is freed with it when it is evicted
        for w, slot in old_dormant.items():
            if w in in_f:
                assert ledger_win[slot] == w and not ledger_active[slot]
            elif w in in_q:
                assert ledger_win[slot] == w and ledger_active[slot]
            else:
                assert w not in ledger_win
        # every quantized window in F keeps its codes (a dormant entry); so a window demoted F -> Q without
        # one was never quantized before
        assert {w for w in in_f if w in quantized} == set(dormant)
        for w in (old_f & in_q) - set(old_dormant):
            assert w not in quantized
        quantized |= in_q
        # new ledger entries never displace an active entry: every active window kept its slot
        for i, w in enumerate(old_led_win):
            if w >= 0 and w in was_q and w in in_q:
                assert ledger_win[i] == w
        # counters
        assert int(plan.promotions) == len(was_q & in_f)
        assert int(plan.evictions) == len({w for w, _, _ in entries} - in_f - in_q)


def run_plan(nq, promotion, fp, led, cand):
    """plan_routing on lists: fp [(win, score)], led [(win, active, score)], cand [(win, score)]."""
    i32 = lambda x: np.asarray(x, np.int32)
    f32 = lambda x: np.asarray(x, np.float32)
    plan = jitted_plan(nq, promotion)(
        i32([w for w, _ in fp]),
        f32([s for _, s in fp]),
        i32([w for w, _, _ in led]),
        np.asarray([a for _, a, _ in led], bool),
        f32([s for _, _, s in led]),
        i32([w for w, _ in cand]),
        f32([s for _, s in cand]),
    )
    return jax.tree.map(lambda x: np.asarray(x).tolist(), plan)


def test_full_ledger_evicts_the_lowest_q_window_instead_of_reclaiming_a_dormant_entry():
    # NF=2, NL=3, nq=2: F windows 10 and 11 both hold dormant entries (slots 0, 1), window 20 is in Q.
    # Candidate 30 outranks 20. The old policy kept Q = {20, 30} and put 30 into slot 0, dropping window
    # 10's codes; now Q gets min(2, 3 - 2) = 1 window: 30 takes the slot of the evicted 20.
    plan = run_plan(
        2,
        True,
        fp=[(10, 9.0), (11, 8.0)],
        led=[(10, False, 0.0), (11, False, 0.0), (20, True, 3.0)],
        cand=[(30, 4.0)],
    )
    assert plan.f_win == [10, 11] and plan.f_score == [9.0, 8.0]
    assert plan.ledger_win == [10, 11, 30] and plan.ledger_active == [False, False, True]
    assert plan.ledger_score == [0.0, 0.0, 4.0]
    assert plan.admit_q_slot == [2] and plan.admit_f_slot == [2] and plan.demote_slot == [3, 3]
    assert (plan.promotions, plan.demotions, plan.evictions) == (0, 0, 1)


def test_a_promotion_in_the_event_shrinks_q_and_keeps_every_dormant_entry():
    # NF=2, NL=3, nq=2. F: 11 (score 9, dormant entry in slot 0), 10 (score 1, never quantized). Q: 20
    # (score 8, slot 1), 21 (score 5, slot 2). Candidate 30 (score 6). Ranking 11, 20, 30, 21, 10: F = {11,
    # 20} (20 promoted: slot 1 turns dormant), so Q holds min(2, 3 - 2) = 1 window: 30; 21 and 10 are
    # evicted. The old policy kept Q = {30, 21} and gave 30 the dormant slot 0 of window 11.
    plan = run_plan(
        2,
        True,
        fp=[(11, 9.0), (10, 1.0)],
        led=[(11, False, 0.0), (20, True, 8.0), (21, True, 5.0)],
        cand=[(30, 6.0)],
    )
    assert plan.f_win == [11, 20] and plan.f_score == [9.0, 8.0]
    assert plan.promote_slot == [2, 1, 2]
    assert plan.ledger_win == [11, 20, 30] and plan.ledger_active == [False, False, True]
    assert plan.admit_q_slot == [2] and plan.admit_f_slot == [2]
    assert (plan.promotions, plan.demotions, plan.evictions) == (1, 0, 2)


def test_a_window_evicted_from_f_frees_its_dormant_entry_for_a_newcomer():
    # NF=2, NL=3, nq=3. F: 10 (score 1, dormant entry in slot 2), 11 (score 2, never quantized). Q: 20
    # (score 9, slot 0); slot 1 is free. Candidates 30 (score 8), 31 (score 7). Ranking 20, 30, 31, 11, 10:
    # F = {20, 30} (20 promoted: slot 0 turns dormant), Q holds min(3, 3 - 1) = 2: 31 and 11; 10 is evicted
    # and its dormant slot 2 freed. Newcomers in order F slots, candidates: 11 -> slot 1, 31 -> slot 2.
    plan = run_plan(
        3,
        True,
        fp=[(10, 1.0), (11, 2.0)],
        led=[(20, True, 9.0), (-1, False, 0.0), (10, False, 0.0)],
        cand=[(30, 8.0), (31, 7.0)],
    )
    assert plan.f_win == [20, 30] and plan.promote_slot == [0, 2, 2] and plan.admit_f_slot == [1, 2]
    assert plan.ledger_win == [20, 11, 31] and plan.ledger_active == [False, True, True]
    assert plan.demote_slot == [3, 1] and plan.admit_q_slot == [3, 2]
    assert (plan.promotions, plan.demotions, plan.evictions) == (1, 1, 1)


def test_a_demotion_reactivates_its_dormant_entry_in_place():
    # as above but window 10 scores 6: ranking 20, 30, 31, 10, 11. F = {20, 30}, Q = {31, 10} (capacity
    # min(3, 3 - 1) = 2); 10 reactivates slot 2 (no data moves: demote_slot none), 31 takes the free slot 1,
    # 11 (never quantized) is evicted.
    plan = run_plan(
        3,
        True,
        fp=[(10, 6.0), (11, 2.0)],
        led=[(20, True, 9.0), (-1, False, 0.0), (10, False, 0.0)],
        cand=[(30, 8.0), (31, 7.0)],
    )
    assert plan.f_win == [20, 30]
    assert plan.ledger_win == [20, 31, 10] and plan.ledger_active == [False, True, True]
    assert plan.ledger_score == [0.0, 7.0, 6.0]
    assert plan.demote_slot == [3, 3] and plan.admit_q_slot == [3, 1]
    assert (plan.promotions, plan.demotions, plan.evictions) == (1, 1, 1)


def test_without_promotion_the_q_capacity_is_nq():
    # NF=1, NL=3, nq=2; no dormant entry can exist. F: 10 (score 4). Q: 20 (9, slot 0), 21 (3, slot 1).
    # Candidate 30 (5). F takes the top of F ∪ candidates: 30; Q the top 2 of the rest: 20, 10 (slot 2
    # stays free: the cap is nq); 21 is evicted and 10 is quantized into its freed slot 1.
    plan = run_plan(
        2,
        False,
        fp=[(10, 4.0)],
        led=[(20, True, 9.0), (21, True, 3.0), (-1, False, 0.0)],
        cand=[(30, 5.0)],
    )
    assert plan.f_win == [30] and plan.admit_f_slot == [0] and plan.promote_slot == [1, 1, 1]
    assert plan.ledger_win == [20, 10, -1] and plan.ledger_active == [True, True, False]
    assert plan.demote_slot == [1] and plan.admit_q_slot == [3]
    assert (plan.promotions, plan.demotions, plan.evictions) == (0, 1, 1)


# ------------------------------------------------------------------------------------- data migration

MODEL = ModelConfig(
    family="llama",
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
W = 4
CAPS = Capacities(
    sink=2, window=W, recent=0, ring=ring_capacity(0, W, 4), nf=1, nq=1, nl=2, nw_max=8, bits=2, omega=4
)
INV_FREQ = jnp.asarray(MODEL.inv_freq(), jnp.float32)


def two_window_row(seed: int):
    """A one-row batch (no [L] axis) whose ring holds windows 0 and 1 (positions 2..9), nothing routed yet."""
    cache = jax.tree.map(lambda x: x[0], init_cache(CAPS, MODEL, 1, jnp.float32))
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((MODEL.num_kv_heads, CAPS.ring, MODEL.head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((MODEL.num_kv_heads, CAPS.ring, MODEL.head_dim)), jnp.float32)
    length = CAPS.sink + 2 * W
    return cache.replace(
        ring_k=k[None],
        ring_v=v[None],
        ring_score=jnp.asarray([[2.0, 1.0]]),
        length=jnp.asarray([length], jnp.int32),
    )


@functools.cache
def jitted_route(promotion: bool):
    ranking = Ranking()
    return jax.jit(jax.vmap(lambda row: route_row(row, INV_FREQ, ranking, promotion)))


CODE_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


def slot_of(win_arr, w):
    idx = np.flatnonzero(np.asarray(win_arr) == w)
    assert idx.size == 1, (win_arr, w)
    return int(idx[0])


def set_scores(cache, f_score: float, q_score: float):
    return cache.replace(
        f_score=jnp.full_like(cache.f_score, f_score),
        ledger=cache.ledger.replace(score=jnp.full_like(cache.ledger.score, q_score)),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_promote_demote_cycles_are_bit_exact_and_never_drift(seed):
    route = jitted_route(True)
    cache = two_window_row(seed)
    ring_k = np.asarray(cache.ring_k[0])
    cache = route(cache)  # window 0 (score 2) -> F, window 1 (score 1) -> Q
    assert int(cache.next_win[0]) == 2 and int(cache.f_win[0, 0]) == 0
    # candidate -> F is a copy; positions are never renumbered: F holds window 0's own tokens
    np.testing.assert_array_equal(np.asarray(cache.f_k[0, :, 0]), ring_k[:, 0:W])
    l1 = slot_of(cache.ledger.win[0], 1)
    codes_of = lambda c: {n: np.asarray(getattr(c.ledger.codes, n)[0, :, l1]) for n in CODE_NAMES}
    first_codes = codes_of(cache)

    f_copies = []
    for _ in range(4):
        # window 1 rises: promoted (dequantized into F, ledger entry dormant); window 0 demoted
        cache = route(set_scores(cache, 0.0, 5.0))
        assert int(cache.f_win[0, 0]) == 1 and int(cache.promotions[0]) >= 1
        l1_now = slot_of(cache.ledger.win[0], 1)
        assert l1_now == l1 and not bool(cache.ledger.active[0, l1])  # dormant, same slot
        f_copies.append(np.asarray(cache.f_k[0, :, 0]))
        # window 1 falls: demoted again, reactivating the dormant entry (bit for bit)
        cache = route(set_scores(cache, 0.0, 5.0))
        assert int(cache.f_win[0, 0]) == 0
        assert bool(cache.ledger.active[0, l1]) and int(cache.ledger.win[0, l1]) == 1
        for name, codes in codes_of(cache).items():
            np.testing.assert_array_equal(codes, first_codes[name])
    for copy in f_copies[1:]:
        np.testing.assert_array_equal(copy, f_copies[0])  # no drift: N cycles == 1 cycle
    # the promoted copy is the dequantized, re-rotated ledger window: close to the original keys
    assert np.max(np.abs(f_copies[0] - ring_k[:, W : 2 * W])) < 2.0
    assert int(cache.routing_events[0]) == 9
    assert int(cache.demotions[0]) == 8 and int(cache.promotions[0]) == 8


def test_without_promotion_q_never_returns_to_f():
    route = jitted_route(False)
    cache = route(two_window_row(3))
    for _ in range(3):
        cache = route(set_scores(cache, 0.0, 100.0))
        assert int(cache.f_win[0, 0]) == 0  # the Q window's score is higher, but it stays in Q
        assert int(cache.ledger.win[0, slot_of(cache.ledger.win[0], 1)]) == 1
    assert int(cache.promotions[0]) == 0


# ------------------------------------------------------------------------------- route_stacked's paths

BIG = Capacities(
    sink=2, window=W, recent=0, ring=ring_capacity(0, W, 4), nf=12, nq=12, nl=24, nw_max=64, bits=2, omega=4
)


def promoting_cache(promotions: list[int]) -> object:
    """A stacked cache [L=1, B] whose F tier holds windows 0..11 (score 1, never quantized) and whose Q tier
    holds windows 12..23 (row b: ``promotions[b]`` of them score 5, the rest 0.5): an event promotes that
    many Q windows and demotes (quantizes afresh) as many F windows. No candidates."""
    b = len(promotions)
    rng = np.random.default_rng(7)
    cache = init_cache(BIG, MODEL, b, jnp.float32)
    rand = lambda x, lo, hi: jnp.asarray(rng.uniform(lo, hi, x.shape), x.dtype)
    codes = cache.ledger.codes
    codes = codes.replace(
        **{n: jnp.asarray(rng.integers(0, 256, getattr(codes, n).shape), jnp.uint8) for n in ("k_codes", "v_codes")},
        **{n: rand(getattr(codes, n), 0.05, 0.2) for n in ("k_scale", "v_scale")},
        **{n: rand(getattr(codes, n), -0.5, 0.5) for n in ("k_zero", "v_zero")},
    )  # fmt: skip
    q_score = np.full((1, b, BIG.nl), 0.0, np.float32)
    for row, p in enumerate(promotions):
        q_score[0, row, :12] = [5.0] * p + [0.5] * (12 - p)
    wins = np.arange(BIG.nl)
    return cache.replace(
        f_k_words=rand(cache.f_k_words, -2, 2),
        f_v_words=rand(cache.f_v_words, -2, 2),
        f_win=jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (1, b, 12)),
        f_score=jnp.ones((1, b, 12), jnp.float32),
        ledger=cache.ledger.replace(
            codes=codes,
            win=jnp.asarray(np.broadcast_to(np.where(wins < 12, wins + 12, -1), (1, b, BIG.nl)), jnp.int32),
            active=jnp.asarray(np.broadcast_to(wins < 12, (1, b, BIG.nl))),
            score=jnp.asarray(q_score),
        ),
        next_win=jnp.full((1, b), 24, jnp.int32),
        length=jnp.full((1, b), BIG.sink + 24 * W, jnp.int32),
    )


@pytest.mark.parametrize("promotions", [[0, 0], [1, 0], [2, 1], [5, 2], [8, 3], [11, 4]])
def test_route_stacked_takes_a_path_that_holds_the_event_and_equals_the_full_path(promotions):
    """Events needing 0, 1-2, 3-8 and 11 F windows moved in some row (no move loop iteration, one, several;
    ``ROUTING_CHUNK`` = 2): the stacked event equals every row routed by ``route_row``, bit for bit, and the
    same event passed ``due=True`` too; ``due=False`` leaves the cache as it was."""
    cache = promoting_cache(promotions)
    ranking = Ranking()
    rows = lambda f: jax.vmap(jax.vmap(f))
    plans = rows(lambda r: plan_row(r, ranking, True)[0])(cache)
    assert np.asarray(plan_counts(plans, BIG.nl))[0].tolist() == promotions
    assert np.asarray(plans.promotions)[0].tolist() == promotions
    got = jax.jit(lambda c: route_stacked(c, INV_FREQ, ranking, True))(cache)
    want = jax.jit(rows(lambda r: route_row(r, INV_FREQ, ranking, True)))(cache)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(got.promotions)[0].tolist() == promotions
    assert ROUTING_CHUNK == 2  # the cases above cover 0, 1 and several iterations
    when = jax.jit(lambda c, due: route_stacked(c, INV_FREQ, ranking, True, due))
    for a, b in zip(jax.tree.leaves(when(cache, jnp.bool_(True))), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(when(cache, jnp.bool_(False))), jax.tree.leaves(cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_trace_per_shape_of_the_plan():
    """The plan is traced once for a shape whatever the metadata (``chex.assert_max_traces``), and a new
    shape is a new trace, which the guard reports."""
    nf, nl, nq, k = 3, 5, 3, 2

    @jax.jit
    @chex.assert_max_traces(n=1)
    def plan(*metadata):
        return plan_of(*metadata, nq=nq, promotion=True, spill=0, num_windows=NUM_WINDOWS)

    rng = np.random.default_rng(0)
    for event in range(4):  # different ids, scores and activity: the same program
        f_win = np.where(rng.random(nf) < 0.7, rng.permutation(NUM_WINDOWS)[:nf], -1).astype(np.int32)
        ledger_win = np.where(rng.random(nl) < 0.5, NUM_WINDOWS - 1 - np.arange(nl), -1).astype(np.int32)
        out = plan(
            f_win, rng.random(nf).astype(np.float32), ledger_win, ledger_win >= 0, rng.random(nl).astype(np.float32),
            np.array([event, -1], np.int32), rng.random(k).astype(np.float32),
        )  # fmt: skip
        chex.assert_shape((out.f_win, out.ledger_win, out.ledger_active), [(nf,), (nl,), (nl,)])
    with pytest.raises(AssertionError, match="traced > 1"):
        plan(*(np.zeros(n, dt) for n, dt in [(nf + 1, np.int32), (nf + 1, np.float32), (nl, np.int32),
                                              (nl, bool), (nl, np.float32), (k, np.int32), (k, np.float32)]))  # fmt: skip


@pytest.mark.parametrize("q_rank", ["score", "keynorm"])
def test_a_decode_event_ranks_q_by_the_key_norm_of_the_ring_windows(q_rank):
    """A decode event over three ring windows scored 3, 2, 1 (NF = NQ = NL = 1), window 1's keys five times
    larger: F takes window 0 either way; Q takes window 1 by score, window 2 by key norm, which the ledger
    stores (float64 numpy norms of the ring's keys)."""
    caps = dataclasses.replace(CAPS, ring=ring_capacity(0, W, 8), nq=1, nl=1, omega=8, q_rank=q_key(q_rank))
    cache = jax.tree.map(lambda x: x[0], init_cache(caps, MODEL, 1, jnp.float32))
    rng = np.random.default_rng(5)
    k = rng.standard_normal((MODEL.num_kv_heads, caps.ring, MODEL.head_dim))
    k[:, W : 2 * W] *= 5.0
    cache = cache.replace(
        ring_k=jnp.asarray(k, jnp.float32)[None],
        ring_v=jnp.asarray(rng.standard_normal(k.shape), jnp.float32)[None],
        ring_score=jnp.asarray([[3.0, 2.0, 1.0]]),
        length=jnp.asarray([caps.sink + 3 * W], jnp.int32),
    )
    row = jax.jit(jax.vmap(lambda r: route_row(r, INV_FREQ, Ranking(), True)))(cache)
    assert int(row.f_win[0, 0]) == 0
    want = 1 if q_rank == "score" else 2
    assert np.asarray(row.ledger.win[0]).tolist() == [want] and bool(row.ledger.active[0, 0])
    if q_rank == "keynorm":
        norm = -np.linalg.norm(k[:, want * W : (want + 1) * W], axis=-1).mean()
        np.testing.assert_allclose(np.asarray(row.ledger.norm_score[0]), [norm], rtol=1e-5)
    else:
        assert row.ledger.norm_score.shape == (1, 0)
