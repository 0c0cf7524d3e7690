"""The CPU ledger kernel alone: microseconds per call and per slot for each Q-tier format, CPU, one process.

Random K/V encoded in each format (``--formats``, names of ``pallas_kernels.formats.QUANT_NAMES``) at the
head shapes of SmolLM2-135M (3 KV heads, 3 query heads each, head_dim 64, W = 8) unless told otherwise, every
slot valid; one jitted ``ledger_attention_cpu`` per (format, slots, batch), compiled and run once before the
clock starts, then ``--calls`` calls timed together (median of ``--repeats`` rounds). Slot counts are what the
budget solver gives the methods at 8K and β = 0.2 (the default 494 Q windows per layer, ``qevict-int2`` 342).
One decode step calls the kernel once per layer (30 on SmolLM2).

Usage: python bench/ledger_kernel_cpu.py [--formats crot-k4v3,channel] [--slots 494,342] [--batches 1,4]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ledger
from pallas_kernels.formats import QuantFormat, quant_format
from pallas_kernels.tiers import QuantTier


def time_kernel(
    *,
    fmt: QuantFormat,
    slots: int,
    batch: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    window: int,
    calls: int,
    repeats: int,
) -> float:
    """Median seconds per call of the CPU kernel over ``slots`` valid windows per row."""
    rng = np.random.default_rng(0)
    shape = (batch, kv_heads, slots, window, head_dim)
    k = jnp.asarray(rng.standard_normal(shape) * 2, jnp.float32)
    v = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    starts = jnp.asarray(np.broadcast_to(window * np.arange(slots), (batch, slots)), jnp.int32)
    inv_freq = jnp.asarray(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim), jnp.float32)
    codes = fmt.encode(k, v, starts[:, None], inv_freq)
    tier = QuantTier(codes, starts, jnp.ones((batch, slots), bool))
    q = jnp.asarray(rng.standard_normal((batch, kv_heads, group, head_dim)), jnp.float32)
    run = jax.jit(functools.partial(cpu_ledger.ledger_attention_cpu, window=window, fmt=fmt))
    jax.block_until_ready(run(q, tier, inv_freq))
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = run(q, tier, inv_freq)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="crot-k4v3,channel")
    ap.add_argument("--slots", default="494,342", help="Q windows per row and layer")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not cpu_ledger.available():
        raise SystemExit(f"the CPU ledger kernel is unavailable: {cpu_ledger.unavailable_reason()}")
    formats = [quant_format(name) for name in args.formats.split(",")]
    slot_counts = [int(x) for x in args.slots.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    print(
        f"CPU ledger kernel, {args.kv_heads} KV heads x {args.group} query heads, head_dim {args.head_dim}, "
        f"W = {args.window}; median of {args.repeats} rounds of {args.calls} calls"
    )
    print("| format | slots | batch | us / call | ns / slot and row |")
    print("|---|---|---|---|---|")
    for fmt in formats:
        for slots in slot_counts:
            for batch in batches:
                seconds = time_kernel(
                    fmt=fmt,
                    slots=slots,
                    batch=batch,
                    kv_heads=args.kv_heads,
                    group=args.group,
                    head_dim=args.head_dim,
                    window=args.window,
                    calls=args.calls,
                    repeats=args.repeats,
                )
                per_slot = seconds / (slots * batch) * 1e9
                print(f"| {fmt.name} | {slots} | {batch} | {seconds * 1e6:.0f} | {per_slot:.0f} |")


if __name__ == "__main__":
    main()
