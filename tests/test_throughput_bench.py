"""bench/throughput.py's measurements on a tiny random model: the planned cache bytes its --cache-memory
search uses are the bytes generate's cache has, and the measured peaks are the executables' own."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from tiny import load_bench, tiny_llama

from models.model import Transformer
from qevict_jax.methods.registry import make_method
from qevict_jax.runtime.sampling import SamplerConfig

throughput = load_bench("throughput")

TINY = tiny_llama(2048)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(TINY, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["full", "qevict"])
def test_planned_cache_bytes_are_what_generate_allocates(model, name):
    method = make_method(name, 0.3, recent=16) if name != "full" else make_method("full")
    prompts = throughput.prompts_for(TINY, 700, 3, 8)
    assert sorted({len(p) for p in prompts}) == [684, 692, 700]  # a ragged batch
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    row = throughput.measure(
        model, TINY, prompts, SamplerConfig(max_new_tokens=8), method, jnp.bfloat16, param_bytes
    )
    planned = throughput.planned_cache_bytes(method, TINY, [len(p) for p in prompts], 8, jnp.bfloat16)
    assert planned == row["cache_bytes"]
    # the decode loop holds at least its cache (donated in, returned out), the prefill at least its output
    assert row["decode_peak"] >= row["cache_bytes"]
    assert row["prefill_peak"] >= row["cache_bytes"]
    assert row["tok_s"] > 0 and row["tpot_ms"] > 0


@pytest.mark.parametrize("name", ["full", "qevict"])
def test_sharded_row_on_one_device_moves_nothing(model, name):
    """``--mesh``'s measurement on a 1 x 1 mesh (this process has one device; the multi-device figures are
    tests/test_sharding.py's): tokens/s per device is the whole, and one device has no collective."""
    method = make_method(name, 0.3, recent=16) if name != "full" else make_method("full")
    prompts = throughput.prompts_for(TINY, 700, 2, 8)
    row = throughput.measure_sharded(
        model, prompts, SamplerConfig(max_new_tokens=8), method, jnp.bfloat16, (1, 1)
    )
    assert row["devices"] == 1 and row["tok_s"] > 0 and row["tok_s_per_device"] == row["tok_s"]
    assert row["step_bytes"] == row["routing_step_bytes"] == 0
    assert row["compressed"] == (name == "qevict")
    assert throughput.parse_meshes("1x2,2x1,2x2") == [(1, 2), (2, 1), (2, 2)]
