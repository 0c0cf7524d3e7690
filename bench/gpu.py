"""The whole GPU plan in one command, within a time budget: what to run when a GPU is lent.

  python bench/gpu.py --budget-s 480 --out $OUT/gpu.json     # on the GPU (docs/benchmarks.md, "When a GPU is lent")
  python bench/gpu.py --dry-run                              # the same code on the CPU, tiny shapes (a test runs it)
  python bench/gpu.py --estimate                             # FLOPs and bytes of the real plan, nothing run

Steps, in order (``--only`` / ``--skip`` take their names):
  checks   every Pallas kernel (ledger, dense slots, all tiers) for every ledger format against its jnp
           reference on fresh inputs, NaN-poisoned outputs (``kernel_gpu.check_kernels``);
  copy     the device's copy bandwidth (bytes read + written / time);
  kernels  one layer of decode attention, Llama-3.1-8B heads, 8K-128K, batch 1 and 8: bf16 Full-KV
           (``jax.nn.dot_product_attention``) against QEvict's tiers at beta 0.2 (``fused_partials``), and the
           ledger kernel alone as a share of the copy bandwidth;
  e2e      end-to-end decode of a Llama-3.1-8B-shaped model with random bf16 weights at 32K and 64K, batch 1
           and 8: Full-KV and the default ``qevict`` at beta 0.2 side by side (tokens/s, TTFT, peak device
           memory). Each method runs in its own process, its rows in increasing batch x context, so that the
           device's ``peak_bytes_in_use`` high-water mark after a row is that row's peak.

The plan stops starting new work once ``--budget-s`` is spent: a step, a check case, a timing row or an e2e row
not started is listed as such. After each step the JSON file is rewritten (steps, seconds, rows, targets), so a
rerun can ``--skip`` what is done. The last table holds the four targets; its last line is the headline ratios.

``--dry-run`` runs every step on the CPU: Pallas in interpret mode (the e2e QEvict through the Pallas kernels
too, ``pallas=True``), tiny shapes and model, every ledger format. Its times say nothing about a GPU; it exists
so that a moved module or a renamed field fails CI, not the GPU session.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flax import nnx  # noqa: E402
from kernel_gpu import SMALL, Setup, bench_table, check_kernels, copy_bandwidth, every_format_cases  # noqa: E402
from throughput import LLAMA31_8B, device_peak, program_peak, prompts_for, release  # noqa: E402

from models.config import ModelConfig  # noqa: E402
from models.model import Transformer  # noqa: E402
from qevict_jax.methods.registry import make_method  # noqa: E402
from qevict_jax.runtime.generate import generate  # noqa: E402
from qevict_jax.runtime.sampling import SamplerConfig  # noqa: E402

STEPS = ("checks", "copy", "kernels", "e2e")

# the dry run's model: a 2-layer Llama of the same family and layout (grouped heads, Llama-3 RoPE off)
TINY_LLAMA = dataclasses.replace(
    LLAMA31_8B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rope_llama3=None,
    max_position_embeddings=4096,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """What each step runs: the GPU plan (``GPU_PLAN``) or its CPU dry run (``DRY_PLAN``)."""

    name: str
    interpret: bool  # Pallas interpret mode (the CPU)
    setup: Setup  # the kernels' head shapes and tier sizes
    light_checks: bool  # the non-default formats through the ledger kernel alone
    check_context: int
    copy_bytes: int
    kernel_contexts: tuple[int, ...]
    kernel_batches: tuple[int, ...]
    iters: int
    model: ModelConfig
    e2e_contexts: tuple[int, ...]
    e2e_batches: tuple[int, ...]
    new_tokens: int
    beta: float = 0.2


GPU_PLAN = Plan(
    name="gpu",
    interpret=False,
    setup=Setup(),
    light_checks=False,
    check_context=12_000,
    copy_bytes=4096 * 2**20,
    kernel_contexts=(8192, 16384, 32768, 65536, 131072),
    kernel_batches=(1, 8),
    iters=20,
    model=LLAMA31_8B,
    e2e_contexts=(32768, 65536),
    e2e_batches=(1, 8),
    new_tokens=32,
)

DRY_PLAN = Plan(
    name="dry-run",
    interpret=True,
    setup=SMALL,
    light_checks=True,
    check_context=1000,
    copy_bytes=16 * 2**20,
    kernel_contexts=(1024,),
    kernel_batches=(1,),
    iters=1,
    model=TINY_LLAMA,
    e2e_contexts=(1024,),
    e2e_batches=(1,),
    new_tokens=4,
)

# The targets of the GPU plan (docs/benchmarks.md): (key, description, comparison, bound)
TARGETS = (
    ("ledger_share_of_copy", "ledger kernel GB/s / copy GB/s", ">=", 0.60),
    ("attention_ratio_32k", "QEvict / bf16 Full-KV decode-attention time, >= 32K", "<=", 0.35),
    ("e2e_speedup_64k", "QEvict / Full-KV decode tok/s at 64K", ">=", 1.5),
    ("peak_memory_change_32k", "QEvict / Full-KV peak device memory - 1 at 32K", "<=", -0.25),
)


# ----------------------------------------------------------------------------------------------------------
# the estimate


def estimate(plan: Plan, *, tflops: float = 790.0, tbps: float = 3.0) -> dict[str, float]:
    """Seconds of compute and memory traffic the e2e step needs at ``tflops`` (bf16 dense) and ``tbps``
    (copy bandwidth), from FLOPs and bytes alone: prefill = 2 x params x tokens + causal attention (2 x T^2 x
    heads x head_dim per layer and row, half of 4 T^2 H D), decode = bytes read per step (weights + the
    method's KV) / bandwidth. Compiles, launches and the jnp flash loop's inefficiency come on top: the plan's
    budget holds them (docs/benchmarks.md)."""
    cfg = plan.model
    params = (
        cfg.num_layers
        * (
            cfg.hidden_size * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        + 2 * cfg.vocab_size * cfg.hidden_size
    )
    kv_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 bytes per token
    prefill_s = decode_s = 0.0
    for t in plan.e2e_contexts:
        for b in plan.e2e_batches:
            flops = b * (2 * params * t + cfg.num_layers * 2 * t * t * cfg.num_heads * cfg.head_dim)
            prefill_s += 2 * flops / (tflops * 1e12)  # both methods prefill
            for share in (1.0, plan.beta):
                decode_s += plan.new_tokens * (2 * params + share * b * t * kv_token) / (tbps * 1e12)
    return {
        "params": float(params),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "full_kv_64k_b8_gb": 65536 * 8 * kv_token / 1e9,
        "weights_gb": 2 * params / 1e9,
    }


# ----------------------------------------------------------------------------------------------------------
# end to end, one process per method


def e2e_methods(plan: Plan) -> dict[str, Any]:
    """Full-KV and the default ``qevict`` at ``plan.beta`` (through the Pallas kernels in interpret mode on the
    dry run, so that the path a GPU takes is the path tested)."""
    options = {"pallas": True} if plan.interpret else {}
    return {"full": make_method("full"), "qevict": make_method("qevict", plan.beta, **options)}


def e2e_worker(plan: Plan, method_name: str, deadline_s: float) -> None:
    """One method's e2e rows, in increasing batch x context; prints one JSON line per row."""
    t0 = time.perf_counter()
    model = Transformer(plan.model, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    param_bytes = int(sum(a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param))))
    method = e2e_methods(plan)[method_name]
    sampler = SamplerConfig(max_new_tokens=plan.new_tokens)
    rows = sorted(
        ((c, b) for c in plan.e2e_contexts for b in plan.e2e_batches), key=lambda r: (r[0] * r[1], r[0])
    )
    failed_at = None
    for context, batch in rows:
        row: dict[str, Any] = {"method": method_name, "context": context, "batch": batch}
        if failed_at is not None and context * batch >= failed_at:
            row["status"] = "skipped: a smaller row ran out of memory"
        elif time.perf_counter() - t0 > deadline_s:
            row["status"] = "not started: time budget spent"
        else:
            try:
                prompts = prompts_for(plan.model, context, batch, plan.new_tokens)
                t_row = time.perf_counter()
                res = generate(model, prompts, sampler, method, kv_dtype=jnp.bfloat16)
                row |= {
                    "status": "ok",
                    "seconds": time.perf_counter() - t_row,
                    "ttft_s": res.ttft_s,
                    "tok_s": res.decode_tokens_per_s,
                    "memory_ratio": res.memory_ratio,
                    "cache_bytes": res.cache_bytes,
                    "compressed": res.compressed,
                    "xla_peak_bytes": max(
                        program_peak("_prefill", param_bytes), program_peak("_decode", param_bytes)
                    ),
                    "device_peak_bytes": device_peak(),
                }
                del res
            except Exception as e:  # out of device memory: reported, and larger rows are not started
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                failed_at = context * batch
                row["status"] = f"out of memory ({type(e).__name__})"
            release()  # forget the row's programs and buffers before the next row
        print("E2E " + json.dumps(row), flush=True)


