"""GPU benchmark of the Pallas decode-attention kernels (Q-tier ledger kernel and all-tier attention).

On a GPU (finishes in a few minutes on an H200):
  1. checks every kernel (ledger, dense slots, all tiers) against its jnp reference on fresh random
     inputs, with NaN-poisoned outputs, for every ledger format (``every_format_cases``);
  2. measures the device copy bandwidth (a large jnp copy: bytes read + written / time);
  3. sweeps a few ledger-kernel configurations (block slots, warps) at one context;
  4. times, per context (8K..128K) and batch (1, 8), one layer of decode attention with Llama-3.1-8B
     heads (32 query / 8 KV heads, head_dim 128): bf16 Full-KV (``jax.nn.dot_product_attention``)
     against QEvict's tiers at beta = 0.2 (``fused_partials``) and the Q-tier kernel alone (achieved GB/s
     over the bytes it reads: codes + grids + q + slot metadata);
  5. prints the ratio table last; its last line is the headline ratio.

``--cpu-interpret --small`` runs the same checks and a tiny timing table in Pallas interpret mode on the
CPU (interpret-mode times say nothing about GPU speed; they only show that the script runs).

Tier sizes at beta (per layer and batch row, bytes as allocated): budget = beta * bf16 Full-KV bytes of
the context; sink (5) and ring (recent 128 + W) in bf16 are paid first; of the rest, q_frac = 0.85 (the
default ``qevict``'s) goes to ledger slots (``crot-k4v3`` codes + f16 grids and key means + slot_start + valid
flag), 0.15 to F slots (bf16 + valid).

``bench/gpu.py`` runs these steps, the end-to-end decode and the targets as one time-budgeted plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.formats import QUANT_NAMES, QuantFormat, quant_format  # noqa: E402
from pallas_kernels.fused_attention import dense_slot_attention, fused_partials  # noqa: E402
from pallas_kernels.ledger_attention import ledger_attention  # noqa: E402
from pallas_kernels.quant import QuantizedWindows  # noqa: E402
from pallas_kernels.reference import ledger_partial  # noqa: E402
from pallas_kernels.splitk import Launch  # noqa: E402
from pallas_kernels.tiers import DenseTier, QuantTier, merge_tiers, slot_partial, tier_partials  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Setup:
    """Head shapes and cache configuration of the benchmark."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    window: int = 8
    bits: int = 2
    quant: str = "crot-k4v3"  # the default qevict's ledger format (``pallas_kernels.formats.quant_format``)
    sink: int = 5
    recent: int = 128
    beta: float = 0.2
    q_frac: float = 0.85  # the default qevict's

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def format(self) -> QuantFormat:
        return quant_format(self.quant, self.bits)

    def ledger_head_bytes(self) -> int:
        """Codes and grids of one ledger slot of one KV head."""
        shapes = self.format.field_shapes(self.window, self.head_dim)
        return sum(
            math.prod(shape) * (1 if "codes" in f.name else 2)
            for f in dataclasses.fields(shapes)
            if (shape := getattr(shapes, f.name)) is not None  # a field this format does not have
        )


SMALL = Setup(heads=8, kv_heads=2, head_dim=64)


# ----------------------------------------------------------------------------------------------------------
# tier sizes and random inputs


