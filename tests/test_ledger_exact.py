"""The ledger stays bit-exact: over thousands of random routing events on a (nearly always) full ledger,
with promotions and demotions, every window's ledger codes are the codes of its first quantization, and
a promoted window's F copy is their dequantization. With a Q tier ranked by key norm (``q_rank`` "blend", the
default's), each entry's key-norm score is likewise the one taken at its first quantization.

The code under test is ``plan_routing`` + ``apply_plan`` on a real one-row ``TieredCache``; the references
are computed independently: each window's codes by ``quantize_windows`` of its original KV (one window at
a time), tiers by a stable-sort ranking in Python.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_routing import reference_assignment

from models.config import ModelConfig
from qevict_jax.core.cache import init_cache
from qevict_jax.core.config import Capacities, ring_capacity
from qevict_jax.core.q_keys import q_key
from qevict_jax.engines.migrate import apply_plan, dequantize_windows, quantize_windows
from qevict_jax.engines.routing import Candidates, plan_counts, plan_for_row
from qevict_jax.rankings.windows import key_norm_score

W, D, NF, NQ, K = 8, 8, 3, 4, 2
# QuantizedWindows leaves, in order (k_mean: the centered format's only)
CODE_FIELDS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_mean")


def named(codes: tuple) -> dict:
    """One window's code leaves by field name."""
    return dict(zip(CODE_FIELDS[: len(codes)], codes, strict=True))
MODEL = ModelConfig(
    family="llama",
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=2,
    head_dim=D,
)
INV_FREQ = jnp.asarray(MODEL.inv_freq(), jnp.float32)


def caps_for(nl: int, quant: str = "channel", q_rank: str = "score") -> Capacities:
    return Capacities(
        sink=2,
        window=W,
        recent=0,
        ring=ring_capacity(0, W, 8),
        nf=NF,
        nq=NQ,
        nl=nl,
        nw_max=10**6,
        bits=2,
        omega=8,
        quant=quant,
        q_rank=q_key(q_rank),
    )


def mean_key_norm(k: np.ndarray) -> float:
    """Minus the mean L2 norm of a window's keys k [Hkv, W, D] (float64)."""
    return -float(np.mean(np.linalg.norm(k.astype(np.float64), axis=-1)))


@functools.cache
def jitted_event(nl: int, promotion: bool, quant: str, q_rank: str):
    """One routing event of one row: (row, cand_win [K], cand_score [K], cand_k, cand_v) -> (row, plan,
    the row moved on the bounded path with bound 1, whether the plan fits that bound)."""

    def event(row, cand_win, cand_score, cand_k, cand_v):
        cand_norm = key_norm_score(cand_k.swapaxes(0, 1)) if q_rank != "score" else None  # [K]
        plan = plan_for_row(row, cand_win, cand_score, promotion, cand_norm=cand_norm)
        candidates = Candidates(cand_k, cand_v, cand_win)
        full = apply_plan(row, plan, candidates, INV_FREQ)
        bounded = apply_plan(row, plan, candidates, INV_FREQ, bound=1)
        return full, plan, bounded, plan_counts(plan, nl) <= 1

    return jax.jit(event)


@functools.cache
def jitted_reference(nl: int, quant: str):
    """Reference codes of one window and their dequantization: (k, v [Hkv, W, D], start) -> (codes, k, v)."""
    fmt = caps_for(nl, quant).format

    def ref(k, v, start):
        codes = quantize_windows(k[:, None], v[:, None], start[None], INV_FREQ, fmt)
        dk, dv = dequantize_windows(codes, start[None], INV_FREQ, fmt)
        return tuple(c[:, 0] for c in jax.tree.leaves(codes)), dk[:, 0], dv[:, 0]

    return jax.jit(ref)


