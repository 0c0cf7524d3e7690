"""Time to first token of Full-KV and other methods (β = 0.2; default QEvict) on a model (``--model``), repeated,
compile excluded, with each method's ratio to Full-KV's median measured in the same process.

One random prompt batch (row i of ``context - 8 * (i % 8)`` tokens, as ``bench/throughput.py`` builds them),
``generate`` with 2 new tokens: one call per method to compile, then ``--repeats`` rounds over the methods.
Prints the median, min and max TTFT per method and the first tokens (every repeat must give the same ones).
To compare two versions of the code, run it alternately with ``PYTHONPATH`` set to each checkout.

Usage:
  PYTHONPATH=. python bench/ttft.py [--model smollm2-135m-instruct] [--context 2048] [--batch 1] [--repeats 3]
      [--methods qevict,kvzip,qevict-kvzip]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import qevict_jax
from models.checkpoint import load_model
from models.registry import resolve_model
from models.tokenizer import Tokenizer
from qevict_jax.eval.tasks import names
from qevict_jax.methods.registry import bind_tokenizer, make_method
from qevict_jax.model_args import add_model_arg
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default="qevict", help="comma-separated methods besides Full-KV, at β = 0.2")
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    cfg, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, cfg.vocab_size, args.context - 8 * (i % 8)).tolist() for i in range(args.batch)]
    sampler = SamplerConfig(max_new_tokens=2)
    methods = {"full": make_method("full")}
    methods |= {name: bind_tokenizer(make_method(name, 0.2), tok) for name in names(args.methods) if name != "full"}
    first = {name: generate(model, prompts, sampler, m).tokens for name, m in methods.items()}  # compiles
    ttft: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, method in methods.items():
            res = generate(model, prompts, sampler, method)
            assert res.tokens == first[name], "a repeat gave other tokens"
            ttft[name].append(res.ttft_s)
    code = Path(qevict_jax.__file__).resolve().parent.parent
    full = float(np.median(ttft["full"]))
    for name, times in ttft.items():
        t = np.asarray(times)
        print(
            f"{code} context {args.context} batch {args.batch} {name}: TTFT median {np.median(t):.3f} s "
            f"({np.median(t) / full:.2f}x Full-KV), min {t.min():.3f}, max {t.max():.3f} ({len(t)} runs); "
            f"first tokens {first[name]}"
        )


if __name__ == "__main__":
    main()