def tier_sizes(ctx: int, s: Setup) -> tuple[int, int, int]:
    """(NF, NL, NR) for a context of ``ctx`` tokens at budget ``s.beta`` (bytes per layer and row)."""
    bf16 = 2
    token_bytes = 2 * s.kv_heads * s.head_dim * bf16
    budget = s.beta * ctx * token_bytes
    nr = s.recent + s.window
    hist = budget - (s.sink + nr) * token_bytes - 4 * nr  # ring (+ positions)
    ledger_slot = s.kv_heads * s.ledger_head_bytes()
    f_slot = s.window * token_bytes
    nl = max(0, int(s.q_frac * hist // (ledger_slot + 4 + 1)))
    nf = max(0, int((1 - s.q_frac) * hist // (f_slot + 1)))
    return nf, nl, nr


def _uniform(rng: np.random.Generator, shape, lo: float, hi: float, dtype) -> jax.Array:
    return jnp.asarray(rng.uniform(lo, hi, shape).astype(np.float32)).astype(dtype)


def ledger_inputs(
    rng: np.random.Generator, b: int, nl: int, s: Setup, ctx: int, valid_frac: float = 1.0
) -> dict:
    """Random ledger of ``nl`` slots at distinct window positions inside a context of ``ctx`` tokens (drawn by
    numpy: eager ``jax.random`` compiles a program per shape, seconds per case in interpret mode)."""
    hkv, d, w = s.kv_heads, s.head_dim, s.window
    levels = 3
    n_windows = max(nl, (ctx - s.sink) // w)
    wins = np.sort(rng.permutation(n_windows)[:nl])
    valid = rng.uniform(size=(b, nl)) < valid_frac
    shapes = s.format.field_shapes(w, d)
    fields = {}
    for f in dataclasses.fields(shapes):
        if getattr(shapes, f.name) is None:  # a field this format does not have
            continue
        shape = (b, hkv, nl, *getattr(shapes, f.name))
        if "codes" in f.name:
            fields[f.name] = jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))
        elif "scale" in f.name:
            fields[f.name] = _uniform(rng, shape, 0.1 / levels, 1.5 / levels, jnp.float16)
        else:
            fields[f.name] = _uniform(rng, shape, -1.0, 0.0, jnp.float16)
    return dict(
        codes=QuantizedWindows(**fields),
        slot_start=jnp.asarray(np.broadcast_to(s.sink + w * wins, (b, nl)).astype(np.int32)),
        slot_valid=jnp.asarray(valid),
        inv_freq=jnp.asarray((1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32)),
    )


def tier_inputs(seed: int, b: int, ctx: int, s: Setup, dtype=jnp.bfloat16, valid_frac: float = 1.0) -> dict:
    """All arguments of ``fused_partials`` for one layer at context ``ctx`` (tier sizes from the budget)."""
    nf, nl, nr = tier_sizes(ctx, s)
    rng = np.random.default_rng(seed)
    hkv, d, w = s.kv_heads, s.head_dim, s.window
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)
    args = ledger_inputs(rng, b, nl, s, ctx, valid_frac)
    args.update(
        q=normal(b, hkv, s.groups, d),
        sink_k=normal(b, hkv, s.sink, d),
        sink_v=normal(b, hkv, s.sink, d),
        sink_valid=jnp.ones((b, s.sink), bool),
        f_k=normal(b, hkv, nf, w, d),
        f_v=normal(b, hkv, nf, w, d),
        f_valid=jnp.asarray(rng.uniform(size=(b, nf)) < valid_frac),
        ring_k=normal(b, hkv, nr, d),
        ring_v=normal(b, hkv, nr, d),
        ring_valid=jnp.ones((b, nr), bool),
    )
    return args


def ledger_args(args: dict) -> dict:
    """``ledger_attention``'s keyword arguments: q, tier (``QuantTier``), inv_freq."""
    tier = QuantTier(args["codes"], args["slot_start"], args["slot_valid"])
    return dict(q=args["q"], tier=tier, inv_freq=args["inv_freq"])


def fused_args(args: dict) -> dict:
    """``fused_partials``' keyword arguments: q, the four tiers, inv_freq."""
    return dict(
        q=args["q"],
        sink=DenseTier(args["sink_k"], args["sink_v"], args["sink_valid"]),
        f=DenseTier(args["f_k"], args["f_v"], args["f_valid"]),
        ledger=ledger_args(args)["tier"],
        ring=DenseTier(args["ring_k"], args["ring_v"], args["ring_valid"]),
        inv_freq=args["inv_freq"],
    )


# ----------------------------------------------------------------------------------------------------------
# checks


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckCase:
    """One kernel check: a ledger format (``quant``, ``bits`` for "channel"), the dtype of q and the dense
    tiers, the share of valid slots, and which kernels run ("ledger", "dense", "fused")."""

    quant: str
    bits: int = 2
    dtype: str = "float32"
    valid_frac: float = 0.7
    kernels: tuple[str, ...] = ("ledger", "dense", "fused")


def every_format_cases(*, light: bool = False) -> tuple[CheckCase, ...]:
    """A case per ledger format (``QUANT_NAMES``, "channel" at INT2 and INT4) in float32, and the default
    format (``crot-k4v3``) and "channel" in bfloat16 with every slot valid. ``light`` (the CPU dry run): every
    format through the ledger kernel, and the dense and all-tier kernels only for the default format (float32
    and bfloat16) and "channel" at INT2 (the formats share the all-tier kernel's ledger code; interpret mode
    compiles each case for a few seconds)."""
    heavy = {("crot-k4v3", 2, "float32"), ("crot-k4v3", 2, "bfloat16"), ("channel", 2, "float32")}
    cases = [CheckCase(quant="channel", bits=4)]
    cases += [CheckCase(quant=name) for name in QUANT_NAMES]
    cases += [CheckCase(quant=n, dtype="bfloat16", valid_frac=1.0) for n in ("channel", "crot-k4v3")]
    if light:
        cases = [
            c if (c.quant, c.bits, c.dtype) in heavy else dataclasses.replace(c, kernels=("ledger",))
            for c in cases
            if c.dtype == "float32" or (c.quant, c.bits, c.dtype) in heavy
        ]
    return tuple(cases)


def check_case(s: Setup, case: CheckCase, *, seed: int, ctx: int, interpret: bool) -> dict:
    """One case on fresh inputs with NaN-poisoned outputs: max |err| / max |ref| per output, against the jnp
    references at float32 "highest" precision; row 1 has every Q slot masked (its running max must stay at
    the -1e30 floor)."""
    dtype = jnp.dtype(case.dtype)
    tol = 1e-4 if dtype == jnp.float32 else 1e-2
    setup = dataclasses.replace(s, bits=case.bits, quant=case.quant)
    args = tier_inputs(seed, 2, ctx, setup, dtype, case.valid_frac)
    args["slot_valid"] = args["slot_valid"].at[1].set(False)
    opts = dict(window=setup.window, fmt=setup.format)
    launch = Launch(interpret=interpret, poison=True)
    dense = (args["q"], DenseTier(args["f_k"], args["f_v"], args["f_valid"]))
    errs: dict[str, float] = {}
    masked_row_ok = True
    with jax.default_matmul_precision("highest"):
        if "ledger" in case.kernels:
            want = jax.jit(functools.partial(ledger_partial, **opts))(**ledger_args(args))
            got = ledger_attention(**ledger_args(args), **opts, launch=launch)
            masked_row_ok = bool(np.all(np.asarray(got[1])[1] == np.float32(-1e30)))
            errs |= {
                f"ledger.{n}": rel_err(got[i], want[i]) for i, n in ((0, "out"), (2, "l"), (3, "slot_mass"))
            }
        if "dense" in case.kernels:
            want, got = jax.jit(slot_partial)(*dense), dense_slot_attention(*dense, launch=launch)
            errs |= {"dense.out": rel_err(got[0], want[0]), "dense.slot_mass": rel_err(got[3], want[3])}
        if "fused" in case.kernels:
            reference = functools.partial(tier_partials, **opts, ledger_attention=ledger_partial)
            want = jax.jit(lambda a: merge_tiers(reference(**a)))(fused_args(args))
            got = merge_tiers(fused_partials(launch=launch)(**fused_args(args), **opts))
            errs["fused.out"] = rel_err(got.out, want.out)
            for name in ("sink_mass", "f_mass", "q_mass", "ring_mass"):
                errs[f"fused.{name}"] = rel_err(getattr(got, name), getattr(want, name))
    worst = max(errs.values())
    return dict(
        format=setup.format.name,
        bits=case.bits,
        dtype=dtype.name,
        kernels=list(case.kernels),
        slots=int(args["codes"].k_codes.shape[2]),
        f_slots=int(args["f_k"].shape[2]),
        worst_rel_err=worst,
        tolerance=tol,
        masked_row_ok=masked_row_ok,
        passed=bool(worst <= tol and masked_row_ok),
        errors=errs,
    )


def check_kernels(s: Setup, cases, *, interpret: bool, ctx: int, deadline: float = math.inf) -> list[dict]:
    """Every case (``CheckCase``) on fresh inputs; prints one line each; stops starting cases at
    ``deadline`` (``time.perf_counter()`` seconds)."""
    print("== checks (kernel vs jnp reference, NaN-poisoned outputs; max |err| / max |ref|)")
    seed = time.time_ns() % 2**32  # fresh inputs each run
    results = []
    for i, case in enumerate(cases):
        if time.perf_counter() > deadline:
            print(f"  (time budget spent: {len(cases) - i} cases not started)")
            break
        r = check_case(s, case, seed=seed + i, ctx=ctx, interpret=interpret)
        results.append(r)
        print(
            f"  {'PASS' if r['passed'] else 'FAIL'} {r['format']}"
            f"{' INT' + str(r['bits']) if r['format'] == 'channel' else ''} {r['dtype']} "
            f"{'+'.join(r['kernels'])} NL={r['slots']} NF={r['f_slots']} masked-row m ok={r['masked_row_ok']} "
            f"worst={r['worst_rel_err']:.2e} (tol {r['tolerance']:g})",
            flush=True,
        )
        if not r["passed"]:
            print("       " + " ".join(f"{k}={v:.2e}" for k, v in r["errors"].items()))
    return results


# ----------------------------------------------------------------------------------------------------------
# timing


def time_call(fn: Callable, *args, iters: int, reps: int = 5) -> float:
    """Median seconds per call of jitted ``fn(*args)`` (after a warm-up call)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


def copy_bandwidth(nbytes: int, iters: int) -> float:
    """GB/s of a device copy of ``nbytes`` (read + write)."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    sec = time_call(copy, x, iters=iters)
    return 2 * x.nbytes / sec / 1e9


def nbytes(tree) -> int:
    return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


def sweep_ledger(s: Setup, ctx: int, b: int, interpret: bool, iters: int) -> dict:
    """Time a few ledger-kernel configurations; returns the fastest as keyword options."""
    print(f"== ledger kernel sweep (context {ctx}, batch {b})")
    args = ledger_args(tier_inputs(1, b, ctx, s))
    read = nbytes(args)
    best, best_t = {}, float("inf")
    for block, warps, stages in [(2, 4, 2), (4, 4, 2), (4, 8, 2), (8, 8, 2), (4, 8, 3), (8, 8, 3)]:
        opts = dict(block_slots=block, num_warps=warps, num_stages=stages)
        fn = jax.jit(
            functools.partial(
                ledger_attention, window=s.window, fmt=s.format, launch=Launch(interpret=interpret, **opts)
            )
        )
        try:
            sec = time_call(lambda a, f=fn: f(**a), args, iters=iters)
        except Exception as e:  # a configuration Triton cannot compile is reported and skipped
            print(
                f"  block_slots={block} warps={warps} stages={stages}: failed ({type(e).__name__}: {e})"[:300]
            )
            continue
        print(
            f"  block_slots={block} warps={warps} stages={stages}: "
            f"{sec * 1e6:9.1f} us {read / sec / 1e9:8.1f} GB/s"
        )
        if sec < best_t:
            best, best_t = opts, sec
    print(f"  best: {best}")
    return best


def bench_table(s: Setup, contexts, batches, interpret: bool, iters: int, ledger_opts: dict, copy_gbs: float):
    """Rows of (ctx, b, NL, NF, full_us, qevict_us, q_us, q_gbs)."""
    rows = []
    full = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))
    fused_launch = Launch(
        interpret=interpret,
        block_slots=ledger_opts.get("block_slots"),
        num_warps=ledger_opts.get("num_warps"),
    )
    fused_tiers = fused_partials(launch=fused_launch)
    fused = jax.jit(lambda **a: merge_tiers(fused_tiers(**a, window=s.window, fmt=s.format)))
    ledger_launch = Launch(interpret=interpret, **ledger_opts)
    ledger = jax.jit(functools.partial(ledger_attention, window=s.window, fmt=s.format, launch=ledger_launch))
    for ctx in contexts:
        for b in batches:
            key = jax.random.PRNGKey(ctx + b)
            k1, k2, k3 = jax.random.split(key, 3)
            shape = (b, ctx, s.kv_heads, s.head_dim)
            q = jax.random.normal(k1, (b, 1, s.heads, s.head_dim), jnp.bfloat16)
            kf = jax.random.normal(k2, shape, jnp.bfloat16)
            vf = jax.random.normal(k3, shape, jnp.bfloat16)
            full_s = time_call(full, q, kf, vf, iters=iters)
            del kf, vf
            args = tier_inputs(ctx + b, b, ctx, s)
            fused_s = time_call(lambda a: fused(**a), fused_args(args), iters=iters)
            largs = ledger_args(args)
            q_s = time_call(lambda a: ledger(**a), largs, iters=iters)
            q_gbs = nbytes(largs) / q_s / 1e9
            rows.append(
                (ctx, b, args["codes"].k_codes.shape[2], args["f_k"].shape[2], full_s, fused_s, q_s, q_gbs)
            )
            del args, largs
            print(
                f"  ctx {ctx:>6} B {b}: full {full_s * 1e6:9.1f} us | qevict {fused_s * 1e6:9.1f} us | "
                f"Q kernel {q_s * 1e6:9.1f} us, {q_gbs:7.2f} GB/s ({q_gbs / copy_gbs:5.1%} of copy)"
            )
    return rows


