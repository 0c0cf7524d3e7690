"""Sharded generation on 8 fake CPU devices, run as its own process by ``tests/test_sharding.py``.

The device count is fixed when JAX's backend starts, and the test suite's process has already started it
with one device, so this script sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before it imports
JAX. It generates with Full-KV and QEvict (a budget where routing evicts, demotes and promotes; four prompts
of different lengths in one batch) on one device and on meshes (data, model) = (2, 2), (1, 4), (2, 4), QEvict
with ``deferred_head_mean`` on one device and on (2, 4), and then appends a second turn to QEvict's cache on one device and on (2, 4), and
prints one JSON object: per method and mesh the tokens, cache bytes, memory ratio, routing counters and, per
cache leaf, its PartitionSpec and the shape of one device's shard; plus the messages of the errors a batch or
a model that does not divide over the mesh raises.

"programs": per mesh (1 x 2, 2 x 1, 2 x 2, 2 x 4) and method (Full-KV; QEvict at β = 0.2 with the CPU
ledger kernel; with the Pallas kernels in interpret mode on 2 x 4; with ``deferred_head_mean``), the
compiled decode loop of a short
generation on the same prompts: its all-gathers (result and operand shapes), the bytes its collectives move
per decode step (``bench/hlo_collectives.py``) and the cache leaves' global and shard shapes
(prompts of ``PROGRAM_LENGTHS`` tokens, which β = 0.2 compresses).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the HLO reader lives with the benches

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from hlo_collectives import decode_loop_collectives, decode_step_collective_bytes  # noqa: E402
from tiny import decisive_model, tiny_llama  # noqa: E402

from pallas_kernels.dispatch import use_cpu_kernel  # noqa: E402
from qevict_jax.core.sharding import make_mesh, param_specs  # noqa: E402
from qevict_jax.methods.registry import cache_stats, make_method  # noqa: E402
from qevict_jax.runtime.compiled import EXECUTABLES  # noqa: E402
from qevict_jax.runtime.generate import generate  # noqa: E402
from qevict_jax.runtime.sampling import SamplerConfig  # noqa: E402

TINY = tiny_llama(1024)
MESHES = [(2, 2), (1, 4), (2, 4)]
# q_frac 0.5: at β = 0.4 the default's 0.85 leaves this model one F slot, which no window ever takes from the
# first one, and the runs must move windows between tiers (the default's format and Q ranking stay)
METHODS = {"full": make_method("full"), "qevict": make_method("qevict", 0.4, omega=2, recent=16, q_frac=0.5)}
DEFERRED = make_method("qevict", 0.4, omega=2, recent=16, q_frac=0.5, deferred_head_mean=True)
PROGRAM_MESHES = [(1, 2), (2, 1), (2, 2), (2, 4)]
PROGRAM_LENGTHS = (520, 470, 560, 500)
PROGRAM_METHODS = {
    "full": make_method("full"),
    "qevict-0.2": make_method("qevict", 0.2, omega=2, recent=16),
    "qevict-0.2-pallas": make_method("qevict", 0.2, omega=2, recent=16, pallas=True),
    "qevict-0.2-deferred": make_method("qevict", 0.2, omega=2, recent=16, deferred_head_mean=True),
}


def leaf_report(cache) -> dict[str, dict]:
    """Per leaf (by its pytree path): the PartitionSpec, the global shape and one device's shard shape."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        spec = getattr(leaf.sharding, "spec", None)
        out[jax.tree_util.keystr(path)] = {
            "spec": None if spec is None else [s if s is None else str(s) for s in spec],
            "shape": list(leaf.shape),
            "shard": list(leaf.addressable_shards[0].data.shape),
        }
    return out


def run(model, prompts, sampler, method, mesh_shape) -> dict:
    mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
    res = generate(model, prompts, sampler, method, mesh=mesh, kv_dtype=jnp.float32)
    stats = cache_stats(res.cache) if method.uses_budget else {}
    return {
        "tokens": res.tokens,
        "cache_bytes": res.cache_bytes,
        "full_kv_bytes": res.full_kv_bytes,
        "memory_ratio": res.memory_ratio,
        "routing_events": stats.get("routing_events"),
        "evictions": stats.get("evictions"),
        "promotions": stats.get("promotions"),
        "demotions": stats.get("demotions"),
        "leaves": leaf_report(res.cache),
    }


