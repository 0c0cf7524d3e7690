"""Time to first token of Full-KV and QEvict (β = 0.2) on a model (``--model``), repeated, compile excluded.

One random prompt batch (row i of ``context - 8 * (i % 8)`` tokens, as ``bench/throughput.py`` builds them),
``generate`` with 2 new tokens: one call per method to compile, then ``--repeats`` rounds over the methods.
Prints the median, min and max TTFT per method and the first tokens (every repeat must give the same ones).
To compare two versions of the code, run it alternately with ``PYTHONPATH`` set to each checkout.

Usage:
  PYTHONPATH=. python bench/ttft.py [--model smollm2-135m-instruct] [--context 2048] [--batch 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import qevict_jax
from models.checkpoint import load_model
from models.registry import resolve_model
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import add_model_arg
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cfg, model = load_model(resolve_model(args.model))
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, cfg.vocab_size, args.context - 8 * (i % 8)).tolist() for i in range(args.batch)]
    sampler = SamplerConfig(max_new_tokens=2)
    methods = {"full": make_method("full"), "qevict": make_method("qevict", 0.2)}
    first = {name: generate(model, prompts, sampler, m).tokens for name, m in methods.items()}  # compiles
    ttft: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, method in methods.items():
            res = generate(model, prompts, sampler, method)
            assert res.tokens == first[name], "a repeat gave other tokens"
            ttft[name].append(res.ttft_s)
    code = Path(qevict_jax.__file__).resolve().parent.parent
    for name, times in ttft.items():
        t = np.asarray(times)
        print(
            f"{code} context {args.context} batch {args.batch} {name}: TTFT median {np.median(t):.3f} s, "
            f"min {t.min():.3f}, max {t.max():.3f} ({len(t)} runs); first tokens {first[name]}"
        )


if __name__ == "__main__":
    main()
