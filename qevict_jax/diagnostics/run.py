"""``qevict diagnose``: the paper's diagnostics of R1-R4, R3 without promotion (and the all-query ranking)
on passages of real text, teacher-forced: one Full-KV reference pass, then one policy trace per method, each
reduced as it is produced (per routing event), with a progress bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from models.model import Transformer
from qevict_jax.diagnostics.report import passage_metrics, records, tables
from qevict_jax.diagnostics.trace import num_events, passages, policy_trace, reference_trace
from qevict_jax.methods.options import options_for, parse_set_options
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import add_model_args, kv_dtype, load

DEFAULT_POLICIES = "r1,r2,r3,r4,qevict-nopromo,qevict-all"


def run_diagnosis(
    model: Transformer,
    sequences: np.ndarray,
    prompt_len: int,
    methods: Sequence[Any],
    *,
    horizon: int = 32,
    eligibility: int = 3,
    kv_dtype: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Diagnose ``methods`` (window-tier methods) on sequences [B, P + G] (B passages of equal length).

    Returns {"records": one per (policy, metric) (``report.records``), "passages": {policy: [per-passage
    scalars]}, "series": {policy: {"fmm": [R] mean over passages (NaN censored), "counts": {lag: [3, 3]
    transition counts summed over passages}}}, "windows": {policy: W}, "nf"/"nq": {policy: capacity}}.
    """
    sequences = np.asarray(sequences, np.int32)
    g = sequences.shape[1] - prompt_len
    kw = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
    total = 1 + sum(num_events(g, m.cache.omega) for m in methods)
    bar = tqdm(total=total, desc="diagnose", unit="event", disable=not progress)
    try:
        bar.set_postfix_str("Full-KV reference")
        ref = reference_trace(model, sequences, g, **kw)
        bar.update(1)
        per_policy, series, windows, nf, nq = {}, {}, {}, {}, {}
        for m in methods:
            bar.set_postfix_str(m.name)
            trace = policy_trace(model, sequences, prompt_len, m, on_event=lambda: bar.update(1), **kw)
            rows, fmm, counts = [], [], {}
            for b in range(sequences.shape[0]):
                scalars, s = passage_metrics(ref, trace, b, horizon, eligibility)
                rows.append(scalars)
                fmm.append(s["fmm"])
                for lag, c in s["counts"].items():
                    counts[lag] = counts.get(lag, 0) + c
            per_policy[m.name] = rows
            fmm_arr = np.asarray(fmm)
            series[m.name] = {
                "fmm": [None if not np.isfinite(col).any() else float(np.nanmean(col)) for col in fmm_arr.T],
                "counts": {str(lag): np.asarray(c).tolist() for lag, c in counts.items()},
            }
            windows[m.name], nf[m.name], nq[m.name] = trace.window, trace.nf, trace.nq
    finally:
        bar.close()
    return {
        "records": records(per_policy),
        "passages": per_policy,
        "series": series,
        "windows": windows,
        "nf": nf,
        "nq": nq,
    }


def add_diagnose_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``diagnose`` to a ``qevict`` sub-parser set."""
    p = subparsers.add_parser(
        "diagnose", help="the paper's diagnostics (FMM, churn, LIR, QSA, RQ, transitions, tier mass)"
    )
    add_model_args(p)
    p.add_argument("--text", type=Path, help="a text file to cut passages from (default: pydoc_data.topics)")
    p.add_argument("--passages", type=int, default=4, help="passages (rows), mean ± std over them")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens P")
    p.add_argument(
        "--generate", type=int, default=256, help="teacher-forced decode steps G (a multiple of Ω)"
    )
    p.add_argument("--budget", type=float, default=0.2, help="budget β: fraction of full-KV bytes")
    p.add_argument("--methods", default=DEFAULT_POLICIES, help="comma-separated window-tier methods")
    p.add_argument(
        "--recent", type=int, default=32, help="recent region R in tokens (a multiple of every W; default 32)"
    )
    p.add_argument("--horizon", type=int, default=32, help="FMM horizon H in decode steps")
    p.add_argument("--eligibility", type=int, default=3, help="Global LIR: consecutive events out of F (1-8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the records as JSON (tables go to stderr)")
    p.add_argument("--out", type=Path, help="folder for diagnose.json (records, per-passage values, series)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def cmd_diagnose(args: argparse.Namespace, loaded: tuple[Any, Any, Any] | None = None) -> int:
    """Run ``qevict diagnose``; ``loaded`` = (cfg, model, tokenizer) instead of loading ``--model``."""
    if not 1 <= args.eligibility <= 8:
        raise ValueError(f"--eligibility must be in 1..8, got {args.eligibility}")
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    scoped = parse_set_options(args.set)
    methods = [
        make_method(n, args.budget, **{"recent": args.recent, **options_for(n, scoped)}) for n in names
    ]
    cfg, model, tok = loaded if loaded is not None else load(args)
    text = args.text.read_text() if args.text is not None else None
    bos = [tok.bos_token_id] if getattr(tok, "bos_token_id", None) is not None else []
    encode = lambda s: tok.encode(s, add_bos=False)
    seqs = passages(encode, args.passages, args.prefill, args.generate, text=text, bos=bos, seed=args.seed)
    result = run_diagnosis(
        model,
        seqs,
        args.prefill,
        methods,
        horizon=args.horizon,
        eligibility=args.eligibility,
        kv_dtype=kv_dtype(args),
        progress=not args.no_progress,
    )
    table = tables(result["records"], result["windows"], args.horizon, args.eligibility)
    config = {
        "model": args.model,
        "text": str(args.text) if args.text else "pydoc_data.topics",
        "passages": args.passages,
        "prefill": args.prefill,
        "generate": args.generate,
        "budget": args.budget,
        "recent": args.recent,
        "methods": names,
        "horizon": args.horizon,
        "eligibility": args.eligibility,
        "seed": args.seed,
        "kv_dtype": args.kv_dtype,
        "nf": result["nf"],
        "nq": result["nq"],
        "windows": result["windows"],
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"config": config, "records": result["records"], "series": result["series"]}
        (args.out / "diagnose.json").write_text(json.dumps(doc, indent=1))
        (args.out / "tables.md").write_text(table + "\n")
    if args.json:
        print(json.dumps(result["records"]))
        print(table, file=sys.stderr)
    else:
        print(table)
    return 0
