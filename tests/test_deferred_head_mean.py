"""``CacheConfig.deferred_head_mean``: per-KV-head running masses folded into the scores at routing events
give the scores, routing and tokens of the per-step head mean (up to float rounding), for the rankings that
declare themselves linear in the mass; the others are refused before any compute."""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import decisive_model, tiny_llama

from qevict_jax.core.config import CacheConfig
from qevict_jax.engines.window import fold_head_means
from qevict_jax.methods.baselines import SnapKV
from qevict_jax.methods.registry import cache_stats, make_method
from qevict_jax.rankings.scoring import available_rankings, make_ranking
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig

TINY = tiny_llama(1024)
# every ranking whose instances need nothing learned (the gates ranking needs trained gates)
PLAIN = [name for name in available_rankings() if name != "gates"]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Per ranking: the per-step head mean and the deferred one, on a ragged batch with routing events."""
    model = decisive_model(TINY)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, TINY.vocab_size, n).tolist() for n in (200, 150, 230, 180)]
    out = {}
    for ranking in ("cumulative", "decayed"):
        out[ranking] = [
            generate(
                model,
                prompts,
                SamplerConfig(max_new_tokens=40),
                make_method("qevict", 0.4, omega=2, recent=16, ranking=ranking, deferred_head_mean=deferred),
                kv_dtype=jnp.float32,
            )
            for deferred in (False, True)
        ]
    return out


@pytest.mark.parametrize("ranking", ["cumulative", "decayed"])
def test_deferred_head_mean_routes_and_decodes_as_the_per_step_mean(runs, ranking):
    per_step, deferred = runs[ranking]
    assert deferred.tokens == per_step.tokens
    a, b = cache_stats(per_step.cache), cache_stats(deferred.cache)
    assert min(a["routing_events"]) >= 19 and min(a["evictions"]) > 0
    for counter in ("routing_events", "evictions", "promotions", "demotions"):
        assert a[counter] == b[counter], counter
    # the routed windows are the same, and so are their scores once the last steps' masses are folded in
    x, y = per_step.cache, fold_head_means(deferred.cache)
    chex.assert_trees_all_equal((x.f_win, x.ledger.win, x.ledger.active), (y.f_win, y.ledger.win, y.ledger.active))
    chex.assert_trees_all_close(
        (x.f_score, x.ledger.score, x.ring_score), (y.f_score, y.ledger.score, y.ring_score), rtol=1e-5, atol=1e-5
    )
    # the running masses are real: zero after the fold, not before (the last step was not a routing event)
    assert float(jnp.abs(deferred.cache.ring_pending).sum()) > 0
    assert float(jnp.abs(y.ring_pending).sum()) == 0


def test_deferred_head_mean_costs_hkv_floats_per_scored_entry(runs):
    """The running masses are in the cache's bytes: Hkv f32 per F slot, ledger slot and ring window."""
    per_step, deferred = runs["cumulative"]
    c = deferred.cache
    assert c.caps.nf == per_step.cache.caps.nf and c.caps.nl == per_step.cache.caps.nl
    hkv = TINY.num_kv_heads
    extra = 4 * hkv * (c.caps.nf + c.caps.nl + c.caps.ring_windows) * TINY.num_layers * len(per_step.tokens)
    assert deferred.cache_bytes - per_step.cache_bytes == extra
    chex.assert_shape(c.f_pending, (TINY.num_layers, 4, hkv, c.caps.nf))
    chex.assert_shape(per_step.cache.f_pending, (TINY.num_layers, 4, hkv, 0))


def test_fold_happens_only_when_due(runs):
    cache = runs["cumulative"][1].cache
    same = fold_head_means(cache, jnp.bool_(False))
    chex.assert_trees_all_equal(same, cache)
    folded = fold_head_means(cache, jnp.bool_(True))
    chex.assert_trees_all_close(folded, fold_head_means(cache))


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(PLAIN),
    seed=st.integers(0, 2**31 - 1),
    heads=st.integers(1, 4),
)
def test_linear_in_mass_is_what_the_rankings_claim(name, seed, heads):
    """For a ranking declaring ``linear_in_mass``, over random scores and per-head masses: the scores'
    own dynamics plus the head mean of per-head running masses equal the updates by the head means (three
    steps). PNorm, which raises the head mean to a power, declares itself non-linear, and is."""
    ranking = make_ranking(name)
    rng = np.random.default_rng(seed)
    score = jnp.asarray(rng.uniform(0, 2, (3, 5)), jnp.float32)
    masses = jnp.asarray(rng.uniform(0, 1, (3, 3, heads, 5)), jnp.float32)  # [steps, B, Hkv, N]
    if heads == 1 and not ranking.linear_in_mass:
        return  # one head: a head mean is the identity, linear or not
    direct, own, pending = score, score, jnp.zeros_like(masses[0])
    for m in masses:
        direct = ranking.update(direct, m.mean(axis=1))
        own = ranking.update(own, jnp.zeros_like(own))
        pending = ranking.update(pending, m)
    close = np.allclose(own + pending.mean(axis=1), direct, rtol=1e-5, atol=1e-6)
    assert close == ranking.linear_in_mass, name


def test_deferred_head_mean_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="linear in the attention mass.*'pnorm' is not. Linear: cumulative,"):
        make_method("qevict", 0.2, ranking="pnorm", deferred_head_mean=True)
    with pytest.raises(ValueError, match="snapkv: deferred_head_mean applies to the window engine"):
        SnapKV(cache=CacheConfig(window=1, q_frac=0.0, static=True, deferred_head_mean=True))
    with pytest.raises(ValueError, match="has no option 'deferred_head_mean'"):
        make_method("snapkv", 0.2, deferred_head_mean=True)