@pytest.mark.parametrize(
    "reserve, dtype, promotion, events, quant, q_rank",
    [
        (1, jnp.float32, True, 2500, "channel", "score"),
        (2, jnp.bfloat16, True, 1500, "channel", "score"),
        (1, jnp.float32, False, 400, "channel", "score"),
        (1, jnp.bfloat16, True, 1000, "rot-k4v3", "score"),
        (1, jnp.bfloat16, True, 1000, "kch2-rotv3", "score"),
        (1, jnp.bfloat16, True, 1000, "crot-k4v3", "score"),
        (1, jnp.bfloat16, True, 1000, "crot-k4v3", "blend"),  # the default qevict's
    ],
)
def test_ledger_codes_are_first_codes_forever(reserve, dtype, promotion, events, quant, q_rank):
    nl = NQ + reserve
    caps = caps_for(nl, quant, q_rank)
    hkv = MODEL.num_kv_heads
    step = jitted_event(nl, promotion, quant, q_rank)
    reference = jitted_reference(nl, quant)
    row = jax.tree.map(lambda x: x[0, 0], init_cache(caps, MODEL, 1, dtype))
    rng = np.random.default_rng(1234 + reserve)

    orig: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # window -> its KV in the cache dtype, float32
    ref_codes: dict[int, tuple[np.ndarray, ...]] = {}
    ref_deq: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # dequantized codes, in the cache dtype
    first_codes: dict[int, tuple[np.ndarray, ...]] = {}  # codes seen at a window's first ledger entry
    first_norm: dict[int, float] = {}  # key-norm score of a window's keys when it was first quantized
    ever_quantized: set[int] = set()
    ever_promoted: set[int] = set()
    evicted: set[int] = set()
    next_win = 0
    promotions = demotions = full_events = dormant_events = bounded_events = 0

    for _ in range(events):
        # resident windows' scores drift (coarse: ties are frequent), new candidates with random KV
        f_win, ledger_win = np.asarray(row.f_win), np.asarray(row.ledger.win)
        ledger_active = np.asarray(row.ledger.active)
        f_score = np.where(f_win >= 0, rng.integers(0, 6, NF), 0).astype(np.float32)
        ledger_score = np.where(ledger_active, rng.integers(0, 6, nl), 0).astype(np.float32)
        row = row.replace(
            f_score=jnp.asarray(f_score), ledger=row.ledger.replace(score=jnp.asarray(ledger_score))
        )
        n_cand = int(rng.integers(0, K + 1))
        cand_win = np.full(K, -1, np.int32)
        cand_win[:n_cand] = np.arange(next_win, next_win + n_cand)
        cand_score = rng.integers(0, 6, K).astype(np.float32)
        kv = rng.standard_normal((2, hkv, K, W, D)).astype(np.float32) * 2.0
        kv = np.asarray(jnp.asarray(kv).astype(dtype).astype(jnp.float32))  # the ring holds the cache dtype
        for j in range(n_cand):
            w = next_win + j
            orig[w] = (kv[0, :, j], kv[1, :, j])
            codes, dk, dv = reference(*map(jnp.asarray, orig[w]), jnp.int32(caps.sink + w * W))
            ref_codes[w] = tuple(np.asarray(c) for c in codes)
            ref_deq[w] = (np.asarray(dk.astype(dtype)), np.asarray(dv.astype(dtype)))
        next_win += n_cand

        old_f = {int(w) for w in f_win if w >= 0}
        old_active = {int(w) for w, a in zip(ledger_win, ledger_active, strict=True) if a}
        old_dormant = {
            int(w): i for i, (w, a) in enumerate(zip(ledger_win, ledger_active, strict=True)) if w >= 0 and not a
        }
        entries = [(int(w), float(s), False) for w, s in zip(f_win, f_score, strict=True) if w >= 0]
        entries += [
            (int(w), float(s), True) for w, s, a in zip(ledger_win, ledger_score, ledger_active, strict=True) if a
        ]
        entries += [(int(w), float(s), False) for w, s in zip(cand_win, cand_score, strict=True) if w >= 0]
        norm = None
        if q_rank != "score":  # F windows by their F copy's keys, Q entries as stored, candidates by their keys
            old_f_k = np.asarray(row.f_k.astype(jnp.float32))
            norm = {int(w): mean_key_norm(old_f_k[:, i]) for i, w in enumerate(f_win) if w >= 0}
            norm |= {w: first_norm[w] for w in old_active}
            norm |= {next_win - n_cand + j: mean_key_norm(kv[0, :, j]) for j in range(n_cand)}
        want_f, want_q = reference_assignment(
            entries, NF, NQ, nl, promotion, frozenset(old_dormant), q_rank=q_rank, norm=norm
        )

        row, _, bounded, fits = step(
            row, jnp.asarray(cand_win), jnp.asarray(cand_score), jnp.asarray(kv[0]), jnp.asarray(kv[1])
        )
        # the bounded path (quantize / dequantize only the windows that move) gives the same row, bit for bit
        if fits:
            bounded_events += 1
            chex.assert_trees_all_equal(row, bounded)
        f_win, ledger_win = np.asarray(row.f_win), np.asarray(row.ledger.win)
        ledger_active = np.asarray(row.ledger.active)
        f_k = np.asarray(row.f_k.astype(jnp.float32))
        f_v = np.asarray(row.f_v.astype(jnp.float32))
        ledger = [np.asarray(x) for x in jax.tree.leaves(row.ledger.codes)]
        ledger_norm = np.asarray(row.ledger.norm_score)

        in_f = [int(w) for w in f_win if w >= 0]
        in_q = [int(w) for w, a in zip(ledger_win, ledger_active, strict=True) if a]
        dormant = [int(w) for w, a in zip(ledger_win, ledger_active, strict=True) if w >= 0 and not a]
        # capacities; no window twice in a tier; no window in two tiers except a dormant copy of an F window
        assert len(in_f) == len(set(in_f)) <= NF
        assert len(in_q) == len(set(in_q)) <= NQ
        assert len(dormant) == len(set(dormant)) and set(dormant) <= set(in_f)
        assert not set(in_f) & set(in_q)
        assert not (ledger_active & (ledger_win < 0)).any()
        # tiers follow the ranking with Q capacity min(NQ, NL - dormant)
        assert set(in_f) == want_f and set(in_q) == want_q
        # a window never returns after eviction
        evicted |= {w for w, _, _ in entries} - set(in_f) - set(in_q)
        assert not evicted & (set(in_f) | set(in_q))
        assert set(in_f) | set(in_q) | evicted == set(range(next_win))
        if not promotion:
            assert not dormant and not old_active & set(in_f)

        # dormant entries stay put while their window is in F, and are reactivated in place
        for w, slot in old_dormant.items():
            if w in in_f or w in in_q:
                assert ledger_win[slot] == w and bool(ledger_active[slot]) == (w in in_q)
        # a window demoted F -> Q without a dormant entry was never quantized before
        for w in (old_f & set(in_q)) - set(old_dormant):
            assert w not in ever_quantized
        # every ever-quantized window in F holds its codes in a dormant entry
        assert {w for w in in_f if w in ever_quantized} == set(dormant)

        # every ledger entry (active or dormant) holds exactly the first codes of its window
        for slot, w in enumerate(ledger_win):
            if w < 0:
                continue
            w = int(w)
            codes = tuple(x[:, slot] for x in ledger)
            if w not in first_codes:
                assert w not in ever_quantized
                first_codes[w] = codes
                ever_quantized.add(w)
                if q_rank != "score":  # quantized from its F copy (never promoted) or from the candidate
                    first_norm[w] = mean_key_norm(orig[w][0])
            if q_rank != "score":  # the key-norm score of its first quantization, kept with its codes
                assert ledger_norm[slot] == pytest.approx(first_norm[w], rel=1e-5), ("norm", w)
            # a window's codes are its first codes, and those of the reference quantizer, bit for bit
            chex.assert_trees_all_equal(named(codes), named(first_codes[w]))
            chex.assert_trees_all_equal(named(codes), named(ref_codes[w]))
        # F copies: a promoted window holds the dequantization of its first codes, the others their own KV
        ever_promoted |= old_active & set(in_f)
        for slot, w in enumerate(f_win):
            if w < 0:
                continue
            want_k, want_v = ref_deq[int(w)] if w in ever_promoted else orig[int(w)]
            assert np.array_equal(f_k[:, slot], want_k), ("f_k", int(w))
            assert np.array_equal(f_v[:, slot], want_v), ("f_v", int(w))

        promotions += len(old_active & set(in_f))
        demotions += len(old_f & set(in_q))
        # full: every ledger slot used (with promotion), or the Q tier at its capacity NQ (without)
        full_events += bool((ledger_win >= 0).all()) if promotion else len(in_q) == NQ
        dormant_events += bool(dormant)

    assert int(row.promotions) == promotions and int(row.demotions) == demotions
    # the checks above are not vacuous
    assert demotions > events // 10 and full_events > events // 4 and bounded_events > events // 4
    if promotion:
        assert promotions > events // 10 and dormant_events > events // 4
        # re-promotions of the same window happened (its F copy was rebuilt from the same codes)
        assert len(ever_promoted) < promotions
