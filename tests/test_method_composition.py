"""A method is a ranking × an allocation × an engine, composed: no baseline inherits a window method, each
window-engine baseline is the window method with its own allocation, and every registered method keeps one
routing contract, ``route(cache, inv_freq, due)``."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import decisive_model, tiny_llama, with_repeat_prompt

from qevict_jax.core.budget import (
    BudgetedTiers,
    KeepAll,
    RecentOnly,
    keep_all_capacities,
    solve_capacities,
    solve_local_capacities,
)
from qevict_jax.core.config import num_windows
from qevict_jax.core.kv import CacheRequest, full_kv_bytes
from qevict_jax.methods import baselines
from qevict_jax.methods.qevict import WindowMethod
from qevict_jax.methods.registry import available_methods, configure, default_method, make_method
from qevict_jax.rankings.gates import UNTRAINED
from qevict_jax.runtime.generate import SamplerConfig, generate

MODEL = tiny_llama(2048)
INV_FREQ = jnp.asarray(MODEL.inv_freq(), jnp.float32)


def test_no_baseline_inherits_another_method():
    """Every class of ``methods/baselines.py`` derives from the pool's base or from nothing of a method's;
    the window-engine baselines are instances of ``WindowMethod``, not subclasses."""
    tree = ast.parse(inspect.getsource(baselines))
    pool_policies = {"PoolMethod", "DecodeEviction", "SnapKV"}  # a pool policy may refine another's ranking
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            assert "WindowMethod" not in bases and "QEvict" not in bases, node.name
            assert bases <= {"SizedByCapacities", "Compressing", "ABC", *pool_policies}, (node.name, bases)
    assert type(baselines.BASELINES["streamingllm"]) is WindowMethod
    assert type(baselines.BASELINES["kivi2"]) is WindowMethod


@pytest.mark.parametrize(
    ("name", "allocation", "uses_budget"),
    [("qevict", BudgetedTiers(), True), ("r2", BudgetedTiers(), True), ("streamingllm", RecentOnly(), True),
     ("kivi2", KeepAll(), False), ("kivi4", KeepAll(), False)],
)  # fmt: skip
def test_window_methods_size_their_caches_by_their_allocation(name, allocation, uses_budget):
    """The allocation is the one place a window method's sizing comes from, and it equals the solver it
    names, computed here directly."""
    method = make_method(name, 0.2)
    assert method.allocation == allocation and method.uses_budget is uses_budget
    request = CacheRequest(
        model_cfg=MODEL, batch=2, prompt_capacity=2000, max_new_tokens=40, dtype=jnp.bfloat16, budget_tokens=2040
    )
    got = method.capacities(request)
    cfg = method.cache
    expected = {
        BudgetedTiers: lambda: solve_capacities(
            cfg, MODEL, 2, 2040, jnp.bfloat16, max_windows=num_windows(2040, cfg.sink, cfg.window)
        ),
        RecentOnly: lambda: solve_local_capacities(cfg, MODEL, 2, 2040, jnp.bfloat16),
        KeepAll: lambda: keep_all_capacities(cfg, num_windows(2040, cfg.sink, cfg.window)),
    }[type(allocation)]()
    assert got == expected


def test_structure_fields_are_not_options():
    """What a method is (its allocation, its option list) cannot be set as an option."""
    method = default_method("streamingllm")
    for field in ("allocation", "options", "protects_recent"):
        with pytest.raises(ValueError, match=f"has no option '{field}'"):
            configure(method, 0.2, **{field: None})
    with pytest.raises(ValueError, match="static .*token pool's"):
        WindowMethod(cache=dataclasses.replace(method.cache, static=True))


def _roomy(name: str, tokens: int):
    kw = {"gates": UNTRAINED} if "gates" in default_method(name).options else {}
    if name == "full" or name.startswith("kivi"):
        return make_method(name, **kw)
    # half the uncompressed bytes: every method compresses, and decode-time methods have events
    return with_repeat_prompt(make_method(name, budget_bytes=full_kv_bytes(MODEL, tokens, jnp.bfloat16) // 2, **kw))


@pytest.mark.parametrize("name", available_methods())
def test_every_method_keeps_the_routing_contract(name):
    """``route(cache, inv_freq, due)``: due False changes nothing, due True is the event ``route`` without
    ``due`` runs, and ``decode_route`` is ``route`` with the method's own ``routing_due``."""
    model = decisive_model(MODEL)
    rs = np.random.RandomState(1)
    prompt = [int(t) for t in rs.randint(0, MODEL.vocab_size, 800)]
    method = _roomy(name, len(prompt) + 12)
    cache = generate(model, [prompt], SamplerConfig(max_new_tokens=12), method).cache
    route = jax.jit(lambda c, due: method.route(c, INV_FREQ, due=due))
    chex.assert_trees_all_equal(route(cache, jnp.bool_(False)), cache)
    now = jax.jit(lambda c: method.route(c, INV_FREQ))(cache)
    chex.assert_trees_all_equal(route(cache, jnp.bool_(True)), now)
    due = method.routing_due(cache) if hasattr(method, "routing_due") else jnp.bool_(False)
    chex.assert_trees_all_equal(jax.jit(lambda c: method.decode_route(c, INV_FREQ))(cache), route(cache, due))
