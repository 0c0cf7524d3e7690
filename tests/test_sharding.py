"""Sharded generation (``qevict_jax.core.sharding``): the same tokens and memory on a device mesh as on one device.

The multi-device checks run ``tests/sharding_worker.py`` in a subprocess with 8 fake CPU devices (this
process's backend already started with one); the layout, 1 x 1 mesh and compile-count checks run here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import decisive_model, tiny_llama

from models.model import Transformer
from pallas_kernels.dispatch import use_cpu_kernel
from qevict_jax.core.kv import CacheRequest, FullCache
from qevict_jax.core.sharding import CACHE_LAYOUTS, HEADS, cache_specs, make_mesh, param_specs
from qevict_jax.methods.registry import cache_stats, make_method
from qevict_jax.runtime import generate as gen
from qevict_jax.runtime.decode import decode_jit
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).with_name("sharding_worker.py")
MESHES = ["2x2", "1x4", "2x4"]

TINY = tiny_llama(1024)


@pytest.fixture(scope="module")
def sharded() -> dict:
    """The worker's JSON report (8 fake CPU devices)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return decisive_model(TINY)


def test_worker_saw_eight_devices(sharded):
    """8 devices; QEvict's Q tier ran through the CPU ledger kernel there whenever it builds here (the FFI
    kernel once deadlocked when 8 devices shared its thread pool)."""
    assert sharded["devices"] == 8
    assert sharded["cpu_kernel"] == use_cpu_kernel()


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["full", "qevict"])
def test_sharded_generation_equals_one_device(sharded, name, mesh):
    one, many = sharded["runs"][f"{name}/single"], sharded["runs"][f"{name}/{mesh}"]
    assert many["tokens"] == one["tokens"]
    assert many["cache_bytes"] == one["cache_bytes"]
    assert many["full_kv_bytes"] == one["full_kv_bytes"]
    assert many["memory_ratio"] == one["memory_ratio"]
    for counter in ("routing_events", "evictions", "promotions", "demotions"):
        assert many[counter] == one[counter], counter


def test_deferred_head_mean_on_a_mesh_equals_one_device_and_the_per_step_mean(sharded):
    """``deferred_head_mean`` (per-KV-head running masses, head mean at routing events): on 2 x 4 the same
    tokens, bytes and counters as on one device, and the same tokens and routing as the per-step head mean
    (scores equal up to float rounding on this decisive model); its cache holds Hkv f32 more per scored
    entry, so its memory ratio is a little higher at the same capacities."""
    one, many = sharded["runs"]["qevict-deferred/single"], sharded["runs"]["qevict-deferred/2x4"]
    per_step = sharded["runs"]["qevict/single"]
    for key in ("tokens", "cache_bytes", "memory_ratio", "routing_events", "evictions", "promotions", "demotions"):
        assert many[key] == one[key], key
    for key in ("tokens", "routing_events", "evictions", "promotions", "demotions"):
        assert one[key] == per_step[key], key
    assert per_step["memory_ratio"] < one["memory_ratio"] < per_step["memory_ratio"] * 1.05
    pending = [k for k in many["leaves"] if k.endswith("_pending")]
    assert sorted(pending) == [".f_pending", ".q_pending", ".ring_pending"]
    for k in pending:  # split over the batch and the KV heads, like the tiers
        assert many["leaves"][k]["spec"][:3] == [None, "data", "model"], k


def test_sharded_second_turn_equals_one_device(sharded):
    """A new turn appended to QEvict's compressed cache (jitted append + routing event + decode) on 2 x 4."""
    one, many = sharded["runs"]["qevict-turn2/single"], sharded["runs"]["qevict-turn2/2x4"]
    assert many == one
    assert all(len(t) == 16 for t in one["tokens"])


