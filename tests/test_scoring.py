"""Observation-window initialization of the window scores (DESIGN §5) against a float64 numpy reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qevict_jax import scoring
from qevict_jax.scoring import Ranking, make_ranking, window_sums

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
    monkeypatch.setattr(scoring, "OBS_KEY_BLOCK", key_block)
    q, k = _inputs(1)
    ranking = make_ranking(kind, decay=0.9, p=3.0, n_obs=n_obs, pool=pool)
    got = np.asarray(
        ranking.prefill_window_scores(
            jnp.asarray(q, jnp.float32),
            jnp.asarray(k, jnp.float32),
            jnp.asarray(LENGTHS, jnp.int32),
            jnp.zeros((B, HKV, H // HKV, T)),
            S,
            W,
            NW,
            None,
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


def test_observation_rows_sum_to_one_row_per_query():
    """Units: every observation query distributes exactly one unit of mass (one decode step's worth)."""
    q, k = _inputs(2)
    got = Ranking(n_obs=20).prefill_window_scores(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(LENGTHS), jnp.zeros((B, HKV, 3, T)), 0, 1, T, None
    )
    np.testing.assert_allclose(np.asarray(got).sum(-1), 20.0, rtol=1e-5)


def test_cumulative_all_is_the_column_mass_of_every_query():
    rs = np.random.RandomState(3)
    mass = rs.rand(B, HKV, H // HKV, T)
    got = make_ranking("cumulative-all").prefill_window_scores(
        jnp.zeros((B, T, H, D)),
        jnp.zeros((B, T, HKV, D)),
        jnp.asarray(LENGTHS),
        jnp.asarray(mass),
        S,
        W,
        NW,
        None,
    )
    np.testing.assert_allclose(np.asarray(got), np_windows(mass.mean(axis=(1, 2))), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(window_sums(jnp.asarray(mass.mean(axis=(1, 2))), S, W, NW)),
        np_windows(mass.mean((1, 2))),
        rtol=1e-5,
    )
