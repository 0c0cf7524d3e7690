"""One process of a multi-process generation, run by ``tests/test_multihost.py`` (through
``qevict_jax.runtime.distributed.launch``, which sets the ``QEVICT_*`` environment variables and the fake CPU device
count of each process), or alone as the one-process reference.

It joins the ``jax.distributed`` job (``initialize_from_env``; none when run alone), then generates with
Full-KV and QEvict (a budget where routing evicts, demotes and promotes; four prompts of different lengths in
one batch; then a second turn appended to QEvict's cache) as ``tests/sharding_worker.py`` does, on the mesh
``--mesh DATAxMODEL`` over every process's devices (none: one device), and process 0 writes one JSON object
to ``--out`` (a file: the gloo library prints its connection lines on stdout): per method the tokens, cache
bytes, memory ratio and routing counters, and the process and device counts.

``--fail-process I``: process I raises once the first generation is done, while the others go on into the
next one's collectives (the failure test).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np
from tiny import decisive_model, tiny_llama

from qevict_jax.core.sharding import make_mesh
from qevict_jax.methods.registry import cache_stats, make_method
from qevict_jax.runtime.distributed import initialize_from_env, is_main, run_main
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig

TINY = tiny_llama(1024)
# q_frac 0.5: at β = 0.4 the default's 0.85 leaves this model one F slot and no tier moves to compare
METHODS = {"full": make_method("full"), "qevict": make_method("qevict", 0.4, omega=2, recent=16, q_frac=0.5)}


def report(res, method) -> dict:
    stats = cache_stats(res.cache) if method.uses_budget else {}
    return {
        "tokens": res.tokens,
        "cache_bytes": res.cache_bytes,
        "full_kv_bytes": res.full_kv_bytes,
        "memory_ratio": res.memory_ratio,
        **{k: stats.get(k) for k in ("routing_events", "evictions", "promotions", "demotions")},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mesh", default=None, help="DATAxMODEL over jax.devices(); none: one device")
    ap.add_argument("--out", required=True, help="JSON report path (written by process 0)")
    ap.add_argument("--fail-process", type=int, default=None)
    args = ap.parse_args()
    initialize_from_env()
    mesh = None if args.mesh is None else make_mesh(*map(int, args.mesh.split("x")))
    model = decisive_model(TINY)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, TINY.vocab_size, n).tolist() for n in (200, 150, 230, 180)]
    turns = [rs.randint(0, TINY.vocab_size, n).tolist() for n in (20, 35, 12, 27)]
    sampler = SamplerConfig(max_new_tokens=48)
    out: dict = {"processes": jax.process_count(), "devices": len(jax.devices()), "runs": {}}
    for name, method in METHODS.items():
        res = generate(model, prompts, sampler, method, mesh=mesh, kv_dtype=jnp.float32)
        out["runs"][name] = report(res, method)
        if args.fail_process == jax.process_index():
            raise RuntimeError("injected failure after the first generation")
        if name == "qevict":
            second = generate(model, turns, SamplerConfig(max_new_tokens=16), past=res, mesh=mesh)
            out["runs"]["qevict-turn2"] = report(second, method)
    if is_main():
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    run_main(main)