def test_qevict_run_routes_and_rows_differ_in_length(sharded):
    """The QEvict runs compared above really route (decode events, evictions, tier moves) on a ragged batch."""
    run = sharded["runs"]["qevict/single"]
    assert min(run["routing_events"]) >= 20
    assert min(run["evictions"]) > 0
    assert sum(run["promotions"]) + sum(run["demotions"]) > 0
    assert run["memory_ratio"] < 0.5
    assert len({len(t) for t in run["tokens"]}) == 1  # no EOS: every row decodes all steps
    assert sharded["runs"]["full/single"]["memory_ratio"] > 1.0  # Full-KV's buffer holds the padded bucket


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", ["full", "qevict"])
def test_cache_leaves_carry_their_sharding(sharded, name, mesh):
    """Every leaf: batch (axis 1) over "data"; a leaf with a KV-head axis (axis 2) over "model"; the shard of
    one device is the global shape divided accordingly (so a KV head's tiers live on one device)."""
    data, model_axis = map(int, mesh.split("x"))
    leaves = sharded["runs"][f"{name}/{mesh}"]["leaves"]
    head_leaves = 0
    for path, leaf in leaves.items():
        shape, shard = leaf["shape"], leaf["shard"]
        if 0 in shape:  # an empty leaf (the running masses without deferred_head_mean): XLA reports it unsplit
            assert shard == shape, path
            continue
        spec = leaf["spec"] + [None] * (len(shape) - len(leaf["spec"]))  # XLA drops trailing unsplit axes
        # XLA reports an axis of size 1 as unsplit (None)
        assert spec[0] is None and spec[1] in (("data", None) if data == 1 else ("data",)), path
        want = list(shape)
        want[1] //= data
        if len(spec) > 2 and spec[2] == "model":
            head_leaves += 1
            assert shape[2] == TINY.num_kv_heads, path
            want[2] //= model_axis
        assert shard == want, path
    assert head_leaves >= (2 if name == "full" else 10)


def test_indivisible_batch_and_heads_are_clear_errors(sharded):
    assert "batch 3" in sharded["errors"]["batch"] and "'data'" in sharded["errors"]["batch"]
    assert "num_kv_heads=4" in sharded["errors"]["heads"] and "'model'" in sharded["errors"]["heads"]


@pytest.mark.parametrize("name", ["full", "qevict", "snapkv"])
def test_cache_specs_follow_the_documented_layouts(name):
    """cache_specs on each cache type: every leaf has a spec; the KV-head axis (axis 2, size Hkv) is split
    over "model" exactly for the leaves the layout table marks, never for the others."""
    method = make_method(name, 0.4, recent=16) if name != "full" else make_method("full")
    lengths = jnp.asarray([200, 150], jnp.int32)
    cache = jax.eval_shape(lambda: method.init_cache(CacheRequest(model_cfg=TINY, batch=lengths.shape[0], prompt_capacity=256, max_new_tokens=24, dtype=jnp.bfloat16, budget_tokens=174), lengths))
    specs = cache_specs(cache)
    flat = jax.tree_util.tree_flatten_with_path(cache)[0]
    spec_leaves = jax.tree.leaves(specs)
    assert len(spec_leaves) == len(flat)
    for (path, leaf), spec in zip(flat, spec_leaves, strict=True):
        assert leaf.shape[0] == TINY.num_layers and leaf.shape[1] == 2, path
        assert spec[:2] == (None, "data")
        if len(spec) > 2:
            assert spec[2] == "model" and leaf.shape[2] == TINY.num_kv_heads, path
    if isinstance(cache, FullCache):
        assert specs.k[2] == "model" and specs.v[2] == "model"


def test_cache_layout_table_names_every_field():
    for cls, layout in CACHE_LAYOUTS.items():
        fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("pytree_node", True)}
        assert fields == set(layout), cls.__name__
    assert CACHE_LAYOUTS[FullCache]["k"] == HEADS


def test_param_specs_split_heads_and_mlp_over_model():
    specs = param_specs(TINY, make_mesh(1, 1))
    layers = specs["layers"]
    assert layers["wk"] == jax.sharding.PartitionSpec(None, None, "model")
    assert layers["wo"] == jax.sharding.PartitionSpec(None, "model", None)
    assert layers["w_down"] == jax.sharding.PartitionSpec(None, "model", None)
    assert specs["embed"] == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("name", ["full", "qevict"])
