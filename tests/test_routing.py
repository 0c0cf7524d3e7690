"""Routing: plan invariants over many random score sequences, and data migration (bit-exact ledger reuse)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.config import ModelConfig
from qevict_jax.config import Capacities, ring_capacity
from qevict_jax.routing import plan_routing, route_row
from qevict_jax.scoring import Ranking
from qevict_jax.tiered import init_cache

# (NF, NL, NQ, K): F slots, ledger slots, max active Q, candidates per event
SHAPES = [(3, 5, 3, 2), (0, 4, 4, 2), (4, 0, 0, 3), (2, 6, 3, 4), (5, 3, 3, 1)]


@functools.cache
def jitted_plan(nq: int, promotion: bool):
    return jax.jit(functools.partial(plan_routing, nq=nq, promotion=promotion))


def reference_assignment(entries, nf, nq, promotion):
    """entries: list of (window, score, was_q) in plan order -> (set in F, set in Q) by stable ranking."""
    order = sorted(range(len(entries)), key=lambda i: -entries[i][1])  # sorted() is stable
    f_set, q_set = set(), set()
    for i in order:
        win, _, was_q = entries[i]
        if len(f_set) < nf and (promotion or not was_q):
            f_set.add(win)
    for i in order:
        win = entries[i][0]
        if win not in f_set and len(q_set) < nq:
            q_set.add(win)
    return f_set, q_set


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    promotion=st.booleans(),
    seed=st.integers(0, 2**31),
    events=st.integers(1, 25),
)
def test_plan_invariants_over_random_score_sequences(shape, promotion, seed, events):
    nf, nl, nq, k = shape
    plan_fn = jitted_plan(nq, promotion)
    rng = np.random.default_rng(seed)
    fp_win = np.full(nf, -1, np.int32)
    fp_score = np.zeros(nf, np.float32)
    led_win = np.full(nl, -1, np.int32)
    led_active = np.zeros(nl, bool)
    led_score = np.zeros(nl, np.float32)
    evicted: set[int] = set()
    next_win = 0
    for _ in range(events):
        n_cand = int(rng.integers(0, k + 1))
        cand_win = np.full(k, -1, np.int32)
        cand_win[:n_cand] = np.arange(next_win, next_win + n_cand)
        next_win += n_cand
        # ties are frequent on purpose (coarse scores), and scores of resident windows drift randomly
        cand_score = rng.integers(0, 4, k).astype(np.float32)
        fp_score = np.where(fp_win >= 0, rng.integers(0, 4, nf), 0).astype(np.float32)
        led_score = np.where(led_active, rng.integers(0, 4, nl), 0).astype(np.float32)
        entries = [(int(w), float(s), False) for w, s in zip(fp_win, fp_score, strict=True) if w >= 0]
        entries += [
            (int(w), float(s), True) for w, s, a in zip(led_win, led_score, led_active, strict=True) if a
        ]
        entries += [(int(w), float(s), False) for w, s in zip(cand_win, cand_score, strict=True) if w >= 0]
        was_q = {int(w) for w, a in zip(led_win, led_active, strict=True) if a}
        old_dormant = {
            int(w): i for i, (w, a) in enumerate(zip(led_win, led_active, strict=True)) if w >= 0 and not a
        }
        old_led_win = led_win.copy()
        want_f, want_q = reference_assignment(entries, nf, nq, promotion)

        plan = jax.tree.map(
            np.asarray, plan_fn(fp_win, fp_score, led_win, led_active, led_score, cand_win, cand_score)
        )
        fp_win, fp_score, led_win, led_active, led_score = (
            plan.fp_win,
            plan.fp_score,
            plan.led_win,
            plan.led_active,
            plan.led_score,
        )
        in_f = {int(w) for w in fp_win if w >= 0}
        in_q = {int(w) for w, a in zip(led_win, led_active, strict=True) if a}
        dormant = [int(w) for w, a in zip(led_win, led_active, strict=True) if w >= 0 and not a]
        # capacities, no duplicates
        assert len(in_f) == int((fp_win >= 0).sum()) <= nf
        assert len(in_q) == int(led_active.sum()) <= nq
        assert len(set(dormant)) == len(dormant) and set(dormant) <= in_f  # dormant = copies of F windows
        assert not (led_active & (led_win < 0)).any()
        # top NF ranked windows in F, next NQ in Q, the rest evicted
        assert in_f == want_f and in_q == want_q
        evicted |= {w for w, _, _ in entries} - in_f - in_q
        # every window ever created is in exactly one state
        assert not (in_f & in_q) and not (in_f & evicted) and not (in_q & evicted)
        assert in_f | in_q | evicted == set(range(next_win))
        if not promotion:
            assert not (was_q & in_f)
        # a demoted window with a dormant entry reactivates that same slot (its first codes)
        for w, slot in old_dormant.items():
            if w in in_q:
                assert led_win[slot] == w and led_active[slot]
        # new ledger entries never displace an active entry: every active window kept its slot
        for i, w in enumerate(old_led_win):
            if w >= 0 and w in was_q and w in in_q:
                assert led_win[i] == w
        # counters
        assert int(plan.promotions) == len(was_q & in_f)
        assert int(plan.evictions) == len({w for w, _, _ in entries} - in_f - in_q)


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
        local_k=k[None],
        local_v=v[None],
        loc_score=jnp.asarray([[2.0, 1.0]]),
        length=jnp.asarray([length], jnp.int32),
    )


@functools.cache
def jitted_route(promotion: bool):
    ranking = Ranking("cumulative")
    return jax.jit(jax.vmap(lambda row: route_row(row, INV_FREQ, ranking, promotion)))


def slot_of(win_arr, w):
    idx = np.flatnonzero(np.asarray(win_arr) == w)
    assert idx.size == 1, (win_arr, w)
    return int(idx[0])


def set_scores(cache, f_score: float, q_score: float):
    return cache.replace(
        fp_score=jnp.full_like(cache.fp_score, f_score), led_score=jnp.full_like(cache.led_score, q_score)
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_promote_demote_cycles_are_bit_exact_and_never_drift(seed):
    route = jitted_route(True)
    cache = two_window_row(seed)
    ring_k = np.asarray(cache.local_k[0])
    cache = route(cache)  # window 0 (score 2) -> F, window 1 (score 1) -> Q
    assert int(cache.next_win[0]) == 2 and int(cache.fp_win[0, 0]) == 0
    # candidate -> F is a copy; positions are never renumbered: F holds window 0's own tokens
    np.testing.assert_array_equal(np.asarray(cache.fp_k[0, :, 0]), ring_k[:, 0:W])
    l1 = slot_of(cache.led_win[0], 1)
    first_codes = {
        n: np.asarray(getattr(cache, n)[0, :, l1]) for n in ("led_kc", "led_ks", "led_kz", "led_vc")
    }

    f_copies = []
    for _ in range(4):
        # window 1 rises: promoted (dequantized into F, ledger entry dormant); window 0 demoted
        cache = route(set_scores(cache, 0.0, 5.0))
        assert int(cache.fp_win[0, 0]) == 1 and int(cache.promotions[0]) >= 1
        l1_now = slot_of(cache.led_win[0], 1)
        assert l1_now == l1 and not bool(cache.led_active[0, l1])  # dormant, same slot
        f_copies.append(np.asarray(cache.fp_k[0, :, 0]))
        # window 1 falls: demoted again, reactivating the dormant entry (bit for bit)
        cache = route(set_scores(cache, 0.0, 5.0))
        assert int(cache.fp_win[0, 0]) == 0
        assert bool(cache.led_active[0, l1]) and int(cache.led_win[0, l1]) == 1
        for name, codes in first_codes.items():
            np.testing.assert_array_equal(np.asarray(getattr(cache, name)[0, :, l1]), codes)
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
        assert int(cache.fp_win[0, 0]) == 0  # the Q window's score is higher, but it stays in Q
        assert int(cache.led_win[0, slot_of(cache.led_win[0], 1)]) == 1
    assert int(cache.promotions[0]) == 0