def print_table(rows, copy_gbs: float, s: Setup, interpret: bool) -> None:
    mode = "CPU interpret mode (not a GPU measurement)" if interpret else jax.devices()[0].device_kind
    print(
        f"== decode attention, one layer, {s.heads}/{s.kv_heads} heads, D={s.head_dim}, beta={s.beta}: {mode}"
    )
    print(f"   device copy bandwidth: {copy_gbs:.1f} GB/s")
    head = (
        f"{'context':>8} {'batch':>5} {'NL':>6} {'NF':>5} {'full_us':>10} {'qevict_us':>10} "
        f"{'Q_us':>9} {'Q_GB/s':>8} {'Q/copy':>7} {'full/qevict':>11}"
    )
    print(head)
    for ctx, b, nl, nf, full_s, fused_s, q_s, q_gbs in rows:
        print(
            f"{ctx:>8} {b:>5} {nl:>6} {nf:>5} {full_s * 1e6:>10.1f} {fused_s * 1e6:>10.1f} {q_s * 1e6:>9.1f} "
            f"{q_gbs:>8.2f} {q_gbs / copy_gbs:>7.1%} {full_s / fused_s:>11.2f}"
        )
    ctx, b, *_, full_s, fused_s, _, _ = max(rows, key=lambda r: (r[0], r[1]))
    print(
        f"headline: Full-KV / QEvict decode-attention time at context {ctx}, batch {b}: "
        f"{full_s / fused_s:.2f}x"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-interpret", action="store_true", help="run the kernels in Pallas interpret mode")
    p.add_argument("--small", action="store_true", help="tiny shapes and contexts")
    p.add_argument("--contexts", type=int, nargs="*", default=None)
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--no-sweep", action="store_true", help="skip the ledger configuration sweep")
    a = p.parse_args(argv)
    interpret = a.cpu_interpret
    if not interpret and jax.default_backend() != "gpu":
        p.error("no GPU backend: use --cpu-interpret (with --small) on a CPU")
    s = SMALL if a.small else Setup()
    contexts = a.contexts or ([1024, 2048] if a.small else [8192, 16384, 32768, 65536, 131072])
    batches = a.batches or ([1] if a.small else [1, 8])
    iters = 2 if interpret else 20
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {jax.devices()[0].device_kind}")
    t0 = time.perf_counter()
    checks = check_kernels(
        s, every_format_cases(light=a.small), interpret=interpret, ctx=1000 if a.small else 12_000
    )
    ok = all(c["passed"] for c in checks)
    copy_gbs = copy_bandwidth((64 if a.small else 4096) * 2**20, iters=iters)
    print(f"== device copy bandwidth: {copy_gbs:.1f} GB/s")
    ledger_opts = {} if a.no_sweep or interpret else sweep_ledger(s, 32768, 8, interpret, iters)
    print("== timings")
    rows = bench_table(s, contexts, batches, interpret, iters, ledger_opts, copy_gbs)
    print(f"(checks {'passed' if ok else 'FAILED'}; total {time.perf_counter() - t0:.0f} s)")
    print_table(rows, copy_gbs, s, interpret)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