def test_one_by_one_mesh_is_bit_identical(model, name):
    method = make_method(name, 0.4, omega=4, recent=16) if name != "full" else make_method("full")
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, TINY.vocab_size, n).tolist() for n in (190, 140)]
    sampler = SamplerConfig(max_new_tokens=12)
    plain = generate(model, prompts, sampler, method)
    meshed = generate(model, prompts, sampler, method, mesh=make_mesh(1, 1))
    assert meshed.tokens == plain.tokens
    assert meshed.cache_bytes == plain.cache_bytes
    for a, b in zip(jax.tree.leaves(plain.cache), jax.tree.leaves(meshed.cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_long_generation_with_many_routing_events_compiles_once(model):
    """96 new tokens at omega = 2: 47 routing events (evictions, promotions, demotions) inside one
    compiled decode loop; a second prompt of the same bucket compiles nothing."""
    method = make_method("qevict", 0.4, omega=2, recent=16, q_frac=0.5)  # room in F for tier moves
    sampler = SamplerConfig(max_new_tokens=96)
    rs = np.random.RandomState(2)
    before = dict(gen.EXECUTABLES.compilations)
    res = generate(model, [rs.randint(0, TINY.vocab_size, 300).tolist()], sampler, method)
    mid = dict(gen.EXECUTABLES.compilations)
    stats = cache_stats(res.cache)
    assert stats["routing_events"][0] >= 40
    assert stats["evictions"][0] > 0 and stats["promotions"][0] + stats["demotions"][0] > 0
    assert len(res.tokens[0]) == 96
    for fn in ("_prefill", "_decode"):
        assert mid.get(fn, 0) - before.get(fn, 0) <= 1, fn
    generate(model, [rs.randint(0, TINY.vocab_size, 310).tolist()], sampler, method)
    assert dict(gen.EXECUTABLES.compilations) == mid, "a same-bucket prompt compiled again"


def test_decode_loop_donates_the_cache(model):
    """The decode loop donates its cache argument (``donate_argnums``): the buffers handed in are consumed and
    reused for the output, not copied (Full-KV's k/v are the whole cache)."""
    method = make_method("full")
    sampler = SamplerConfig(max_new_tokens=4)
    res = generate(model, [[1, 2, 3, 4, 5]], sampler, method)
    graphdef, state = nnx.split(model)
    cache = res.cache
    out = decode_jit(
        graphdef, state, cache, jnp.asarray([7]), jnp.asarray([9]), jax.random.key(0), method, sampler, None
    )
    jax.block_until_ready(out)
    assert cache.k.is_deleted() and cache.v.is_deleted()
    assert not out[3].k.is_deleted()


PROGRAMS = ["1x2", "2x1", "2x2", "2x4"]
RECENT, WINDOW = 16, 8  # the worker's PROGRAM_METHODS: recent=16 and the default window


def _cache_leaf_shapes(leaves: dict, mesh: str) -> set[tuple[int, ...]]:
    """Every shape under which a cache leaf could cross devices in a decode step: the leaf [L, B, ...] and
    one layer's slice [B, ...] (the layer scan's), each with the batch axis whole or split over "data" and,
    for a leaf split over "model" (shard shape says so), the KV-head axis whole or split. Leaves of one
    value per row ([L, B] counters) are left out: [B] or [L, B] are the shapes of many small activations."""
    data, model_axis = map(int, mesh.split("x"))
    shapes = set()
    for leaf in leaves.values():
        shape, shard = leaf["shape"], leaf["shard"]
        if len(shape) < 3:
            continue
        heads = [shape[2]] + ([shard[2]] if shard[2] != shape[2] else [])
        for b in {shape[1], shape[1] // data}:
            for h in heads:
                rest = [b, h, *shape[3:]]
                shapes |= {tuple(rest), (shape[0], *rest)}
    return shapes


@pytest.mark.parametrize("mesh", PROGRAMS)
@pytest.mark.parametrize("name", ["full", "qevict-0.2", "qevict-0.2-pallas", "qevict-0.2-deferred"])
def test_sharded_decode_gathers_no_cache_leaf(sharded, name, mesh):
    """The compiled decode loop (``compiled.as_text()``) on each mesh has no all-gather whose result or
    operands have the shape of a cache leaf (``_cache_leaf_shapes``: whole, per layer, per device): the
    tier buffers and the ledger stay where they are. With the Pallas kernels (interpret mode) on 2 x 4 too.

    The criterion caught the gathers this was written against: before the ledger attention ran per shard
    (``sharding.on_shards``), the 2 x 4 QEvict program all-gathered every ledger field, e.g. u8[2,4,5,8,2]
    (one layer's k_codes, rows split, KV heads whole) and then u8[4,4,5,8,2]."""
    key = f"{name}/{mesh}"
    if key not in sharded["programs"]:
        assert name == "qevict-0.2-pallas" and mesh != "2x4"
        return
    prog = sharded["programs"][key]
    assert prog["compressed"] == name.startswith("qevict")
    forbidden = _cache_leaf_shapes(prog["leaves"], mesh)
    assert len(forbidden) >= (4 if name == "full" else 20)  # Full-KV: k and v; QEvict: every tier field
    for gather in prog["loop_gathers"]:
        for shape in gather["result"] + gather["operands"]:
            assert tuple(shape) not in forbidden, (key, gather)
    if name.startswith("qevict"):  # and nothing at all is gathered anywhere in QEvict's decode program
        assert prog["all_gather_types"] == [], key


def key_norm_bytes(leaves: dict, data: int) -> int:
    """The bytes one device's routing event all-reduces for a Q tier ranked by key norm (the default's
    q_rank): the head mean of the key norms of the F windows and the candidates, one f32 each per row and
    layer; 0 when the ledger keeps no key norms."""
    if not leaves[".ledger.norm_score"]["shape"][-1]:
        return 0
    layers, rows, nf = leaves[".f_score"]["shape"]
    candidates = (leaves[".ring_k"]["shape"][3] - RECENT) // WINDOW
    return layers * rows * (nf + candidates) * 4 // data


@pytest.mark.parametrize("mesh", PROGRAMS)
def test_qevict_collective_bytes_against_full_kv(sharded, mesh):
    """Per decode step on the same mesh and prompts (the step without a routing event and the one with):
    QEvict at β = 0.2 (CPU kernel, and Pallas kernels on 2 x 4) moves no more bytes through collectives
    than Full-KV, plus, where the KV heads are split ("model" > 1), the head-mean attention mass of each
    scored cache entry: one f32 per F slot, ledger slot and ring window per row and layer (the bytes of
    the score leaves f_score, ledger.score, ring_score one device holds), which its scores need every step
    and Full-KV has none of, and at a routing event the head-mean key norms the Q ranking takes
    (``key_norm_bytes``). The tier buffers never move. Over "data" alone (2 x 1) QEvict moves less."""
    data, model_axis = map(int, mesh.split("x"))
    full = sharded["programs"][f"full/{mesh}"]["collective_bytes"]
    for name in ("qevict-0.2", "qevict-0.2-pallas"):
        prog = sharded["programs"].get(f"{name}/{mesh}")
        if prog is None:
            continue
        leaves = prog["leaves"]
        scores = sum(
            int(np.prod(leaves[k]["shape"])) * 4 // data for k in (".f_score", ".ledger.score", ".ring_score")
        )
        extra = scores if model_axis > 1 else 0
        norms = key_norm_bytes(prog["leaves"], data)
        for step, allowed in (("step", extra), ("routing_step", extra + (norms if model_axis > 1 else 0))):
            assert prog["collective_bytes"][step] <= full[step] + allowed, (name, step, prog["collective_bytes"], full)
        if model_axis == 1:
            assert prog["collective_bytes"]["routing_step"] < full["step"]
    if model_axis > 1:  # the attention and MLP outputs are all-reduced over "model" every layer
        assert full["step"] > 0
    # with the head mean of the masses taken at routing events (``deferred_head_mean``) a step without one
    # moves no more than Full-KV on any mesh, and a routing step at most the score leaves' bytes more: the
    # fold of the running masses into the scores
    deferred = sharded["programs"][f"qevict-0.2-deferred/{mesh}"]
    leaves = deferred["leaves"]
    scores = sum(int(np.prod(leaves[k]["shape"])) * 4 // data for k in (".f_score", ".ledger.score", ".ring_score"))
    assert deferred["collective_bytes"]["step"] <= full["step"], (deferred["collective_bytes"], full)
    allowed = scores + key_norm_bytes(leaves, data) if model_axis > 1 else 0
    assert deferred["collective_bytes"]["routing_step"] <= full["step"] + allowed
    assert deferred["all_gather_types"] == []