def run_e2e(plan: Plan, deadline: float) -> list[dict]:
    """Both methods' rows, each method in a fresh process (its own memory high-water mark); QEvict first, with
    half of the time left, so that Full-KV, the reference of every ratio, still runs when the budget is short."""
    rows: list[dict] = []
    for i, name in enumerate(("qevict", "full")):
        left = (deadline - time.perf_counter()) / (2 - i)
        if left <= 0:
            rows.append({"method": name, "status": "not started: time budget spent"})
            continue
        cmd = [sys.executable, __file__, "--e2e-worker", name, "--deadline-s", f"{left:.0f}"]
        cmd += ["--dry-run"] if plan is DRY_PLAN else []
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"})
        got = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("E2E ")]
        if proc.returncode:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            got.append({"method": name, "status": f"worker failed (exit {proc.returncode}): {tail[0][:300]}"})
        rows += got
        for r in got:
            print("  " + _e2e_line(r), flush=True)
    return rows


def _e2e_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['method']:>7} ctx {r.get('context', '-')} B {r.get('batch', '-')}: {r['status']}"
    peak = r["device_peak_bytes"]
    return (
        f"{r['method']:>7} ctx {r['context']:>6} B {r['batch']}: TTFT {r['ttft_s']:.3f} s, {r['tok_s']:.1f} tok/s, "
        f"memory ratio {r['memory_ratio']:.3f}, peak "
        f"{'-' if peak is None else f'{peak / 1e9:.2f} GB (device)'} / {r['xla_peak_bytes'] / 1e9:.3f} GB (XLA)"
    )


