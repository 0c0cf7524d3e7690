"""Batch x context throughput of Full-KV and QEvict (β = 0.2, 0.1), side by side in one process.

For each context and batch: TTFT, TPOT (ms per decode step), aggregate decode tokens/s over the batch, the
cache's bytes (sum of ``nbytes`` over the cache pytree, as the project defines memory) and peak memory,
each with its ratio to Full-KV in the same row.

Peak memory is XLA's buffer assignment of the compiled executable that ran (``memory_analysis()``:
arguments + outputs - aliased (donated) + temporaries), less the parameters: the most bytes the program
holds at once besides the weights. "prefill peak" is that of the jitted prefill; "decode peak" of the decode
loop. "activations-only peak" is that of the same prefill forward with no KV cache at all
(``_activation_prefill``, compiled, not run); the bound on the prefill is: prefill peak - activations-only
peak <= one layer's full KV of the padded prompt in the compute dtype + the method's cache ("bound held"). On a GPU the device's ``peak_bytes_in_use`` high-water mark is printed too; on the
CPU the process's RSS high-water (``resource.getrusage``) once at the end (it only grows, so it is not split
per row).

Prompts are random token ids (throughput does not depend on the text), row i of length
``context - 8 * (i % 8)``: a ragged batch within one length bucket. Greedy decoding, no EOS: every row
decodes ``--new-tokens`` tokens.

``--cache-memory BYTES``: for that fixed cache memory, the largest batch (up to ``--max-batch``) whose cache
fits, per method (its bytes from ``jax.eval_shape`` of the real constructor), then one run at that batch:
aggregate tokens/s and the ratios of batch and tokens/s to Full-KV's largest batch.

CPU: ``--model`` (default SmolLM2-135M-Instruct; f32 compute, bf16 KV), ``--contexts 2048,4096,8192``.
GPU (``--gpu``): random bf16 weights in Llama-3.1-8B shapes, built on the device (no checkpoint),
``--contexts 32768,65536,131072``, batch 1, stopping before ``--time-limit`` seconds (default 420) so that
one call stays under 8 minutes.

``--prefill-memory``: only the prefill memory columns, from the compiled programs (compiled, not run), so
that long contexts cost compile time only; SnapKV (β = 0.2, a token-pool baseline) is measured too.

``--mesh 1x2,2x1,2x2``: sharded generation (``generate(..., mesh=...)``, "data" x "model") on each mesh:
decode tokens/s in all and per device, and the bytes one device moves through collectives per decode step,
read from the compiled decode loop that ran (``hlo_collectives.decode_step_collective_bytes``: a step without a
routing event, and one with), for Full-KV and QEvict at β = 0.2, with the head mean of the attention masses
every step and at routing events only (``deferred_head_mean``). Fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``) share the machine's cores, so their tokens/s say
little; the collective bytes are those of the program a real mesh would run. On the CPU the model is random
f32 weights in Qwen2.5-0.5B shapes (2 KV heads, 14 heads: split by a "model" axis of 2), default context 1024,
batch 2 (divisible by a "data" axis of 2); ``--gpu`` keeps its Llama-3.1-8B shapes.

Usage:
  python bench/throughput.py [--contexts 2048] [--batches 1,4] [--new-tokens 16]
  python bench/throughput.py --prefill-memory --contexts 2048,4096,8192 --batches 1,4
  python bench/throughput.py --contexts 2048 --cache-memory 200000000 --max-batch 32
  python bench/throughput.py --gpu
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/throughput.py --mesh 1x2,2x1,2x2
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hlo_collectives import decode_step_collective_bytes

from models.checkpoint import load_model
from models.config import ModelConfig
from models.model import Transformer, uncached_attend
from models.registry import resolve_model
from qevict_jax.core.kv import KVMethod
from qevict_jax.core.sharding import make_mesh
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import add_model_arg
from qevict_jax.runtime.compiled import EXECUTABLES, bucket_length
from qevict_jax.runtime.generate import GenerationResult, generate, lower_prefill
from qevict_jax.runtime.prefill import planned_cache
from qevict_jax.runtime.sampling import SamplerConfig

LLAMA31_8B = ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    rope_llama3=(8.0, 1.0, 4.0, 8192),
    max_position_embeddings=131072,
)


QWEN25_05B = ModelConfig(
    family="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=True,
    max_position_embeddings=32768,
)


def methods() -> list[tuple[str, KVMethod]]:
    """Full-KV first (the reference of every ratio), then QEvict at β = 0.2 and 0.1."""
    return [
        ("Full-KV", make_method("full")),
        ("QEvict β=0.2", make_method("qevict", 0.2)),
        ("QEvict β=0.1", make_method("qevict", 0.1)),
    ]


def memory_methods() -> list[tuple[str, KVMethod]]:
    """``methods()`` and a token-pool baseline (SnapKV at β = 0.2), for ``--prefill-memory``."""
    return [*methods(), ("SnapKV β=0.2", make_method("snapkv", 0.2))]


def random_llama31_8b() -> Transformer:
    """Llama-3.1-8B shapes with random bf16 weights, initialized on the default device."""
    return Transformer(LLAMA31_8B, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def prompts_for(
    cfg: ModelConfig, context: int, batch: int, new_tokens: int, seed: int = 0
) -> list[list[int]]:
    """``batch`` random prompts, row i of ``context - 8 * (i % 8)`` tokens (capped by the model's context)."""
    n = min(context, cfg.max_position_embeddings - new_tokens)
    rs = np.random.RandomState(seed)
    return [rs.randint(0, cfg.vocab_size, n - 8 * (i % 8)).tolist() for i in range(batch)]


def planned_cache_bytes(
    method: KVMethod, cfg: ModelConfig, lengths: list[int], new_tokens: int, kv_dtype
) -> int:
    """Bytes of the cache ``generate`` builds for these prompt lengths, from ``jax.eval_shape`` (nothing
    allocated): the same constructor, capacity and budget tokens (bucket rounding) as ``generate``."""
    shapes = planned_cache(
        method,
        model_cfg=cfg,
        lengths=np.asarray(lengths, np.int32),
        max_new_tokens=new_tokens,
        kv_dtype=kv_dtype,
    )
    return int(sum(np.prod(s.shape, dtype=np.int64) * s.dtype.itemsize for s in jax.tree.leaves(shapes)))


def executable_peak(compiled: Any, param_bytes: int) -> int:
    """XLA's peak buffer bytes of a compiled executable, less the parameters (see module doc)."""
    stats = compiled.memory_analysis()
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    return int(total - param_bytes)


def program_peak(name: str, param_bytes: int) -> int:
    """``executable_peak`` of the executable ``name`` ran last."""
    return executable_peak(EXECUTABLES.latest(name), param_bytes)


def _activation_prefill(graphdef, state, tokens: jax.Array, lengths: jax.Array) -> jax.Array:
    """The prefill's forward pass without any KV cache: tokens [B, P] right-padded, lengths [B] -> logits at
    each row's last prompt token [B, V]. Its peak is what the prompt's activations alone need."""
    model: Transformer = nnx.merge(graphdef, state)
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, _ = model(tokens, positions, None, uncached_attend, logit_index=lengths - 1)
    return logits


def activation_peak(model: Transformer, batch: int, prompt_capacity: int, param_bytes: int) -> int:
    """``executable_peak`` of ``_activation_prefill`` compiled (not run) for [batch, prompt_capacity] tokens."""
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((batch, prompt_capacity), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    compiled = (
        jax.jit(_activation_prefill, static_argnums=0).lower(graphdef, state, tokens, lengths).compile()
    )
    return executable_peak(compiled, param_bytes)


def device_peak() -> int | None:
    """The default device's ``peak_bytes_in_use`` (GPU), None where the backend has no memory stats (CPU)."""
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def release() -> None:
    """Forget compiled programs and free the last run's buffers before the next configuration."""
    EXECUTABLES.clear()
    jax.clear_caches()
    gc.collect()


def measure(model, cfg, prompts, sampler, method, kv_dtype, param_bytes) -> dict[str, Any]:
    res: GenerationResult = generate(model, prompts, sampler, method, kv_dtype=kv_dtype)
    steps = max(len(t) for t in res.tokens) - 1
    row = {
        "ttft_s": res.ttft_s,
        "tpot_ms": res.decode_s / steps * 1e3,
        "tok_s": res.decode_tokens_per_s,
        "cache_bytes": res.cache_bytes,
        "memory_ratio": res.memory_ratio,
        "prefill_peak": program_peak("_prefill", param_bytes),
        "decode_peak": program_peak("_decode", param_bytes),
        "device_peak": device_peak(),
    }
    del res
    release()
    return row


def one_layer_kv(cfg: ModelConfig, prompts: list[list[int]], compute_dtype) -> int:
    """Bytes of one layer's full K and V of the padded prompt batch in the compute dtype."""
    p = bucket_length(max(len(x) for x in prompts))
    return len(prompts) * p * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(compute_dtype).itemsize


def mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


PREFILL_MEMORY_HEADER = (
    "| prefill peak MB | prefill vs Full | activations-only peak MB | prefill - activations MB "
    "| 1 layer KV + cache MB | bound held |"
)


def prefill_memory_columns(peak: int, ref_peak: int, act: int, layer_kv: int, cache_bytes: int) -> str:
    """The prefill memory columns of a row (``PREFILL_MEMORY_HEADER``): the peak, its ratio to Full-KV's, the
    activations-only peak, the difference and the bound it is held to (one layer's KV + the cache)."""
    held = "yes" if peak - act <= layer_kv + cache_bytes else "NO"
    return (
        f"| {mb(peak)} | {peak / ref_peak:.3f} | {mb(act)} | {mb(peak - act)} | {mb(layer_kv + cache_bytes)} "
        f"| {held} |"
    )


def rows(cfg, args, t_start: float):
    """(context, batch, prompts) of the sweep, until ``--time-limit`` (then a line says where it stopped)."""
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            if args.time_limit and time.perf_counter() - t_start > args.time_limit:
                print(
                    f"(stopped: --time-limit {args.time_limit} s reached before context {context}, batch {batch})"
                )
                return
            yield context, batch, prompts_for(cfg, context, batch, args.new_tokens)


def sweep(model, cfg, args, kv_dtype, compute_dtype, param_bytes, t_start: float) -> None:
    sampler = SamplerConfig(max_new_tokens=args.new_tokens)
    print(
        "| context | batch | method | TTFT (s) | TPOT (ms) | decode tok/s | tok/s vs Full | cache MB | cache vs Full "
        "| memory ratio " + PREFILL_MEMORY_HEADER + " decode peak MB | decode peak vs Full | device peak MB |"
    )
    print("|" + "---|" * 19)
    for _, batch, prompts in rows(cfg, args, t_start):
        layer_kv = one_layer_kv(cfg, prompts, compute_dtype)
        act = activation_peak(model, batch, bucket_length(max(len(x) for x in prompts)), param_bytes)
        ref = None
        for label, method in methods():
            r = measure(model, cfg, prompts, sampler, method, kv_dtype, param_bytes)
            ref = ref or r
            memory = prefill_memory_columns(
                r["prefill_peak"], ref["prefill_peak"], act, layer_kv, r["cache_bytes"]
            )
            print(
                f"| {len(prompts[0])} | {batch} | {label} | {r['ttft_s']:.3f} | {r['tpot_ms']:.1f} "
                f"| {r['tok_s']:.1f} | {r['tok_s'] / ref['tok_s']:.2f}x | {mb(r['cache_bytes'])} "
                f"| {r['cache_bytes'] / ref['cache_bytes']:.3f} | {r['memory_ratio']:.3f} {memory} "
                f"{mb(r['decode_peak'])} | {r['decode_peak'] / ref['decode_peak']:.3f} | {mb(r['device_peak'])} |",
                flush=True,
            )


def prefill_memory(model, cfg, args, kv_dtype, compute_dtype, param_bytes, t_start: float) -> None:
    """``--prefill-memory``: the prefill memory columns of the sweep from the compiled programs alone
    (``generate.lower_prefill``; nothing runs, so long contexts cost compile time only)."""
    sampler = SamplerConfig(max_new_tokens=args.new_tokens)
    print("| context | batch | method | cache MB " + PREFILL_MEMORY_HEADER)
    print("|" + "---|" * 10)
    for _, batch, prompts in rows(cfg, args, t_start):
        layer_kv = one_layer_kv(cfg, prompts, compute_dtype)
        act = activation_peak(model, batch, bucket_length(max(len(x) for x in prompts)), param_bytes)
        ref_peak = None
        for label, method in memory_methods():
            peak = executable_peak(
                lower_prefill(model, prompts, sampler, method, kv_dtype=kv_dtype).compile(), param_bytes
            )
            ref_peak = ref_peak or peak
            cache = planned_cache_bytes(method, cfg, [len(p) for p in prompts], args.new_tokens, kv_dtype)
            columns = prefill_memory_columns(peak, ref_peak, act, layer_kv, cache)
            print(f"| {len(prompts[0])} | {batch} | {label} | {mb(cache)} {columns}", flush=True)
        release()


def parse_meshes(text: str) -> list[tuple[int, int]]:
    """``--mesh 1x2,2x1`` -> [(1, 2), (2, 1)] (data, model)."""
    try:
        return [tuple(int(x) for x in m.lower().split("x")) for m in text.split(",") if m.strip()]
    except ValueError:
        raise ValueError(f"--mesh takes DATAxMODEL[,DATAxMODEL...], got {text!r}") from None


def measure_sharded(model, prompts, sampler, method, kv_dtype, mesh_shape: tuple[int, int]) -> dict[str, Any]:
    """One generation on a ``mesh_shape`` mesh: decode tokens/s (all, per device), memory ratio and the
    collective bytes per decode step of its compiled decode loop (see module doc)."""
    mesh = make_mesh(*mesh_shape)
    res = generate(model, prompts, sampler, method, kv_dtype=kv_dtype, mesh=mesh)
    collective = decode_step_collective_bytes(EXECUTABLES.latest("_decode").as_text())
    row = {
        "devices": mesh.size,
        "tok_s": res.decode_tokens_per_s,
        "tok_s_per_device": res.decode_tokens_per_s / mesh.size,
        "memory_ratio": res.memory_ratio,
        "compressed": res.compressed,
        "step_bytes": collective["step"],
        "routing_step_bytes": collective["routing_step"],
    }
    del res
    release()
    return row


def mesh_sweep(model, cfg, args, kv_dtype, t_start: float) -> None:
    """``--mesh``: per context, batch and mesh, Full-KV and QEvict side by side (see module doc)."""
    meshes = parse_meshes(args.mesh)
    need = max(d * m for d, m in meshes)
    if jax.device_count() < need:
        sys.exit(
            f"--mesh {args.mesh} needs {need} devices, {jax.device_count()} available (on a CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need})"
        )
    sampler = SamplerConfig(max_new_tokens=args.new_tokens)
    print(
        "| context | batch | mesh | method | memory ratio | decode tok/s | tok/s per device "
        "| collective bytes / step | with routing event | step vs Full-KV | routing step vs Full-KV |"
    )
    print("|" + "---|" * 11)
    # Full-KV, QEvict β = 0.2 (β = 0.1 cannot compress 1K at R = 128), and QEvict β = 0.2 with the head mean
    # of the masses taken at routing events (``deferred_head_mean``)
    mesh_methods = [*methods()[:2], ("QEvict β=0.2 deferred", make_method("qevict", 0.2, deferred_head_mean=True))]
    ratio = lambda a, b: "-" if b == 0 else f"{a / b:.3f}"
    for _, batch, prompts in rows(cfg, args, t_start):
        for mesh_shape in meshes:
            ref = None
            for label, method in mesh_methods:
                r = measure_sharded(model, prompts, sampler, method, kv_dtype, mesh_shape)
                ref = ref or r
                print(
                    f"| {len(prompts[0])} | {batch} | {mesh_shape[0]}x{mesh_shape[1]} | {label} "
                    f"| {r['memory_ratio']:.3f} | {r['tok_s']:.1f} | {r['tok_s_per_device']:.1f} "
                    f"| {r['step_bytes']} | {r['routing_step_bytes']} | {ratio(r['step_bytes'], ref['step_bytes'])} "
                    f"| {ratio(r['routing_step_bytes'], ref['step_bytes'])} |",
                    flush=True,
                )


def fixed_memory(model, cfg, args, kv_dtype, param_bytes) -> None:
    """Largest batch per method within ``--cache-memory`` bytes of cache, and its aggregate tokens/s."""
    sampler = SamplerConfig(max_new_tokens=args.new_tokens)
    context = int(args.contexts.split(",")[0])
    print(f"cache memory {args.cache_memory / 1e6:.1f} MB, context {context}, {args.new_tokens} new tokens")
    print("| method | largest batch | cache MB | TPOT (ms) | decode tok/s | batch vs Full | tok/s vs Full |")
    print("|---|---|---|---|---|---|---|")
    ref = None
    for label, method in methods():
        fits = 0
        for batch in range(1, args.max_batch + 1):
            lengths = [len(p) for p in prompts_for(cfg, context, batch, args.new_tokens)]
            if planned_cache_bytes(method, cfg, lengths, args.new_tokens, kv_dtype) > args.cache_memory:
                break
            fits = batch
        if fits == 0:
            print(f"| {label} | 0 (one row does not fit) | - | - | - | - | - |")
            continue
        prompts = prompts_for(cfg, context, fits, args.new_tokens)
        r = measure(model, cfg, prompts, sampler, method, kv_dtype, param_bytes) | {"batch": fits}
        ref = ref or r
        print(
            f"| {label} | {fits}{'+' if fits == args.max_batch else ''} | {mb(r['cache_bytes'])} "
            f"| {r['tpot_ms']:.1f} | {r['tok_s']:.1f} | {fits / ref['batch']:.2f}x | {r['tok_s'] / ref['tok_s']:.2f}x |",
            flush=True,
        )
    print("('+': the search stopped at --max-batch; ratios are against Full-KV's largest batch)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="random bf16 Llama-3.1-8B shapes at 32K/64K/128K")
    add_model_arg(ap)
    ap.add_argument("--contexts", default=None, help="comma-separated prompt lengths")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument(
        "--cache-memory", type=float, default=None, help="bytes of cache: largest batch per method"
    )
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument(
        "--prefill-memory", action="store_true", help="prefill memory columns only, from compiled programs"
    )
    ap.add_argument("--time-limit", type=float, default=None, help="seconds; stop starting new rows after it")
    ap.add_argument("--mesh", default=None, help="DATAxMODEL[,...]: sharded tokens/s and collective bytes")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.gpu:
        if jax.default_backend() != "gpu":
            sys.exit("--gpu needs a GPU backend (jax.default_backend() is " + jax.default_backend() + ")")
        args.contexts = args.contexts or "32768,65536,131072"
        args.batches = args.batches or "1"
        args.new_tokens = args.new_tokens or 32
        args.time_limit = args.time_limit or 420.0
        model, cfg = random_llama31_8b(), LLAMA31_8B
        kv_dtype = compute_dtype = jnp.bfloat16
        name = "random bf16 weights in Llama-3.1-8B shapes, bf16 KV"
    elif args.mesh:
        args.contexts = args.contexts or "1024"
        args.batches = args.batches or "2"
        args.new_tokens = args.new_tokens or 16
        model, cfg = Transformer(QWEN25_05B, rngs=nnx.Rngs(0)), QWEN25_05B
        kv_dtype, compute_dtype = jnp.bfloat16, model.dtype
        name = "random f32 weights in Qwen2.5-0.5B shapes, bf16 KV"
    else:
        args.contexts = args.contexts or "2048"
        args.batches = args.batches or "1,4"
        args.new_tokens = args.new_tokens or 16
        cfg, model = load_model(resolve_model(args.model))
        kv_dtype, compute_dtype = jnp.bfloat16, model.dtype
        name = f"{args.model}, f32 compute, bf16 KV"
    param_bytes = int(sum(a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param))))
    print(
        f"{name}, {jax.default_backend()} ({jax.devices()[0].device_kind}), {args.new_tokens} new tokens, greedy"
    )
    if args.mesh:
        mesh_sweep(model, cfg, args, kv_dtype, t_start)
    elif args.cache_memory:
        fixed_memory(model, cfg, args, kv_dtype, param_bytes)
    elif args.prefill_memory:
        prefill_memory(model, cfg, args, kv_dtype, compute_dtype, param_bytes, t_start)
    else:
        sweep(model, cfg, args, kv_dtype, compute_dtype, param_bytes, t_start)
    if jax.default_backend() == "cpu":
        print(f"process RSS high-water: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
    print(
        f"elapsed {time.perf_counter() - t_start:.0f} s; ratios are against Full-KV in the same process and row"
    )


if __name__ == "__main__":
    main()
