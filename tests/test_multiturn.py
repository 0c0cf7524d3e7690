"""Appending tokens to a compressed cache (question-agnostic mode, later turns) and method options."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from tiny import decisive_model, roomy_method

from models.config import ModelConfig
from models.model import Transformer
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.options import options_for, parse_set_options
from qevict_jax.methods.registry import (
    available_methods,
    default_method,
    make_method,
    method_option,
)
from qevict_jax.runtime.generate import SamplerConfig, generate, generate_shared

TINY = ModelConfig(
    family="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim=8, max_position_embeddings=2048,
)  # fmt: skip
F32 = jnp.float32


@pytest.fixture(scope="module")
def model() -> Transformer:
    return decisive_model(TINY)


@pytest.mark.parametrize("name", ["full", "qevict", "r2", "h2o", "streamingllm"])
def test_next_turn_on_a_compressed_cache_equals_the_concatenation(model, name):
    """A second turn appended to the cache of the first (budget holding everything) generates what Full-KV
    generates on prompt 1 + answer 1 + turn 2 in one go; the caches are continued, not rebuilt."""
    rs = np.random.RandomState(11)
    turn1 = list(rs.randint(0, TINY.vocab_size, 200))
    turn2 = list(rs.randint(0, TINY.vocab_size, 23))
    first_new = 5
    method = roomy_method(name, TINY, 200 + first_new + 23 + 6)
    res1 = generate(model, [turn1], SamplerConfig(max_new_tokens=first_new), method, kv_dtype=F32)
    res2 = generate(model, [turn2], SamplerConfig(max_new_tokens=6), past=res1)
    assert res2.method is method and res1.next_positions == [200 + first_new - 1]
    whole = turn1 + res1.tokens[0] + turn2
    ref = generate(model, [whole], SamplerConfig(max_new_tokens=6), FullKV(), kv_dtype=F32)
    assert res2.tokens == ref.tokens
    assert res2.next_positions == [len(whole) + 5]


def test_a_compress_once_cache_refuses_a_turn_that_does_not_fit(model):
    rs = np.random.RandomState(12)
    res1 = generate(
        model, [list(rs.randint(0, 97, 200))], SamplerConfig(max_new_tokens=4), make_method("snapkv", 0.5)
    )
    with pytest.raises(ValueError, match="ring"):
        generate(model, [list(rs.randint(0, 97, 30))], SamplerConfig(max_new_tokens=4), past=res1)


def test_appended_question_mass_promotes_q_windows(model):
    """After an appended chunk the routing event runs: scores include the chunk's mass and counters move."""
    rs = np.random.RandomState(13)
    prompt = list(rs.randint(0, 97, 400))
    method = make_method("qevict", 0.3, recent=16)
    res = generate(model, [prompt], SamplerConfig(max_new_tokens=2), method, question_starts=[360])
    events = np.asarray(res.cache.routing_events)[:, 0]
    # 40 appended tokens: 40 / Ω = 5 decode-step events + 1 forced event (+ at most one in 2 decode steps)
    assert (events >= 6).all()


def test_shared_prefill_equals_one_prefill_per_method(model):
    rs = np.random.RandomState(14)
    prompts = [list(rs.randint(0, 97, 300)), list(rs.randint(0, 97, 280))]
    names = ["full", "qevict", "snapkv"]
    methods = [make_method(n, 0.3, **({"recent": 32} if n in ("qevict", "r2") else {})) for n in names]
    sampler = SamplerConfig(max_new_tokens=5)
    shared = generate_shared(model, prompts, sampler, methods, kv_dtype=F32)
    for m, res in zip(methods, shared, strict=True):
        alone = generate(model, prompts, sampler, m, kv_dtype=F32)
        assert res.tokens == alone.tokens and res.cache_bytes == alone.cache_bytes
    qa = generate_shared(model, prompts, sampler, methods, question_starts=[290, 270], kv_dtype=F32)
    for m, res in zip(methods, qa, strict=True):
        assert (
            res.tokens
            == generate(model, prompts, sampler, m, question_starts=[290, 270], kv_dtype=F32).tokens
        )


# ----------------------------------------------------------------------------------------------- options


def _sample_value(method, option: str):
    """A legal value different from the current one."""
    current = method_option(method, option)
    if isinstance(current, bool):
        return not current
    if option == "ranking":
        return "cumulative-all"
    if option == "gates":  # a gate checkpoint folder (read when the method runs, not when it is built)
        return "some/gates"
    if option == "pallas" and current is None:
        return False
    if option == "q_frac" and method.cache.window % 4:
        return None  # R1 (W = 1) cannot hold INT2 windows: no other legal value
    if option == "budget_bytes":
        return 123_456
    if option == "q_logit_bias":  # <= 0
        return current - 1.0
    if option == "q_bias_gate":  # gates a discount: legal only where the method has one
        return 0.5 if method.cache.q_logit_bias else None
    if option == "bits":
        return 4 if current == 2 else 2
    if option == "quant":
        return "rot-k4v2" if current != "rot-k4v2" else "channel"
    if option == "q_rank":
        return "blend" if current != "blend" else "score"
    if option in ("window",):
        return 16 if current != 16 else 8
    if option == "recent":
        return 48 if getattr(method.cache, "window", 1) in (1, 8, 16) else 64
    if isinstance(current, float):
        return current / 2 if current else 0.25
    return current + 1 if current is not None else 3