# ----------------------------------------------------------------------------------------------------------
# the plan


def run_kernels(plan: Plan, copy_gbs: float, deadline: float) -> list[dict]:
    print("== decode attention, one layer (bf16 Full-KV vs QEvict's tiers at beta 0.2)")
    rows = []
    for ctx in plan.kernel_contexts:
        for b in plan.kernel_batches:
            if time.perf_counter() > deadline:
                rows.append({"context": ctx, "batch": b, "status": "not started: time budget spent"})
                continue
            (r,) = bench_table(plan.setup, [ctx], [b], plan.interpret, plan.iters, {}, copy_gbs)
            ctx_, b_, nl, nf, full_s, fused_s, q_s, q_gbs = r
            rows.append(
                dict(
                    status="ok",
                    context=ctx_,
                    batch=b_,
                    q_slots=nl,
                    f_slots=nf,
                    full_us=full_s * 1e6,
                    qevict_us=fused_s * 1e6,
                    ledger_us=q_s * 1e6,
                    ledger_gbs=q_gbs,
                    ledger_share_of_copy=q_gbs / copy_gbs,
                    attention_ratio=fused_s / full_s,
                )
            )
    return rows


def targets(results: dict) -> dict[str, dict]:
    """The four targets from the steps' rows: the value measured, where, and whether it is met."""
    out: dict[str, dict] = {}
    kern = [r for r in results.get("kernels", {}).get("rows", []) if r.get("status") == "ok"]
    if kern:
        big = max(kern, key=lambda r: (r["context"], r["batch"]))
        out["ledger_share_of_copy"] = {
            "value": big["ledger_share_of_copy"],
            "at": f"{big['context']} x {big['batch']}",
        }
        long = [r for r in kern if r["context"] >= 32768] or [max(kern, key=lambda r: r["context"])]
        worst = max(long, key=lambda r: r["attention_ratio"])
        out["attention_ratio_32k"] = {"value": worst["attention_ratio"], "at": f"worst of {len(long)} rows"}
    e2e = [r for r in results.get("e2e", {}).get("rows", []) if r.get("status") == "ok"]
    by = {(r["method"], r["context"], r["batch"]): r for r in e2e}
    contexts = sorted({r["context"] for r in e2e})
    if contexts:
        ctx64 = 65536 if any(c == 65536 for c in contexts) else contexts[-1]
        speed = [
            (by[("qevict", ctx64, b)]["tok_s"] / by[("full", ctx64, b)]["tok_s"], b)
            for b in sorted({r["batch"] for r in e2e})
            if ("qevict", ctx64, b) in by and ("full", ctx64, b) in by
        ]
        if speed:
            worst = min(speed)
            out["e2e_speedup_64k"] = {"value": worst[0], "at": f"{ctx64} x {worst[1]} (worst batch)"}
        ctx32 = 32768 if 32768 in contexts else contexts[0]
        peaks = []
        for b in sorted({r["batch"] for r in e2e}):
            q, f = by.get(("qevict", ctx32, b)), by.get(("full", ctx32, b))
            if q and f:
                key = (
                    "device_peak_bytes"
                    if q["device_peak_bytes"] and f["device_peak_bytes"]
                    else "xla_peak_bytes"
                )
                peaks.append((q[key] / f[key] - 1.0, b, key))
        if peaks:
            worst = max(peaks)
            out["peak_memory_change_32k"] = {"value": worst[0], "at": f"{ctx32} x {worst[1]} ({worst[2]})"}
    for key, _, op, bound in TARGETS:
        if key in out:
            v = out[key]["value"]
            out[key] |= {"target": f"{op} {bound}", "met": bool(v >= bound if op == ">=" else v <= bound)}
    return out


