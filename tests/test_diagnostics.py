"""The diagnostics (``qevict_jax.diagnostics``): every metric against hand-computed values on tiny synthetic
traces (censoring, windows that never return, an empty Q tier), invariants by hypothesis, and the traces and
``qevict diagnose`` on a tiny random model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qevict_jax.cli import build_parser
from qevict_jax.diagnostics import metrics as M
from qevict_jax.diagnostics.metrics import LOCAL, E, F, Q
from qevict_jax.diagnostics.report import passage_metrics
from qevict_jax.diagnostics.run import cmd_diagnose
from qevict_jax.diagnostics.trace import passages, policy_trace, reference_trace, window_mass
from qevict_jax.eval.testing import ByteTokenizer, tiny_model
from qevict_jax.methods.registry import make_method

# ---------------------------------------------------------------------------------------------- tier mass


def test_tier_mass_hand_computed():
    # G = 4 steps, Ω = 2 -> events 0 (steps 0, 1) and 1 (steps 2, 3); L = 1, NW = 3
    tiers = np.array([[[F, Q, E]], [[F, E, E]]], np.int8)
    mass = np.array(
        [
            [[0.5, 0.2, 0.1]],
            [[0.4, 0.4, 0.0]],
            [[0.3, 0.3, 0.3]],
            [[0.6, 0.0, 0.2]],
        ]
    )
    total = np.ones((4, 1))
    got = M.tier_mass(mass, total, tiers, omega=2)
    # F: (0.5 + 0.4 + 0.3 + 0.6) / 4; Q: (0.2 + 0.4) / 4; E: (0.1 + 0 + 0.6 + 0.2) / 4
    assert got["F"] == pytest.approx(1.8 / 4)
    assert got["Q"] == pytest.approx(0.6 / 4)
    assert got["E"] == pytest.approx(0.9 / 4)
    assert got["local"] == pytest.approx(1 - 3.3 / 4)
    hist = M.historical_shares(got)
    assert hist == pytest.approx({"F": 1.8 / 3.3, "Q": 0.6 / 3.3, "E": 0.9 / 3.3})
    assert np.isnan(M.historical_shares({"F": 0.0, "Q": 0.0, "E": 0.0, "local": 1.0})["F"])


def test_tier_mass_empty_q_tier():
    tiers = np.array([[[F, E, LOCAL]]], np.int8)
    mass = np.array([[[0.2, 0.3, 0.4]]])
    got = M.tier_mass(mass, np.ones((1, 1)), tiers, omega=8)
    assert got == pytest.approx({"F": 0.2, "Q": 0.0, "E": 0.3, "local": 0.5})


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_tier_mass_shares_sum_to_one(g, layers, nw, omega, seed):
    rs = np.random.RandomState(seed)
    raw = rs.rand(g, layers, nw + 1)
    rows = raw / raw.sum(-1, keepdims=True)  # softmax-like rows: the last column is the sinks
    r = -(-g // omega)
    tiers = rs.randint(0, 4, (r, layers, nw)).astype(np.int8)
    got = M.tier_mass(rows[..., :nw], rows.sum(-1), tiers, omega)
    assert sum(got.values()) == pytest.approx(1.0)
    assert all(-1e-12 <= v <= 1 + 1e-12 for v in got.values())


# ---------------------------------------------------------------------------------------------- FMM


def test_future_missed_mass_hand_computed_and_censored():
    # G = 6, Ω = 2, H = 4: events 0 (steps 0-3) and 1 (steps 2-5) have a full horizon; event 2 is censored
    mass = np.zeros((6, 2, 2))
    mass[:, 0, 1] = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]  # layer 0, window 1
    mass[:, 1, 0] = 0.5  # layer 1, window 0
    tiers = np.array(
        [
            [[F, E], [F, F]],  # event 0: layer 0 evicted window 1
            [[F, E], [E, F]],  # event 1: layer 1 evicted window 0 as well
            [[F, E], [E, F]],
        ],
        np.int8,
    )
    total = np.ones((6, 2))
    got = M.future_missed_mass(mass, total, tiers, omega=2, horizon=4)
    assert got[0] == pytest.approx(((0.1 + 0.2 + 0.3 + 0.4) / 4 + 0.0) / 2)
    assert got[1] == pytest.approx(((0.3 + 0.4 + 0.5 + 0.6) / 4 + 2.0 / 4) / 2)
    assert np.isnan(got[2])  # steps 4..7 do not all exist


def test_future_missed_mass_counts_windows_that_never_return_at_every_event():
    # a window evicted at event 0 stays evicted: every uncensored event misses its mass
    mass = np.zeros((8, 1, 2))
    mass[:, 0, 0] = 0.25
    tiers = np.array([[[E, F]]] * 4, np.int8)
    got = M.future_missed_mass(mass, np.ones((8, 1)), tiers, omega=2, horizon=2)
    assert got == pytest.approx([0.25, 0.25, 0.25, 0.25])


# ---------------------------------------------------------------------------------------------- churn


def test_selection_churn_hand_computed():
    tiers = np.array(
        [
            [[F, Q, E, LOCAL]],  # reachable {0, 1}
            [[F, E, E, F]],  # {0, 3}: Jaccard 1/3
            [[F, E, E, F]],  # same: 0 churn
            [[E, E, E, E]],  # empty: Jaccard 0
        ],
        np.int8,
    )
    assert M.selection_churn(tiers) == pytest.approx([2 / 3, 0.0, 1.0])
    both_empty = np.array([[[E, LOCAL]], [[E, E]]], np.int8)
    assert M.selection_churn(both_empty) == pytest.approx([0.0])


# ---------------------------------------------------------------------------------------------- LIR


def test_global_lir_hand_computed():
    # one layer, three windows over 6 events, m = 2
    tiers = np.array(
        [
            [F, Q, LOCAL],
            [Q, Q, LOCAL],
            [Q, E, Q],
            [Q, E, Q],
            [F, E, Q],
            [Q, E, F],
        ],
        np.int8,
    )[:, None, :]
    got = M.global_lir(tiers, eligibility=2)
    # window 0: out of F at events 1, 2, 3 -> eligible (r=2), (r=3); rescued at event 4 (lags 2, 1)
    # window 1: out of F at events 0..5 -> eligible r = 1..5, never back (evicted): 5 unrescued pairs
    # window 2: routed from event 2, out of F at 2, 3, 4 -> eligible r = 3, 4; rescued at 5 (lags 2, 1);
    #   event 5 is in F, so (5, 2) is not eligible
    assert got["eligible"] == 9
    assert got["rescued"] == 4
    assert got["lir"] == pytest.approx(4 / 9)
    assert got["median_return"] == pytest.approx(1.5)


def test_global_lir_no_eligible_pairs_and_no_promotion():
    always_f = np.full((5, 1, 2), F, np.int8)
    got = M.global_lir(always_f, 3)
    assert got["eligible"] == 0 and np.isnan(got["lir"]) and np.isnan(got["median_return"])
    never_back = np.array([[[F]], [[Q]], [[Q]], [[Q]], [[E]]], np.int8)
    got = M.global_lir(never_back, 3)
    assert (got["eligible"], got["rescued"], got["lir"]) == (2, 0, 0.0)
    with pytest.raises(ValueError):
        M.global_lir(always_f, 0)


def test_oracle_tiers_take_the_top_routed_windows():
    reference = np.array([[[5.0, 1.0, 3.0, 9.0]], [[1.0, 4.0, 3.0, 9.0]]])
    tiers = np.array([[[Q, E, F, LOCAL]], [[E, Q, F, F]]], np.int8)
    got = M.oracle_tiers(reference, tiers, nf=2)
    # event 0: routed windows 0..2, top 2 by mass = 0 and 2; window 3 not routed yet stays local
    assert got.tolist() == [[[F, E, F, LOCAL]], [[E, F, E, F]]]
    # the oracle's revival: window 0 out of F at event 1 only (m = 1), never back
    assert M.global_lir(got, 1)["eligible"] == 3


# ---------------------------------------------------------------------------------------------- QSA, RQ


def test_spearman_matches_hand_values():
    assert M.spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert M.spearman(np.array([1.0, 2, 3, 4]), np.array([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    # ranks a = (1, 2, 3), b = (1, 3, 2): rho = 1 - 6 * 2 / (3 * 8) = 0.5
    assert M.spearman(np.array([0.1, 0.2, 0.3]), np.array([1.0, 9.0, 5.0])) == pytest.approx(0.5)
    assert M.rankdata(np.array([3.0, 1.0, 3.0, 2.0])) == pytest.approx([3.5, 1.0, 3.5, 2.0])
    assert np.isnan(M.spearman(np.array([1.0, 1.0]), np.array([1.0, 2.0])))


def test_cumulative_reference_and_qsa():
    mass = np.zeros((4, 1, 4))
    mass[:, 0] = [[0.1, 0.2, 0.3, 0.0]] * 4
    prompt = np.array([[1.0, 0.0, 0.0, 5.0]])
    ref = M.cumulative_reference(prompt, mass, omega=2, num_events=3)
    assert ref[0, 0] == pytest.approx([1.0, 0.0, 0.0, 5.0])
    assert ref[1, 0] == pytest.approx([1.2, 0.4, 0.6, 5.0])
    assert ref[2, 0] == pytest.approx([1.4, 0.8, 1.2, 5.0])
    tiers = np.array([[[Q, Q, Q, F]], [[Q, Q, Q, F]], [[E, E, E, F]]], np.int8)
    scores = np.array([[[3.0, 1.0, 2.0, 9.0]], [[1.0, 2.0, 3.0, 9.0]], [[0.0, 0.0, 0.0, 9.0]]])
    got = M.qsa(scores, ref, tiers)
    # event 0: ref ranks (3, 1.5, 1.5) vs scores (3, 1, 2): rho = 0.866; event 1: ranks (3,1,2) vs (1,2,3)
    assert got[0] == pytest.approx(M.spearman(np.array([3.0, 1, 2]), np.array([1.0, 0, 0])))
    assert got[0] == pytest.approx(np.sqrt(3) / 2)
    assert got[1] == pytest.approx(-0.5)
    assert np.isnan(got[2])  # empty Q tier


def test_recovered_q_mass_hand_computed_and_empty_q():
    # Ω = 2, G = 4: intervals 0 (steps 0, 1) and 1 (steps 2, 3); events 0, 1, 2
    mass = np.zeros((4, 1, 3))
    mass[:, 0, 1] = [0.1, 0.2, 0.3, 0.4]
    mass[:, 0, 2] = 0.5
    tiers = np.array([[[F, Q, Q]], [[F, Q, E]], [[F, Q, E]]], np.int8)
    post = np.array([[[5.0, 1.0, 2.0]], [[6.0, 1.25, 0.0]], [[7.0, 1.9, 0.0]]])
    pre = np.array([[[6.0, 1.25, 3.2]], [[7.0, 1.9, 0.0]]])
    got = M.recovered_q_mass(mass, tiers, post, pre, omega=2)
    # interval 0: window 1 credited 0.25 of 0.3, window 2 credited 1.2 of 1.0 (capped at 1.0);
    # interval 1: window 1 credited 0.65 of 0.7; F windows and evicted ones do not count
    assert got["credited"] == pytest.approx(2.1)
    assert got["full"] == pytest.approx(2.0)
    assert got["rq_ratio"] == pytest.approx(1.05)
    assert got["rq"] == pytest.approx((0.25 + 1.0 + 0.65) / 2.0)
    no_q = np.array([[[F, E, E]]] * 3, np.int8)
    empty = M.recovered_q_mass(mass, no_q, post, pre, omega=2)
    assert np.isnan(empty["rq"]) and np.isnan(empty["rq_ratio"]) and empty["full"] == 0.0


# ---------------------------------------------------------------------------------------------- transitions


def test_transition_matrix_hand_computed():
    tiers = np.array([[[F, Q, LOCAL]], [[Q, F, F]], [[Q, E, F]]], np.int8)
    probs, counts = M.transition_matrix(tiers, 1)
    # pairs (0->1): F->Q, Q->F (window 2 not routed at 0); (1->2): Q->Q, F->E, F->F
    assert counts.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert probs[0] == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert probs[1] == pytest.approx([0.5, 0.5, 0.0])
    assert np.isnan(probs[2]).all()  # no window evicted at r: NaN row
    probs2, counts2 = M.transition_matrix(tiers, 2)
    assert counts2.tolist() == [[0, 1, 0], [0, 0, 1], [0, 0, 0]]
    with pytest.raises(ValueError):
        M.transition_matrix(tiers, 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(1, 3), st.integers(1, 6), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_transition_rows_sum_to_one(r, layers, nw, lag, seed):
    tiers = np.random.RandomState(seed).randint(0, 4, (r, layers, nw)).astype(np.int8)
    probs, counts = M.transition_matrix(tiers, lag)
    for i in range(3):
        if counts[i].sum():
            assert probs[i].sum() == pytest.approx(1.0)
        else:
            assert np.isnan(probs[i]).all()
    if lag < r:
        routed = np.isin(tiers[:-lag], [F, Q, E]) & np.isin(tiers[lag:], [F, Q, E])
        assert counts.sum() == routed.sum()


# ---------------------------------------------------------------------------------------------- traces


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(seed=0)


P, G = 320, 32


@pytest.fixture(scope="module")
def sequences():
    return np.random.RandomState(0).randint(2, 250, (2, P + G)).astype(np.int32)


@pytest.fixture(scope="module")
def reference(tiny, sequences):
    return reference_trace(tiny[1], sequences, G, n_obs=16)


def test_reference_trace_rows_are_full_kv_attention(tiny, reference, sequences):
    assert reference.rows.shape == (2, G, 2, P + G)
    assert reference.prompt_rows.shape == (2, 2, P + G)
    np.testing.assert_allclose(reference.rows.sum(-1), 1.0, atol=1e-5)  # one softmax row per step and layer
    np.testing.assert_allclose(reference.prompt_rows.sum(-1), 16.0, atol=1e-4)  # n_obs rows
    np.testing.assert_allclose(reference.prompt_all.sum(-1), P, rtol=1e-5)  # every prompt row
    assert np.abs(reference.prompt_all[..., P:]).max() == 0.0  # prompt queries never see the targets
    # causal: step g's query (position P + g) puts no mass on later keys
    for g in (0, 7, G - 1):
        assert np.abs(reference.rows[:, g, :, P + g + 1 :]).max(initial=0.0) == 0.0
        assert reference.rows[:, g, :, P + g].min() > 0
    wm = window_mass(reference.rows, 5, 8, 44)
    np.testing.assert_allclose(wm.sum(-1) + reference.rows[..., :5].sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("name", ["r2", "qevict", "qevict-nopromo"])
def test_policy_trace_tiers_follow_the_cache(tiny, sequences, reference, name):
    method = make_method(name, 0.6, recent=32)
    trace = policy_trace(tiny[1], sequences, P, method)
    b, r, layers, nw = trace.tiers.shape
    assert (b, r, layers, nw) == (2, G // 8 + 1, 2, 44)
    assert ((trace.tiers == F).sum(-1) <= trace.nf).all()
    assert ((trace.tiers == Q).sum(-1) <= trace.nq).all()
    # routed windows stay routed; evicted windows never come back (the cache cannot recall them)
    routed = trace.tiers != LOCAL
    assert (routed[:, 1:] >= routed[:, :-1]).all()
    evicted = trace.tiers == E
    assert (evicted[:, 1:] >= evicted[:, :-1]).all()
    # scores exist exactly for F and Q windows
    reachable = (trace.tiers == F) | (trace.tiers == Q)
    assert (np.isfinite(trace.scores) == reachable).all()
    # windows that left the ring: every window ending 32 tokens before the event's length
    for ev in range(r):
        length = P + 8 * ev
        assert routed[:, ev, :, : (length - 5 - 32) // 8].all()
        assert not routed[:, ev, :, (length - 5 - 32) // 8 :].any()
    scalars, series = passage_metrics(reference, trace, 0, horizon=8, eligibility=2)
    assert sum(scalars[f"mass_{t}"] for t in ("F", "Q", "E", "local")) == pytest.approx(1.0)
    assert (series["counts"][1][2, :2] == 0).all()  # E -> F / E -> Q never happen
    if name == "r2":
        assert trace.nq == 0 and scalars["mass_Q"] == 0.0
        assert np.isnan(scalars["rq"]) and np.isnan(scalars["qsa"])
    else:
        assert trace.nq > 0 and scalars["mass_Q"] > 0
        assert 0.3 < scalars["rq"] <= 1.0  # INT2 attention credits Q windows mass of the Full-KV order
        assert scalars["rq_ratio"] >= scalars["rq"]
    if name == "qevict-nopromo":
        assert scalars["q_to_f"] == 0 and scalars["lir"] == 0.0  # no promotion: nothing comes back to F


def test_policy_trace_rejects_what_it_cannot_diagnose(tiny, sequences):
    with pytest.raises(ValueError, match="window tiers"):
        policy_trace(tiny[1], sequences, P, make_method("snapkv", 0.6))
    with pytest.raises(ValueError, match="cumulative"):
        policy_trace(tiny[1], sequences, P, make_method("qevict", 0.6, ranking="decayed", recent=32))
    with pytest.raises(ValueError, match="multiple"):
        policy_trace(tiny[1], sequences[:, :-3], P, make_method("qevict", 0.6, recent=32))


def test_passages_from_a_text_and_from_pydoc():
    tok = ByteTokenizer()
    enc = lambda s: tok.encode(s, add_bos=False)
    text = "".join(chr(ord("a") + i % 26) for i in range(100))
    got = passages(enc, 3, 20, 10, text=text, bos=[0])
    assert got.shape == (3, 30) and (got[:, 0] == 0).all()
    assert got[1, 1:].tolist() == enc(text)[29:58]  # consecutive spans after the BOS
    with pytest.raises(ValueError, match="passages"):
        passages(enc, 4, 20, 10, text=text)
    pydoc = passages(enc, 2, 40, 8, seed=3)
    assert pydoc.shape == (2, 48) and not (pydoc[0] == pydoc[1]).all()


# ---------------------------------------------------------------------------------------------- the command


def test_diagnose_command_json_and_tables(tiny, tmp_path, capsys):
    argv = [
        "diagnose",
        "--passages", "2",
        "--prefill", "320",
        "--generate", "32",
        "--budget", "0.6",
        "--methods", "r2,qevict-nopromo,qevict",
        "--horizon", "8",
        "--eligibility", "2",
        "--json",
        "--no-progress",
        "--out", str(tmp_path),
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert cmd_diagnose(args, loaded=(tiny[0], tiny[1], ByteTokenizer())) == 0
    out, err = capsys.readouterr()
    recs = json.loads(out)
    keys = {(r["policy"], r["metric"]) for r in recs}
    for policy in ("r2", "qevict-nopromo", "qevict"):
        for metric in ("fmm", "churn", "lir", "qsa", "rq", "mass_F", "mass_Q", "mass_E", "T1_FQ", "T2_QF"):
            assert (policy, metric) in keys
    for r in recs:
        assert set(r) == {"policy", "metric", "mean", "spread", "n", "values"} and len(r["values"]) == 2
    by = {(r["policy"], r["metric"]): r for r in recs}
    assert by[("r2", "rq")]["mean"] is None and by[("r2", "mass_Q")]["mean"] == 0.0
    assert by[("qevict-nopromo", "q_to_f")]["mean"] == 0.0
    for table in ("Table 14", "Table 15", "Table 16", "Table 18"):
        assert table in err
    assert "| qevict | 8 |" in err
    doc = json.loads((tmp_path / "diagnose.json").read_text())
    assert doc["config"]["prefill"] == 320 and len(doc["series"]["qevict"]["fmm"]) == 32 // 8 + 1
    assert (tmp_path / "tables.md").read_text().startswith("Table 14")
    with pytest.raises(ValueError, match="eligibility"):
        cmd_diagnose(
            build_parser().parse_args([*argv[:-3], "--eligibility", "9"]), loaded=(tiny[0], tiny[1], None)
        )
