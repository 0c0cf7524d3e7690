"""Observation-window initialization of the window scores (docs/design.md §6) against a float64 numpy reference; the
ranking interface both engines share."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.model import LayerContext
from qevict_jax.engines.pool import Allocation
from qevict_jax.methods.registry import make_method
from qevict_jax.rankings import attention_scores, windows
from qevict_jax.rankings.scoring import (
    CumulativeAllRanking,
    GateRanking,
    KeyNormRanking,
    PromptPass,
    Ranking,
    RestKVRanking,
    make_ranking,
)
from qevict_jax.rankings.token_rankings import CriticalKVRanking, SnapKVRanking, TOVARanking
from qevict_jax.rankings.windows import window_sums

B, T, H, HKV, D = 2, 80, 6, 2, 8
S, W = 5, 8
NW = -(-(T - S) // W)
LENGTHS = np.array([80, 61])


def _inputs(seed: int = 0):
    rs = np.random.RandomState(seed)
    return rs.randn(B, T, H, D) * 1.5, rs.randn(B, T, HKV, D) * 1.5


def np_observation_rows(q, k, end: int, n_obs: int, pool: int) -> np.ndarray:
    """[n_obs, T] float64 head-mean attention of the last n_obs queries before ``end`` (one row)."""
    g = H // HKV
    rows = np.zeros((n_obs, T))
    for i in range(n_obs):
        pos = end - n_obs + i
        if pos < 0:
            continue
        for h in range(H):
            logits = k[: pos + 1, h // g] @ q[pos, h] / np.sqrt(D)
            p = np.exp(logits - logits.max())
            rows[i, : pos + 1] += p / p.sum() / H
    if pool > 1:
        left, right = pool // 2, (pool - 1) // 2
        pooled = np.array([[r[max(0, t - left) : t + right + 1].max() for t in range(T)] for r in rows])
        pooled[:, end:] = 0.0
        rows = pooled
    return rows


def np_windows(x: np.ndarray) -> np.ndarray:
    """Sum per window: x [..., T] -> [..., NW] over positions [S + wW, S + (w+1)W) below T."""
    out = np.zeros((*x.shape[:-1], NW))
    for w in range(NW):
        out[..., w] = x[..., S + w * W : min(T, S + (w + 1) * W)].sum(-1)
    return out


@pytest.mark.parametrize("key_block", [16, 24, 512])  # T = 80: 5 full key blocks; 3 and a tail of 8; a tail
@pytest.mark.parametrize(
    "kind,n_obs,pool", [("cumulative", 32, 0), ("cumulative", 16, 5), ("decayed", 32, 0), ("pnorm", 8, 3)]
)
def test_observation_window_scores_match_float64_reference(kind, n_obs, pool, key_block, monkeypatch):
    monkeypatch.setattr(attention_scores, "OBS_KEY_BLOCK", key_block)
    q, k = _inputs(1)
    ranking = make_ranking(kind, decay=0.9, p=3.0, n_obs=n_obs, max_pool_width=pool)
    got = np.asarray(
        ranking.prefill_window_scores(
            PromptPass(
                jnp.asarray(q, jnp.float32),
                jnp.asarray(k, jnp.float32),
                None,
                jnp.asarray(LENGTHS, jnp.int32),
                jnp.zeros((B, HKV, H // HKV, T)),
            ),
            sink=S,
            window=W,
            num_windows=NW,
        )
    )
    for b in range(B):
        rows = np_observation_rows(q[b], k[b], int(LENGTHS[b]), n_obs, pool)
        if kind == "cumulative":
            want = np_windows(rows.sum(0))
        elif kind == "decayed":
            want = np_windows(((0.9 ** np.arange(n_obs - 1, -1, -1))[:, None] * rows).sum(0))
        else:
            want = (np_windows(rows) ** 3).sum(0)
        np.testing.assert_allclose(got[b], want, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("key_block", [16, 512])
def test_headmax_scores_a_window_by_its_most_attentive_head(key_block, monkeypatch):
    """The head-max score is, per window, the largest over query heads of that head's observation mass (float64
    reference), and never below the head mean."""
    monkeypatch.setattr(attention_scores, "OBS_KEY_BLOCK", key_block)
    q, k = _inputs(3)
    n_obs, g = 12, H // HKV
    prompt = PromptPass(
        jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), None, jnp.asarray(LENGTHS, jnp.int32)
    )
    got = np.asarray(make_ranking("headmax", n_obs=n_obs).prefill_window_scores(prompt, sink=S, window=W, num_windows=NW))
    mean = np.asarray(make_ranking("cumulative", n_obs=n_obs).prefill_window_scores(prompt, sink=S, window=W, num_windows=NW))
    for b in range(B):
        end = int(LENGTHS[b])
        heads = np.zeros((H, T))
        for h in range(H):
            for pos in range(end - n_obs, end):
                logits = k[b, : pos + 1, h // g] @ q[b, pos, h] / np.sqrt(D)
                p = np.exp(logits - logits.max())
                heads[h, : pos + 1] += p / p.sum()
        np.testing.assert_allclose(got[b], np_windows(heads).max(0), rtol=2e-5, atol=1e-7)
    assert np.all(got >= mean - 1e-6)


def test_observation_rows_sum_to_one_row_per_query():
    """Units: every observation query distributes exactly one unit of mass (one decode step's worth)."""
    q, k = _inputs(2)
    prompt = PromptPass(jnp.asarray(q), jnp.asarray(k), None, jnp.asarray(LENGTHS), jnp.zeros((B, HKV, 3, T)))
    got = Ranking(n_obs=20).prefill_window_scores(prompt, sink=0, window=1, num_windows=T)
    np.testing.assert_allclose(np.asarray(got).sum(-1), 20.0, rtol=1e-5)


def test_cumulative_all_is_the_column_mass_of_every_query():
    rs = np.random.RandomState(3)
    mass = rs.rand(B, HKV, H // HKV, T)
    prompt = PromptPass(
        jnp.zeros((B, T, H, D)), jnp.zeros((B, T, HKV, D)), None, jnp.asarray(LENGTHS), jnp.asarray(mass)
    )
    got = make_ranking("cumulative-all").prefill_window_scores(prompt, sink=S, window=W, num_windows=NW)
    np.testing.assert_allclose(np.asarray(got), np_windows(mass.mean(axis=(1, 2))), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(window_sums(jnp.asarray(mass.mean(axis=(1, 2))), S, W, NW)),
        np_windows(mass.mean((1, 2))),
        rtol=1e-5,
    )


# ------------------------------------------------------------------ one ranking interface for both engines


def _ctx(t: int = T) -> LayerContext:
    cfg = ModelConfig(
        family="llama", vocab_size=11, hidden_size=H * D, intermediate_size=8, num_layers=1,
        num_heads=H, num_kv_heads=HKV, head_dim=D,
    )  # fmt: skip
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    return LayerContext(positions=pos, layer=jnp.int32(0), inv_freq=jnp.ones((D // 2,)), cfg=cfg)


@pytest.mark.parametrize("ranking", [make_ranking("cumulative-all"), TOVARanking(), make_ranking("keynorm")])
def test_a_shared_ranking_scores_windows_as_its_head_mean_tokens(ranking):
    """The rankings both engines use score a window (window engine) as the head mean of its tokens' scores
    (token pool) summed over the window (key norm: averaged, its windows' unit)."""
    q, k = _inputs(4)
    mass = np.random.RandomState(4).rand(B, HKV, H // HKV, T)
    f = lambda a: jnp.asarray(a, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    prompt = PromptPass.of_layer(f(q), f(k), f(k), lengths=lengths, column_mass=f(mass), ctx=_ctx())
    tokens = ranking.prefill_token_scores(prompt, None)
    assert tokens.shape == (B, HKV, T)
    windows = np.asarray(ranking.prefill_window_scores(prompt, sink=S, window=W, num_windows=NW))
    from_tokens = np_windows(np.asarray(tokens, np.float64).mean(axis=1))
    if ranking.name == "keynorm":
        from_tokens /= W  # a window past T holds zero keys (norm 0) in both
    np.testing.assert_allclose(windows, from_tokens, rtol=2e-5, atol=1e-7)


def test_tova_keeps_the_current_query_for_every_head_and_replaces_scores():
    q, k = _inputs(5)
    f = lambda a: jnp.asarray(a, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    prompt = PromptPass(f(q), f(k), f(k), lengths, sliding_window=_ctx().cfg.sliding_window)
    got = np.asarray(TOVARanking().prefill_token_scores(prompt, None))
    for b in range(B):
        row = np_observation_rows(q[b], k[b], int(LENGTHS[b]), 1, 0)[0]
        for h in range(HKV):
            np.testing.assert_allclose(got[b, h], row, rtol=2e-5, atol=1e-7)
    assert TOVARanking.shared_heads and not Ranking.shared_heads
    np.testing.assert_array_equal(TOVARanking().update(jnp.ones(3), jnp.arange(3.0)), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(Ranking().update(jnp.ones(3), jnp.arange(3.0)), [1.0, 2.0, 3.0])


@pytest.mark.parametrize(
    "name,options,ranking,allocation",
    [
        ("h2o", {}, CumulativeAllRanking(), Allocation()),
        ("tova", {}, TOVARanking(), Allocation()),
        ("keynorm", {}, KeyNormRanking(), Allocation()),
        (
            "snapkv",
            {"n_obs": 48, "avg_pool_width": 7},
            SnapKVRanking(n_obs=48, avg_pool_width=7),
            Allocation(),
        ),
        ("pyramidkv", {"beta": 10.0}, SnapKVRanking(), Allocation(pyramid_beta=10.0)),
        ("adakv", {}, SnapKVRanking(), Allocation(adaptive=True, safeguard=0.2)),
        (
            "criticalkv",
            {"epsilon": 0.01},
            CriticalKVRanking(first_stage_ratio=0.5, epsilon=0.01),
            Allocation(),
        ),
        (
            "restkv",
            {"avg_pool_width": 9, "scale": 100.0},
            RestKVRanking(avg_pool_width=9, scale=100.0),
            Allocation(),
        ),
        ("gates-global", {"gates": "g"}, GateRanking(), Allocation(adaptive=True, safeguard=0.0)),
    ],
)
def test_a_pool_policy_is_a_ranking_and_an_allocation(name, options, ranking, allocation):
    """Every token-pool baseline is one of the shared rankings (its options reach it) plus an allocation."""
    method = make_method(name, 0.2, **options)
    assert method.ranking == ranking and type(method.ranking) is type(ranking)
    assert method.allocation == allocation


@pytest.mark.parametrize("spill", [0, 1, 2, 5, 40])
def test_spilled_key_is_the_max_over_the_windows_present_before(spill):
    """Ranking key with spill against a loop over the windows present (random ids, gaps, invalid entries)."""
    rng = np.random.default_rng(spill)
    nw = 30
    for _ in range(20):
        n = 24
        win = rng.choice(nw, size=n, replace=False).astype(np.int32)
        valid = rng.random(n) < 0.8
        win = np.where(rng.random(n) < 0.1, -1, win)  # empty slots
        valid &= win >= 0
        score = rng.standard_normal(n).astype(np.float32)
        want = score.copy()
        for i in range(n):
            if valid[i]:
                near = valid & (win <= win[i]) & (win >= win[i] - spill)
                want[i] = score[near].max()
        got = windows.spilled_key(jnp.asarray(win), jnp.asarray(score), jnp.asarray(valid), spill, nw)
        np.testing.assert_array_equal(np.asarray(got), want)


class WindowScoresJittedAndNot(chex.TestCase):
    """The rankings' core reductions give the same result jitted and un-jitted, against float64 references."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_window_sums_and_observation_scores_match_float64(self):
        x = np.random.RandomState(3).rand(B, T)
        sums = self.variant(lambda a: window_sums(a, sink=S, window=W, num_windows=NW))(jnp.asarray(x, jnp.float32))
        chex.assert_shape(sums, (B, NW))
        chex.assert_trees_all_close(np.asarray(sums, np.float64), np_windows(x), rtol=1e-5)
        q, k = _inputs(2)
        ranking = make_ranking("cumulative", n_obs=16, max_pool_width=0)

        def scores(q, k):
            prompt = PromptPass(q, k, None, jnp.asarray(LENGTHS, jnp.int32), jnp.zeros((B, HKV, H // HKV, T)))
            return ranking.prefill_window_scores(prompt, sink=S, window=W, num_windows=NW)

        got = self.variant(scores)(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32))
        want = np.stack([np_windows(np_observation_rows(q[b], k[b], int(LENGTHS[b]), 16, 0).sum(0)) for b in range(B)])
        chex.assert_trees_all_close(np.asarray(got, np.float64), want, rtol=2e-5, atol=1e-7)