def print_targets(results: dict, plan: Plan) -> None:
    got = results["targets"]
    print(
        f"== targets ({plan.name}{'; CPU interpret mode: not a GPU measurement' if plan.interpret else ''})"
    )
    print(f"{'target':<58} {'measured':>9} {'bound':>9} {'met':>5}  where")
    for key, desc, op, bound in TARGETS:
        if key in got:
            g = got[key]
            print(
                f"{desc:<58} {g['value']:>9.3f} {op + ' ' + str(bound):>9} {'yes' if g['met'] else 'NO':>5}  {g['at']}"
            )
        else:
            print(f"{desc:<58} {'-':>9} {op + ' ' + str(bound):>9} {'-':>5}  not measured")
    parts = [f"{key} {got[key]['value']:.3f}" for key, *_ in TARGETS if key in got]
    print("headline: " + (", ".join(parts) if parts else "no target measured"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--dry-run", action="store_true", help="every step on the CPU, Pallas interpret mode, tiny shapes"
    )
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds; no new work starts after them")
    p.add_argument("--only", default=None, help=f"comma-separated steps of {','.join(STEPS)}")
    p.add_argument("--skip", default=None, help="comma-separated steps not to run")
    p.add_argument("--out", default="runs/gpu/plan.json", help="the JSON file, rewritten after each step")
    p.add_argument(
        "--estimate", action="store_true", help="print the e2e step's FLOPs/bytes estimate and exit"
    )
    p.add_argument("--e2e-worker", choices=("full", "qevict"), help=argparse.SUPPRESS)
    p.add_argument("--deadline-s", type=float, default=math.inf, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    plan = DRY_PLAN if a.dry_run else GPU_PLAN
    steps = set(STEPS)
    for opt, names in (("--only", a.only), ("--skip", a.skip)):
        if names is None:
            continue
        chosen = {n.strip() for n in names.split(",") if n.strip()}
        if bad := chosen - set(STEPS):
            p.error(f"{opt}: unknown step(s) {', '.join(sorted(bad))}; the steps are {', '.join(STEPS)}")
        steps = steps & chosen if opt == "--only" else steps - chosen
    if a.estimate:
        print(json.dumps(estimate(plan), indent=1))
        return 0
    if not a.dry_run and jax.default_backend() != "gpu":
        p.error(
            f"no GPU backend (jax.default_backend() is {jax.default_backend()!r}): use --dry-run on a CPU"
        )
    if a.e2e_worker:
        e2e_worker(plan, a.e2e_worker, a.deadline_s)
        return 0
    t_start = time.perf_counter()
    deadline = t_start + a.budget_s
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "plan": plan.name,
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "budget_s": a.budget_s,
        "estimate": estimate(plan),
    }
    print(
        f"jax {jax.__version__}, python {results['python']}, {results['backend']} ({results['device']}), plan {plan.name}"
    )
    copy_gbs = None
    for step in STEPS:
        if step not in steps:
            continue
        if time.perf_counter() > deadline:
            results[step] = {"status": "not started: time budget spent"}
            print(f"== {step}: not started (time budget spent)")
            continue
        t0 = time.perf_counter()
        if step == "checks":
            rows = check_kernels(
                plan.setup,
                every_format_cases(light=plan.light_checks),
                interpret=plan.interpret,
                ctx=plan.check_context,
                deadline=deadline,
            )
            results[step] = {"rows": rows, "passed": all(r["passed"] for r in rows)}
        elif step == "copy":
            copy_gbs = copy_bandwidth(plan.copy_bytes, iters=max(plan.iters, 2))
            results[step] = {"gbs": copy_gbs}
            print(f"== device copy bandwidth: {copy_gbs:.1f} GB/s")
        elif step == "kernels":
            if copy_gbs is None:  # a rerun that skipped "copy": measure it again, the shares need it
                copy_gbs = copy_bandwidth(plan.copy_bytes, iters=max(plan.iters, 2))
            results[step] = {"rows": run_kernels(plan, copy_gbs, deadline)}
        elif step == "e2e":
            print("== end to end (one process per method)")
            results[step] = {"rows": run_e2e(plan, deadline)}
        results[step]["seconds"] = time.perf_counter() - t0
        print(f"   ({step}: {results[step]['seconds']:.0f} s)", flush=True)
        results["targets"] = targets(results)
        out.write_text(json.dumps(results, indent=1))
    results["targets"] = targets(results)
    results["seconds"] = time.perf_counter() - t_start
    out.write_text(json.dumps(results, indent=1))
    print(f"== wrote {out} ({results['seconds']:.0f} s in all)")
    print_targets(results, plan)
    failed = not results.get("checks", {}).get("passed", True) or any(
        str(r.get("status", "")).startswith("worker failed") for r in results.get("e2e", {}).get("rows", [])
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
