"""The Q keys (issue 48: strings only at the edge): how the windows that miss F compete for the Q tier is an object
registered by name where it is defined; the configuration names it, the routing calls it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qevict_jax.core import q_keys
from qevict_jax.core.config import CacheConfig, Capacities, ring_capacity
from qevict_jax.core.q_keys import Blend, ByKeyNorm, ByScore, QKey, available_q_keys, q_key, register
from qevict_jax.engines.routing import NormScores, plan_routing


def test_the_names_are_the_options_values():
    assert available_q_keys() == ("score", "keynorm", "blend")
    assert [type(q_key(n)) for n in available_q_keys()] == [ByScore, ByKeyNorm, Blend]
    assert [q_key(n).reads_key_norm for n in available_q_keys()] == [False, True, True]
    with pytest.raises(ValueError, match="unknown q_rank 'norm'; available: score, keynorm, blend"):
        q_key("norm")
    assert hash(q_key("blend")) == hash(Blend()) and q_key("blend") == Blend()  # static: equal by class


def _percentile_rank64(key: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Share of the eligible entries ranked above each entry (stable descending order), 1 where not eligible."""
    idx = [i for i in range(len(key)) if eligible[i]]
    idx += [i for i in range(len(key)) if not eligible[i]]
    order = sorted(idx, key=lambda i: -float(key[i]) if eligible[i] else np.inf)  # sorted() is stable
    rank = np.empty(len(key))
    rank[order] = np.arange(len(key))
    count = max(int(eligible.sum()), 1)
    return np.where(eligible, rank / count, 1.0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    seed=st.integers(0, 2**31),
)
def test_each_key_against_a_numpy_reference(n, seed):
    rng = np.random.default_rng(seed)
    score = rng.integers(-3, 3, n).astype(np.float32)  # coarse: ties are frequent on purpose
    norm = rng.integers(-3, 3, n).astype(np.float32)
    eligible = rng.random(n) < 0.7
    got = {name: np.asarray(q_key(name).key(jnp.asarray(score), jnp.asarray(norm), jnp.asarray(eligible)))
           for name in available_q_keys()}  # fmt: skip
    np.testing.assert_array_equal(got["score"], score)
    np.testing.assert_array_equal(got["keynorm"], norm)
    want = -np.minimum(_percentile_rank64(score, eligible), _percentile_rank64(norm, eligible))
    np.testing.assert_allclose(got["blend"], want, rtol=0, atol=1e-7)


@dataclasses.dataclass(frozen=True)
class LowestScore(QKey):
    """A Q key defined here, in one place: Q takes the windows the ranking likes least."""

    name: ClassVar[str] = "lowest-score-test"
    reads_key_norm: ClassVar[bool] = False

    def key(self, score_key, norm_key, eligible):
        return -score_key


@pytest.fixture
def lowest_score(monkeypatch):
    monkeypatch.setattr(q_keys, "_Q_KEYS", dict(q_keys._Q_KEYS))  # registered for this test only
    register(LowestScore)
    return LowestScore.name


def test_a_new_q_key_lands_in_one_place(lowest_score):
    assert CacheConfig(q_rank=lowest_score).q_rank == lowest_score  # the option accepts it by name
    with pytest.raises(ValueError, match="already registered"):
        register(LowestScore)
    # the routing calls it: five candidates scored 5..1, one F slot, two Q slots
    plan = plan_routing(
        jnp.full(1, -1, jnp.int32), jnp.zeros(1), jnp.full(2, -1, jnp.int32), jnp.zeros(2, bool), jnp.zeros(2),
        cand_win=jnp.arange(5, dtype=jnp.int32), cand_score=jnp.asarray([5.0, 4.0, 3.0, 2.0, 1.0]),
        nq=2, promotion=True, num_windows=8, q_rank=q_key(lowest_score), norms=None,
    )  # fmt: skip
    assert np.asarray(plan.f_win).tolist() == [0]
    active = np.asarray(plan.ledger_win)[np.asarray(plan.ledger_active)]
    assert sorted(active.tolist()) == [3, 4]  # by score Q would hold windows 1 and 2
    by_score = plan_routing(
        jnp.full(1, -1, jnp.int32), jnp.zeros(1), jnp.full(2, -1, jnp.int32), jnp.zeros(2, bool), jnp.zeros(2),
        cand_win=jnp.arange(5, dtype=jnp.int32), cand_score=jnp.asarray([5.0, 4.0, 3.0, 2.0, 1.0]),
        nq=2, promotion=True, num_windows=8, q_rank=q_key("score"),
        norms=NormScores(jnp.zeros(1), jnp.zeros(2), jnp.zeros(5)),
    )  # fmt: skip
    assert sorted(np.asarray(by_score.ledger_win)[np.asarray(by_score.ledger_active)].tolist()) == [1, 2]


def test_capacities_take_the_object_not_its_name():
    sizes = dict(
        sink=4, window=8, recent=16, ring=ring_capacity(16, 8, 8), nf=1, nq=1, nl=1, nw_max=8, bits=2, omega=8
    )
    assert Capacities(**sizes, q_rank=q_key("blend")).norm_scored
    assert not Capacities(**sizes).norm_scored
    with pytest.raises(TypeError, match=r"Capacities.q_rank is a Q key object .* got 'blend'"):
        Capacities(**sizes, q_rank="blend")
