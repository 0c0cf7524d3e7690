"""Inputs shorter than what a method keeps uncompressed: kept whole (and said so), never refused; budgets too
small for a sequence that could be compressed are refused before any compute, in the prompt's terms; β is a
fraction in (0, 1]; an observation window longer than the prompt costs no more than the whole prompt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import tiny_llama

from models.model import Transformer
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.registry import make_method
from qevict_jax.runtime.compiled import EXECUTABLES, bucket_length
from qevict_jax.runtime.generate import generate, lower_prefill
from qevict_jax.runtime.prefill import fit_method
from qevict_jax.runtime.sampling import SamplerConfig

CFG = tiny_llama(4096)
SAMPLER = SamplerConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(CFG, rngs=nnx.Rngs(5))


def _prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(0, CFG.vocab_size, n).tolist()


@pytest.mark.parametrize("name", ["qevict", "r2", "qevict-keynorm", "snapkv", "adakv"])
def test_a_prompt_inside_the_uncompressed_regions_is_kept_whole(model, name):
    """20 tokens + 8 new: every method's smallest cache (sinks, recent region, one unit of history) is larger
    than the whole sequence uncompressed, so it keeps everything: Full-KV's tokens and cache, and says so."""
    prompt = _prompt(20)
    method = make_method(name, 0.2)
    res = generate(model, [prompt], SAMPLER, method)
    ref = generate(model, [prompt], SAMPLER, FullKV())
    assert res.compressed is False and ref.compressed is False
    assert isinstance(res.method, FullKV) and res.requested_method == method
    assert res.tokens == ref.tokens and res.cache_bytes == ref.cache_bytes


def test_a_short_conversation_continues_with_the_method_that_built_its_cache(model):
    first = generate(model, [_prompt(20)], SAMPLER, make_method("qevict", 0.2))
    method = make_method("qevict", 0.2)
    second = generate(model, [_prompt(6, seed=1)], SAMPLER, method, past=first)
    assert isinstance(second.method, FullKV) and second.requested_method == method
    assert second.compressed is False


def test_a_sequence_no_beta_up_to_one_could_compress_is_kept_whole():
    """30 tokens + 128 new: compression could save bytes in principle (the smallest cache is below the whole
    sequence's), but only at a beta above 1 of the budget's tokens; no beta in (0, 1] honours it: kept whole."""
    fit = fit_method(
        make_method("qevict", 0.2),
        model_cfg=CFG,
        lengths=np.asarray([30]),
        max_new_tokens=128,
        budget_rounding="bucket",
        kv_dtype=jnp.bfloat16,
    )
    assert isinstance(fit.method, FullKV) and not fit.compressed


def test_a_long_prompt_still_compresses_with_the_method_asked_for(model):
    prompt = _prompt(2000)
    method = make_method("qevict", 0.2)
    fit = fit_method(
        method,
        model_cfg=CFG,
        lengths=np.asarray([len(prompt)]),
        max_new_tokens=8,
        budget_rounding="bucket",
        kv_dtype=jnp.bfloat16,
    )
    assert fit.method is method and fit.compressed
    res = generate(model, [prompt], SamplerConfig(max_new_tokens=2), method)
    assert res.compressed and res.method is method and res.memory_ratio <= 0.2


def test_a_budget_too_small_for_a_compressible_prompt_is_refused_in_its_terms(model):
    """600 tokens could be compressed, but at β = 0.05 the budget cannot hold QEvict's 128-token recent region:
    refused before any compilation, naming the prompt length, the bytes, the least β and the options."""
    before = sum(EXECUTABLES.compilations.values())
    with pytest.raises(
        ValueError, match=r"prompts of 600 tokens \(\+ 8 new\).*β >= 0\.\d+.*recent=32"
    ) as err:
        generate(model, [_prompt(600)], SAMPLER, make_method("qevict", 0.05))
    assert "beta" not in str(err.value)
    assert sum(EXECUTABLES.compilations.values()) == before
    least = float(str(err.value).split("β >= ")[1].split(",")[0])
    assert 0.05 < least <= 1.0
    fit = fit_method(
        make_method("qevict", least),
        model_cfg=CFG,
        lengths=np.asarray([600]),
        max_new_tokens=8,
        budget_rounding="bucket",
        kv_dtype=jnp.bfloat16,
    )
    assert fit.compressed


@pytest.mark.parametrize("beta", [0.0, -0.1, 1.5, 4.0])
def test_beta_outside_zero_one_is_a_clear_error(beta):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        make_method("qevict", beta)


def test_beta_one_is_accepted():
    assert make_method("snapkv", 1.0).budget == 1.0


@pytest.mark.parametrize("name", ["qevict", "snapkv"])
def test_an_observation_window_longer_than_the_prompt_costs_the_whole_prompt(model, name):
    """n_obs beyond the prompt is the whole prompt: the compiled prefill's working memory and the tokens are
    those of n_obs = the prompt's bucket, not of 100,000 rows."""
    prompt = _prompt(300)
    opts = {"recent": 32} if name == "qevict" else {}  # room for history at β = 0.3 of 300 tokens
    huge = make_method(name, 0.3, n_obs=100_000, **opts)
    whole = make_method(name, 0.3, n_obs=bucket_length(300), **opts)
    temp = [
        lower_prefill(model, [prompt], SAMPLER, m).compile().memory_analysis().temp_size_in_bytes
        for m in (huge, whole)
    ]
    assert temp[0] == temp[1]
    assert generate(model, [prompt], SAMPLER, huge).tokens == generate(model, [prompt], SAMPLER, whole).tokens
