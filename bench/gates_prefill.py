"""Prefill time of gate ranking against attention ranking, CPU, one process (``--model``, default SmolLM2).

The learned gates rank tokens from each layer's input alone, so their prefill needs no observation-window
attention pass; this times the prompt pass (TTFT of one new token, compilation excluded, the fastest of
``--repeats`` runs) of QEvict (attention-ranked) against QEvict ranked by the gates, and of SnapKV against
the gate token pool, on the same prose prompt. The last line is the headline ratio.

Usage: python bench/gates_prefill.py --gates ~/.cache/qevict-jax/gates/smollm2 [--tokens 2048] [--repeats 3]
  [--model NAME] (the gates must have been trained on that model)
"""

from __future__ import annotations

import argparse
import os

from models.checkpoint import load_model
from models.registry import resolve_model
from models.tokenizer import Tokenizer
from qevict_jax.eval.needle import prose_paragraphs
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import add_model_arg
from qevict_jax.runtime.generate import SamplerConfig, generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--gates", required=True, help="gate checkpoint folder (qevict train-gates --out)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model(args.model)
    _, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    ids = tok.encode(" ".join(prose_paragraphs()[200:]))[: args.tokens]
    gates = os.path.expanduser(args.gates)
    runs = {
        "qevict": make_method("qevict", args.budget, recent=64),
        "qevict-gates": make_method("qevict-gates", args.budget, recent=64, gates=gates),
        "snapkv": make_method("snapkv", args.budget, recent=64),
        "gates": make_method("gates", args.budget, recent=64, gates=gates),
    }
    ttft = {}
    print(f"| method | β | prompt tokens | TTFT (s), best of {args.repeats} | compile (s) |")
    print("|---|---|---|---|---|")
    for name, method in runs.items():
        results = [
            generate(model, [ids], SamplerConfig(max_new_tokens=1), method) for _ in range(args.repeats)
        ]
        ttft[name] = min(r.ttft_s for r in results)
        print(f"| {name} | {args.budget} | {len(ids)} | {ttft[name]:.3f} | {results[0].compile_s:.1f} |")
    print(
        f"prefill time, qevict-gates / qevict = {ttft['qevict-gates'] / ttft['qevict']:.3f}x; "
        f"gates / snapkv = {ttft['gates'] / ttft['snapkv']:.3f}x"
    )


if __name__ == "__main__":
    main()
