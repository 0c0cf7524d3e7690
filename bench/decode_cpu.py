"""Decode speed of QEvict vs Full-KV on a registered model (``--model``, default SmolLM2-135M-Instruct), CPU,
one process.

For each context length and batch size: TTFT, ms per decode step, decode tokens/s and the measured memory
ratio of Full-KV and of QEvict (β = 0.2, 16-bit KV), QEvict once with the Q tier read by the CPU kernel
(``pallas_kernels.cpu_ledger``) and once by the jnp reference. The routing share is measured in the loop:
QEvict's decode time minus that of the same cache with decode-time routing switched off (same shapes),
over QEvict's decode time. With ``--hf``, Hugging Face transformers' eager Full-KV on the same prompt
(batch 1) is the outside reference.

Usage: python bench/decode_cpu.py [--model qwen2.5-coder-0.5b-instruct] [--contexts 4000,8000] [--batches 1,4]
  [--new-tokens 64] [--method "qevict-int2"] [--hf]

``--method`` times another window method (a spec, ``name[,option=value...]``; default the default ``qevict``)
at ``--budget``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import jax

from models.checkpoint import load_model
from models.registry import model_source, resolve_model, transformers_args
from models.tokenizer import Tokenizer
from qevict_jax.core.budget import BudgetedTiers
from qevict_jax.eval.needle import needle_prompt_text, needle_sample
from qevict_jax.methods.registry import bind_tokenizer, make_method
from qevict_jax.model_args import add_model_arg
from qevict_jax.pipeline import resolve_method
from qevict_jax.runtime.compiled import EXECUTABLES
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.results import GenerationResult
from qevict_jax.runtime.sampling import SamplerConfig


@dataclasses.dataclass(frozen=True)
class NoDecodeRouting(BudgetedTiers):
    """QEvict's capacities with no decode-time routing: the same buffers, the baseline of the routing share."""

    def capacities(self, cache_cfg, request):
        return dataclasses.replace(super().capacities(cache_cfg, request), decode_routing=False)


def release_compiled() -> None:
    """Forget every compiled program and trace (the next call traces and compiles again)."""
    EXECUTABLES.clear()
    jax.clear_caches()


def timed(model, prompts, sampler, method, repeats: int) -> GenerationResult:
    """The run with the fastest decode of ``repeats`` (compilation is ahead of time and excluded)."""
    runs = [generate(model, prompts, sampler, method) for _ in range(repeats)]
    return min(runs, key=lambda r: r.decode_s)


def hf_eager(source: Path, ids: list[int], new_tokens: int, repeats: int) -> tuple[float, float]:
    """(TTFT s, decode s per step) of transformers' eager Full-KV greedy decoding, float32, CPU, of the model
    at ``source`` (a .gguf file or a Hugging Face folder)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, kwargs = transformers_args(source)
    hf = AutoModelForCausalLM.from_pretrained(folder, **kwargs, torch_dtype=torch.float32)
    hf.eval()
    x = torch.tensor([ids])
    best = (float("inf"), float("inf"))
    with torch.inference_mode():
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf(x, use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            ttft = time.perf_counter() - t0
            past = out.past_key_values
            t0 = time.perf_counter()
            for _ in range(new_tokens - 1):
                out = hf(tok, past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
            step = (time.perf_counter() - t0) / (new_tokens - 1)
            best = min(best, (ttft, step), key=lambda r: r[1])
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_arg(ap)
    ap.add_argument("--contexts", default="4000,8000")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--method", default="qevict", help="window method spec: name[,option=value...]")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-reference", action="store_true", help="skip QEvict through the jnp reference")
    ap.add_argument("--hf", action="store_true", help="also time transformers' eager Full-KV (batch 1)")
    args = ap.parse_args()

    path = resolve_model(args.model)
    cfg, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    g = args.new_tokens
    sampler = SamplerConfig(max_new_tokens=g)  # no EOS: every run decodes g tokens
    full = make_method("full", 1.0)
    qevict = bind_tokenizer(resolve_method(args.method, args.budget), tok)
    if not isinstance(getattr(qevict, "allocation", None), BudgetedTiers):
        ap.error(f"--method {args.method!r}: not a budgeted window method (QEvict, R1-R4 and their variants)")
    no_routing = dataclasses.replace(qevict, allocation=NoDecodeRouting())

    print(
        f"{args.model}, f32 compute, bf16 KV, CPU, {g} new tokens (greedy, no EOS); "
        f"{qevict.name} β={qevict.cache.budget}, Ω={qevict.cache.omega}, W={qevict.cache.window}, "
        f"q_frac={qevict.cache.q_frac}, quant={qevict.cache.quant}, q_rank={qevict.cache.q_rank}, "
        f"q_logit_bias={qevict.cache.q_logit_bias}, q_biased_mass={qevict.cache.q_biased_mass}, "
        f"q_bias_gate={qevict.cache.q_bias_gate}"
    )
    print(
        "| prompt tokens | batch | method | TTFT (s) | ms/step | tok/s | tok/s vs Full-KV | TTFT vs Full-KV "
        "| routing share | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    steps = g - 1
    for ctx in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = []
            for i in range(batch):
                s = needle_sample(i, ctx - 100, lambda t: len(tok.encode(t, add_bos=False)))
                text = tok.apply_chat_template(
                    [{"role": "user", "content": needle_prompt_text(s)}], add_generation_prompt=True
                )
                prompts.append(tok.encode(text + s.answer_prefix))
            rows = [("full", timed(model, prompts, sampler, full, args.repeats))]
            paths = [(f"{qevict.name} (CPU kernel)", "1")] + (
                [] if args.no_reference else [(f"{qevict.name} (jnp ref)", "0")]
            )
            for label, flag in paths:
                os.environ["QEVICT_CPU_KERNEL"] = flag
                release_compiled()  # the kernel choice is made at trace time
                res = timed(model, prompts, sampler, qevict, args.repeats)
                base = timed(model, prompts, sampler, no_routing, args.repeats)
                rows.append((label, res, max(0.0, res.decode_s - base.decode_s) / res.decode_s))
            os.environ.pop("QEVICT_CPU_KERNEL")
            release_compiled()
            f_res = rows[0][1]
            f_tps = steps * batch / f_res.decode_s
            for label, res, *share in rows:
                tps = steps * batch / res.decode_s
                print(
                    f"| {len(prompts[0])} | {batch} | {label} | {res.ttft_s:.3f} | {res.decode_s / steps * 1e3:.1f} "
                    f"| {tps:.1f} | {tps / f_tps:.2f}x | {res.ttft_s / f_res.ttft_s:.2f}x "
                    f"| {f'{share[0]:.1%}' if share else '-'} | {res.memory_ratio:.3f} |"
                )
            if args.hf and batch == 1:
                ttft, step = hf_eager(model_source(args.model), prompts[0], g, args.repeats)
                print(
                    f"| {len(prompts[0])} | 1 | transformers eager (Full-KV) | {ttft:.3f} | {step * 1e3:.1f} "
                    f"| {1 / step:.1f} | {(1 / step) / f_tps:.2f}x | {ttft / f_res.ttft_s:.2f}x | - | - |"
                )
    print("tok/s and TTFT ratios are against this project's Full-KV in the same process and row.")


if __name__ == "__main__":
    main()
