"""Inputs shorter than what a method keeps uncompressed: kept whole (and said so), never refused; a β too
small for a sequence that could be compressed is raised to the least β that holds it, with a note (refused
before any compute, in the prompt's terms, where the β may not change, and for a size in bytes); a
conversation kept whole is compressed at the first turn that gains; β is a fraction in (0, 1]; an
observation window longer than the prompt costs no more than the whole prompt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import tiny_llama

from models.model import Transformer
from qevict_jax.core.kv import full_kv_bytes
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


def _fit(method, n: int, **kw):
    return fit_method(
        method, model_cfg=CFG, lengths=np.asarray([n]), max_new_tokens=8, budget_rounding="bucket",
        kv_dtype=jnp.bfloat16, **kw,
    )  # fmt: skip


def test_a_budget_too_small_for_a_compressible_prompt_is_refused_in_its_terms_where_beta_is_fixed(model):
    """600 tokens could be compressed, but at β = 0.05 the budget cannot hold QEvict's 128-token recent
    region. Where the β may not change (``least_beta=False``: an evaluation cell) it is refused before any
    compilation, naming the prompt length, the bytes, the least β and the options; that least β holds it."""
    before = sum(EXECUTABLES.compilations.values())
    with pytest.raises(
        ValueError, match=r"prompts of 600 tokens \(\+ 8 new\).*β >= 0\.\d+.*recent=32"
    ) as err:
        _fit(make_method("qevict", 0.05), 600, least_beta=False)
    assert "beta" not in str(err.value)
    assert sum(EXECUTABLES.compilations.values()) == before
    least = float(str(err.value).split("β >= ")[1].split(",")[0])
    assert 0.05 < least <= 1.0
    assert _fit(make_method("qevict", least), 600).compressed


def test_generate_compresses_a_mid_length_prompt_at_the_least_beta_and_says_so(model):
    """The same 600 tokens through ``generate`` at β = 0.05: compressed at the least β that holds the smallest
    cache (the one the refusal names), with a one-line note naming both β; the tokens and the cache are those
    of the method asked for at that β, and the measured ratio is at most it."""
    strict = pytest.raises(ValueError, match=r"β >= (0\.\d+)")
    with strict as err:
        _fit(make_method("qevict", 0.05), 600, least_beta=False)
    least = float(err.value.args[0].split("β >= ")[1].split(",")[0])
    asked = make_method("qevict", 0.05)
    res = generate(model, [_prompt(600)], SAMPLER, asked)
    ref = generate(model, [_prompt(600)], SAMPLER, make_method("qevict", least))
    assert res.compressed and res.requested_method == asked and res.method.budget == least
    assert res.note is not None and "\n" not in res.note
    assert "β=0.05" in res.note and f"β={least:g}" in res.note
    assert ref.note is None
    assert res.tokens == ref.tokens and res.cache_bytes == ref.cache_bytes
    assert res.memory_ratio <= least and res.compressed_at == [600]


def test_a_fixed_byte_budget_too_small_is_refused_naming_budget_bytes(model):
    """A size given in bytes is never raised: too small for the smallest cache, it is refused in bytes."""
    want = r"budget_bytes=1000 cannot compress prompts of 600 tokens.*raise budget_bytes"
    with pytest.raises(ValueError, match=want):
        generate(model, [_prompt(600)], SAMPLER, make_method("qevict", budget_bytes=1000))


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


def _turns(model, method, sizes: list[int], *, growing: bool = False, seed: int = 20):
    """A conversation of random turns of ``sizes`` tokens through ``method`` (``generate``, then ``past``):
    (turns, results)."""
    turns = [_prompt(n, seed=seed + i) for i, n in enumerate(sizes)]
    results = [generate(model, [turns[0]], SAMPLER, method, growing=growing)]
    for turn in turns[1:]:
        results.append(generate(model, [turn], SAMPLER, past=results[-1]))
    return turns, results


def test_a_conversation_kept_whole_is_compressed_at_the_first_turn_where_beta_holds_it(model):
    """Turns of 20, 30, 1000 and 40 tokens at β = 0.2: the first two are kept whole (Full-KV), the third
    compresses the whole conversation so far as a prefill of it would (the tokens and cache of ``generate`` on
    that history), the fourth is appended to that cache, whose size does not change. The history is what a
    hand-built transcript (turns and answers in order) says it is."""
    method = make_method("qevict", 0.2)
    turns, res = _turns(model, method, [20, 30, 1000, 40])
    assert [r.compressed for r in res] == [False, False, True, True]
    assert isinstance(res[1].method, FullKV) and res[2].method == method and res[3].method == method
    transcript: list[int] = []
    for turn, r in zip(turns, res, strict=True):
        transcript += turn + r.tokens[0]
        assert r.history == [transcript] and len(transcript) == r.next_positions[0] + 1
    at = len(res[1].history[0]) + len(turns[2])
    assert res[0].compressed_at is None and res[2].compressed_at == res[3].compressed_at == [at]
    assert res[2].note is None and res[2].prompt_lengths == [len(turns[2])]
    whole = generate(model, [res[1].history[0] + turns[2]], SAMPLER, method)
    assert res[2].tokens == whole.tokens and res[2].cache_bytes == whole.cache_bytes
    assert 0.15 < res[2].memory_ratio <= 0.2  # β of the sequence at the switch (bucket floor: >= 0.75 β)
    after = generate(model, [turns[3]], SAMPLER, past=whole)
    assert res[3].tokens == after.tokens
    assert res[3].cache_bytes == res[2].cache_bytes  # a constant footprint as the conversation grows
    assert res[3].memory_ratio < res[2].memory_ratio


def test_a_conversation_that_reaches_a_mid_length_is_compressed_at_the_least_beta(model):
    """20 then 250 tokens at β = 0.2: the sequence can be compressed but β = 0.2 cannot hold the smallest
    cache; the second turn compresses at the least β that can, says so in one line, and equals ``generate``
    on the history at that β."""
    turns, res = _turns(model, make_method("qevict", 0.2), [20, 250])
    assert not res[0].compressed and res[1].compressed
    least = res[1].method.budget
    assert 0.2 < least < 1 and "β=0.2" in res[1].note and f"β={least:g}" in res[1].note
    ref = generate(model, [res[0].history[0] + turns[1]], SAMPLER, make_method("qevict", least))
    assert res[1].tokens == ref.tokens and res[1].cache_bytes == ref.cache_bytes


def test_a_fixed_byte_budget_is_used_once_the_conversation_outgrows_it_and_kept(model):
    """budget_bytes of 300 uncompressed tokens: a conversation (``growing``) of 200 tokens is kept whole (the
    method's cache would not be smaller), the turn that takes it past 300 compresses it into at most
    budget_bytes, and the next turn keeps exactly that size."""
    budget = full_kv_bytes(CFG, 300, jnp.bfloat16)
    method = make_method("qevict", budget_bytes=budget)
    _, res = _turns(model, method, [200, 150, 100], growing=True)
    assert [r.compressed for r in res] == [False, True, True]
    assert res[1].cache_bytes <= budget and res[2].cache_bytes == res[1].cache_bytes
    assert res[1].full_kv_bytes > budget
