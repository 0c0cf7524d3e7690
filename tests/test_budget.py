"""The byte budget: the real cache fits, the solver is stable in the length, errors are clear."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import ClassVar

import chex
import jax
import jax.numpy as jnp
import pytest

from models.config import ModelConfig
from qevict_jax.core.budget import solve_capacities
from qevict_jax.core.config import CacheConfig
from qevict_jax.core.kv import CacheRequest, cache_nbytes, full_kv_bytes
from qevict_jax.methods.registry import available_methods, make_method
from qevict_jax.rankings import scoring

MODEL = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)

GRID = list(
    itertools.product(
        [0.25, 0.5, 1.0],  # beta
        [(1000, 64), (3000, 200)],  # (prompt length, new tokens)
        [(4, 2), (8, 2), (8, 4), (32, 2)],  # (window, bits)
        [(1, jnp.float32), (3, jnp.bfloat16)],  # (batch, model dtype)
    )
)


@pytest.mark.parametrize(("beta", "lengths", "wb", "batch_dtype"), GRID)
def test_real_cache_fits_the_budget(beta, lengths, wb, batch_dtype):
    batch, dtype = batch_dtype
    prompt, new = lengths
    window, bits = wb
    method = make_method("qevict", budget=beta, window=window, bits=bits, recent=64)
    budget_tokens = prompt + new
    cache = method.init_cache(CacheRequest(model_cfg=MODEL, batch=batch, prompt_capacity=prompt, max_new_tokens=new, dtype=dtype, budget_tokens=budget_tokens), jnp.full((batch,), prompt, jnp.int32))
    budget = beta * full_kv_bytes(MODEL, budget_tokens, dtype, batch)
    assert cache_nbytes(cache) <= budget
    caps = cache.caps
    assert caps.nf + caps.nq > 0 and caps.nq <= caps.nl
    layers, hkv = MODEL.num_layers, MODEL.num_kv_heads
    chex.assert_tree_shape_prefix(  # every ledger entry's codes and grids: [L, B, Hkv, NL, ...]
        cache.ledger.codes, (layers, batch, hkv, caps.nl)
    )
    chex.assert_shape([cache.ledger.win, cache.ledger.active, cache.ledger.score], (layers, batch, caps.nl))
    chex.assert_shape([cache.f_k_words, cache.f_v_words], (layers, batch, hkv, caps.nf, window, MODEL.head_dim))
    chex.assert_shape([cache.f_win, cache.f_score], (layers, batch, caps.nf))
    if max(caps.nf, caps.nq) < caps.nw_max:  # the budget binds (no cap by the window count): little is unused
        per_slot = (
            2 * MODEL.num_layers * MODEL.num_kv_heads * window * MODEL.head_dim * jnp.dtype(dtype).itemsize
        )
        assert budget - cache_nbytes(cache) < 2 * per_slot * batch


# methods without a budget (Full-KV; KIVI keeps every token, quantized) are measured, not sized
@pytest.mark.parametrize(
    "name", [n for n in available_methods() if getattr(make_method(n), "uses_budget", False)]
)
def test_every_variant_fits(name):
    method = make_method(name, budget=0.3)
    cache = method.init_cache(CacheRequest(model_cfg=MODEL, batch=2, prompt_capacity=2048, max_new_tokens=256, dtype=jnp.bfloat16, budget_tokens=2256), jnp.full((2,), 2000, jnp.int32))
    assert cache_nbytes(cache) <= 0.3 * full_kv_bytes(MODEL, 2256, jnp.bfloat16, 2)


@pytest.mark.parametrize(("window", "q_frac", "bits"), [(8, 0.7, 2), (32, 0.5, 4), (8, 0.0, 2), (8, 1.0, 2)])
def test_doubling_length_at_fixed_bytes_keeps_f_and_q(window, q_frac, bits):
    cfg = CacheConfig(window=window, q_frac=q_frac, bits=bits, recent=64, budget_bytes=250_000)
    small = solve_capacities(cfg, MODEL, 2, 4000, jnp.float16)
    big = solve_capacities(cfg, MODEL, 2, 8000, jnp.float16)
    assert (small.nf, small.nq, small.nl) == (big.nf, big.nq, big.nl)
    assert small.nf + small.nq > 0
    method = make_method("qevict", window=window, q_frac=q_frac, bits=bits, recent=64, budget_bytes=250_000)
    lengths = jnp.full((2,), 3000, jnp.int32)
    c1 = method.init_cache(CacheRequest(model_cfg=MODEL, batch=lengths.shape[0], prompt_capacity=3072, max_new_tokens=1000, dtype=jnp.float16, budget_tokens=4000), lengths)
    c2 = method.init_cache(CacheRequest(model_cfg=MODEL, batch=lengths.shape[0], prompt_capacity=7168, max_new_tokens=1000, dtype=jnp.float16, budget_tokens=8000), lengths)
    for a, b in zip(jax.tree.leaves(c1), jax.tree.leaves(c2), strict=True):
        assert a.shape == b.shape
    assert cache_nbytes(c1) == cache_nbytes(c2) <= 2 * 250_000


def test_q_frac_splits_the_historical_bytes():
    base = solve_capacities(CacheConfig(q_frac=0.0, recent=64), MODEL, 1, 8000, jnp.float16)
    split = solve_capacities(CacheConfig(q_frac=0.7, recent=64), MODEL, 1, 8000, jnp.float16)
    assert base.nl == 0 and split.nl > 0
    # F got ~30% of the bytes that bought base.nf slots; INT2 windows are > 5x cheaper, so Q holds more
    assert abs(split.nf - 0.3 * base.nf) <= 1
    assert split.nl > 3 * 0.7 * base.nf


def test_too_small_budget_names_the_minimum_beta():
    cfg = CacheConfig(budget=0.01, recent=64)
    with pytest.raises(ValueError, match=r"beta >= ") as err:
        solve_capacities(cfg, MODEL, 2, 1000, jnp.float32)
    min_beta = float(re.search(r"beta >= ([0-9.]+)", str(err.value)).group(1))
    assert 0.01 < min_beta < 1
    caps = solve_capacities(dataclasses.replace(cfg, budget=min_beta), MODEL, 2, 1000, jnp.float32)
    assert caps.nf + caps.nq >= 1
    with pytest.raises(ValueError, match=r"beta >= "):
        solve_capacities(dataclasses.replace(cfg, budget=min_beta - 2e-4), MODEL, 2, 1000, jnp.float32)


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="multiple of 4 for INT2"):
        CacheConfig(window=6)
    with pytest.raises(ValueError, match="multiple of 2 for INT4"):
        CacheConfig(window=5, bits=4)
    CacheConfig(window=6, q_frac=0.0, recent=60)  # no Q tier: any window
    with pytest.raises(ValueError, match="multiple of the window"):
        CacheConfig(window=8, recent=12)
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        CacheConfig(bits=3)
    with pytest.raises(ValueError, match="unknown ranking 'random'; available: cumulative, .*kvzip"):
        make_method("qevict", ranking="random")
    with pytest.raises(ValueError, match="unknown method"):
        make_method("nope")
    with pytest.raises(ValueError, match="has no option 'windw'"):
        make_method("qevict", windw=8)


def test_a_ranking_registers_where_it_is_defined():
    """A ranking class decorated with ``scoring.register`` is a ranking name everywhere, with no other edit:
    the window methods take it (``--set ranking=``), its dynamics decide what ``deferred_head_mean`` allows;
    every module of the package is imported before a name is looked up, so the question-agnostic rankings
    (each in its own module) are there; a second class under a taken name is refused."""

    @dataclasses.dataclass(frozen=True)
    class Squared(scoring.Ranking):
        name: ClassVar[str] = "test-squared"
        linear_in_mass: ClassVar[bool] = False

        def update(self, score, mass):
            return score + mass**2

    try:
        scoring.register(Squared)
        method = make_method("qevict", 0.2, ranking="test-squared")
        assert isinstance(method.ranking, Squared) and method.ranking.n_obs == method.cache.n_obs
        with pytest.raises(ValueError, match="'test-squared' is not"):
            make_method("qevict", 0.2, ranking="test-squared", deferred_head_mean=True)
        with pytest.raises(ValueError, match="two rankings are named 'test-squared'"):
            scoring.register(dataclasses.make_dataclass("Other", [], bases=(Squared,), frozen=True))
    finally:
        scoring.RANKINGS.pop("test-squared", None)
    assert {"kvzip", "expected-attention", "gates", "cumulative"} <= set(scoring.available_rankings())
    assert scoring.available_rankings()["kvzip"].reconstructs
    assert not any(cls.reconstructs for name, cls in scoring.RANKINGS.items() if name != "kvzip")


def test_recent_as_fraction_of_the_budget():
    caps = solve_capacities(CacheConfig(recent=0.25, budget=0.2), MODEL, 1, 4000, jnp.float16)
    assert caps.recent == int(0.25 * 0.2 * 4000) // 8 * 8 and caps.recent % 8 == 0