def program_report(model, prompts, method, mesh_shape) -> dict:
    """The compiled decode loop of an 8-token generation on ``mesh_shape``: its all-gathers (anywhere in
    the program), collective bytes per step, and the cache leaves' shapes (global, one device's shard)."""
    res = generate(model, prompts, SamplerConfig(max_new_tokens=8), method, mesh=make_mesh(*mesh_shape))
    hlo = EXECUTABLES.latest("_decode").as_text()
    gathers = [
        {"result": [list(s) for s in c.result], "operands": [list(s) for s in c.operands]}
        for c in decode_loop_collectives(hlo, dynamic_loops=True)
        if c.op == "all-gather"
    ]
    # every all-gather of the module, not only the loop's: a gather of the cache before the loop counts too
    everywhere = [line.split("=")[1].split(" all-gather(")[0].strip() for line in hlo.splitlines() if " all-gather(" in line]
    return {
        "compressed": res.compressed,
        "loop_gathers": gathers,
        "all_gather_types": everywhere,
        "collective_bytes": decode_step_collective_bytes(hlo),
        "leaves": {k: {"shape": v["shape"], "shard": v["shard"]} for k, v in leaf_report(res.cache).items()},
    }


def main() -> None:
    model = decisive_model(TINY)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, TINY.vocab_size, n).tolist() for n in (200, 150, 230, 180)]
    sampler = SamplerConfig(max_new_tokens=48)
    report: dict = {"devices": len(jax.devices()), "cpu_kernel": use_cpu_kernel(), "runs": {}, "errors": {}}
    for name, method in METHODS.items():
        for mesh_shape in [None, *MESHES]:
            key = f"{name}/{'single' if mesh_shape is None else 'x'.join(map(str, mesh_shape))}"
            report["runs"][key] = run(model, prompts, sampler, method, mesh_shape)
    # the head mean of the masses taken at routing events only, on one device and on 2 x 4
    for mesh_shape in (None, (2, 4)):
        key = f"qevict-deferred/{'single' if mesh_shape is None else '2x4'}"
        report["runs"][key] = run(model, prompts, sampler, DEFERRED, mesh_shape)
    # a second turn appended to the compressed cache (the jitted append, then decoding) on a 2 x 4 mesh
    turns = [rs.randint(0, TINY.vocab_size, n).tolist() for n in (20, 35, 12, 27)]
    for mesh_shape in (None, (2, 4)):
        mesh = None if mesh_shape is None else make_mesh(*mesh_shape)
        first = generate(model, prompts, sampler, METHODS["qevict"], mesh=mesh, kv_dtype=jnp.float32)
        second = generate(model, turns, SamplerConfig(max_new_tokens=16), past=first, mesh=mesh)
        report["runs"][f"qevict-turn2/{'single' if mesh is None else '2x4'}"] = {
            "tokens": second.tokens,
            "cache_bytes": second.cache_bytes,
            "memory_ratio": second.memory_ratio,
        }
    # longer prompts than above, so that β = 0.2 compresses them (the smallest cache is sinks + ring + a window)
    long_prompts = [rs.randint(0, TINY.vocab_size, n).tolist() for n in PROGRAM_LENGTHS]
    report["programs"] = {
        f"{name}/{'x'.join(map(str, mesh_shape))}": program_report(model, long_prompts, method, mesh_shape)
        for mesh_shape in PROGRAM_MESHES
        for name, method in PROGRAM_METHODS.items()
        if name != "qevict-0.2-pallas" or mesh_shape == (2, 4)
    }
    try:
        generate(model, prompts[:3], sampler, METHODS["full"], mesh=make_mesh(2, 2))
    except ValueError as e:
        report["errors"]["batch"] = str(e)
    try:
        param_specs(TINY, make_mesh(1, 3))
    except ValueError as e:
        report["errors"]["heads"] = str(e)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