@pytest.mark.parametrize("name", available_methods())
def test_every_option_reaches_the_method_by_both_paths(name):
    """make_method(name, b, opt=v) and the CLI's --set opt=v (and --set name.opt=v) give the same method,
    which reports v; an option the method lacks is a clear error on both paths."""
    base = default_method(name)
    assert base.options, f"{name} has no options"
    for option in base.options:
        value = _sample_value(base, option)
        if value is None:
            continue
        direct = make_method(name, 0.3, **{option: value})
        assert method_option(direct, option) == value
        for item in (f"{option}={value}", f"{name}.{option}={value}"):
            via_cli = make_method(name, 0.3, **options_for(name, parse_set_options([item])))
            assert via_cli == direct
    with pytest.raises(ValueError, match=f"method '{name}' has no option 'no_such_option'"):
        make_method(name, 0.3, no_such_option=1)
    with pytest.raises(ValueError, match="has no option"):
        make_method(name, 0.3, **options_for(name, parse_set_options(["no_such_option=1"])))


def test_n_obs_reaches_the_ranking_and_the_policy():
    assert make_method("qevict", 0.2, n_obs=64).ranking.n_obs == 64
    assert make_method("qevict", 0.2, max_pool_width=5).ranking.max_pool_width == 5
    # spills are tokens in the configuration and windows (W = 8, rounded up) in the ranking
    spilled = make_method("qevict", 0.2, spill=16, q_spill=9).ranking
    assert (spilled.spill, spilled.q_spill) == (2, 2)
    assert make_method("qevict", 0.2, spill=16).ranking.q_spill is None
    with pytest.raises(ValueError, match="q_spill must be >= 0"):
        make_method("qevict", 0.2, q_spill=-1)
    assert make_method("snapkv", 0.2, n_obs=64).n_obs == 64
    assert make_method("snapkv", 0.2, n_obs=64).cache == make_method("snapkv", 0.2).cache
    with pytest.raises(ValueError, match="has no option 'n_obs'"):
        make_method("h2o", 0.2, n_obs=64)
    scoped = parse_set_options(["recent=64", "snapkv.n_obs=48", "ranking=cumulative-all"])
    assert scoped == {None: {"recent": 64, "ranking": "cumulative-all"}, "snapkv": {"n_obs": 48}}
    assert options_for("snapkv", parse_set_options(["snapkv.n_obs=48"])) == {"n_obs": 48}
    with pytest.raises(ValueError, match="name=value"):
        parse_set_options(["n_obs"])


def test_benchmark_recent_region_reaches_methods_that_protect_one():
    from qevict_jax.eval.harness import resolve_methods

    methods = resolve_methods(["full", "qevict", "snapkv", "h2o", "kivi2", "streamingllm"], [0.2], recent=64)
    assert method_option(methods[("qevict", 0.2)], "recent") == 64
    assert method_option(methods[("snapkv", 0.2)], "recent") == 64
    assert method_option(methods[("h2o", 0.2)], "recent") == 0.5  # H2O's heavy/recent split is its own
    by_name = {name: m for (name, _), m in methods.items()}
    assert method_option(by_name["kivi2"], "recent") == 128  # KIVI's residual
    explicit = resolve_methods(["qevict"], [0.2], scoped_options={None: {"recent": 128}}, recent=64)
    assert method_option(explicit[("qevict", 0.2)], "recent") == 128
    assert dataclasses.is_dataclass(methods[("full", None)])


@pytest.mark.parametrize(
    ("method", "old", "new"),
    [
        ("qevict", "kernel", "'pallas'"),
        ("snapkv", "kernel", "'avg_pool_width'"),
        ("qevict", "pool", "'max_pool_width'"),
    ],
)
def test_a_renamed_option_names_its_replacement(method, old, new):
    with pytest.raises(ValueError, match=f"option '{old}' was renamed: use .*{new}"):
        make_method(method, 0.2, **{old: 5})


def test_one_name_per_option_across_methods():
    """No option means two things: an option name shared by methods is the same field of the same kind."""
    kinds: dict[str, set[str]] = {}
    for name in available_methods():
        method = default_method(name)
        for option in method.options:
            value = method_option(method, option)
            kinds.setdefault(option, set()).add(type(value).__name__ if value is not None else "None")
    assert "kernel" not in kinds and "pool" not in kinds
    assert kinds["max_pool_width"] == kinds["avg_pool_width"] == {"int"} and kinds["pallas"] <= {
        "bool",
        "None",
    }
