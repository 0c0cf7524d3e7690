"""Prefill + 32-token greedy decode of a model (``--model``, default SmolLM2-135M-Instruct): qevict-jax Full-KV
vs transformers eager.

Same ~4K-token needle prompt, float32, CPU, same process. Prints a table; the last line is the headline ratio.
Usage: python bench/prefill_decode_vs_hf.py [--model NAME] [--context-tokens 4000] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np

from models.checkpoint import load_model
from models.registry import model_source, resolve_model, transformers_args
from models.tokenizer import Tokenizer
from qevict_jax.eval.needle import needle_prompt_text, needle_sample
from qevict_jax.methods.full import FullKV
from qevict_jax.model_args import add_model_arg
from qevict_jax.runtime.generate import SamplerConfig, generate


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_arg(ap)
    ap.add_argument("--context-tokens", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    cfg, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    s = needle_sample(0, args.context_tokens, lambda t: len(tok.encode(t, add_bos=False)))
    text = tok.apply_chat_template(
        [{"role": "user", "content": needle_prompt_text(s)}], add_generation_prompt=True
    )
    ids = tok.encode(text + s.answer_prefix)
    g = args.new_tokens
    sampler = SamplerConfig(max_new_tokens=g)  # no EOS: always decode g tokens

    # f32 KV, as transformers' f32 eager cache: the same arithmetic on both sides
    generate(model, [ids], sampler, FullKV(), kv_dtype=jnp.float32)  # compile
    ours = generate(model, [ids], sampler, FullKV(), kv_dtype=jnp.float32)

    torch.set_num_threads(2)
    folder, kwargs = transformers_args(model_source(args.model))
    hf = AutoModelForCausalLM.from_pretrained(
        folder, **kwargs, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        t0 = time.perf_counter()
        out = hf(x, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        t1 = time.perf_counter()
        hf_tokens = [int(nxt)]
        for _ in range(g - 1):
            out = hf(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            hf_tokens.append(int(nxt))
        t2 = time.perf_counter()
    hf_ttft, hf_decode = t1 - t0, t2 - t1
    same = int(np.sum(np.asarray(hf_tokens) == np.asarray(ours.tokens[0][: len(hf_tokens)])))

    print(f"prompt tokens: {len(ids)}, new tokens: {g}, greedy tokens identical: {same}/{g}")
    print("| implementation | prefill / TTFT (s) | decode (s) | decode tok/s | total (s) |")
    print("|---|---|---|---|---|")
    ours_total = ours.ttft_s + ours.decode_s
    hf_total = hf_ttft + hf_decode
    print(
        f"| qevict-jax Full-KV (jit, f32) | {ours.ttft_s:.3f} | {ours.decode_s:.3f} | "
        f"{(g - 1) / ours.decode_s:.1f} | {ours_total:.3f} |"
    )
    print(
        f"| transformers eager (f32) | {hf_ttft:.3f} | {hf_decode:.3f} | {(g - 1) / hf_decode:.1f} | {hf_total:.3f} |"
    )
    print(
        f"TTFT ratio ours/HF: {ours.ttft_s / hf_ttft:.2f}x; decode tok/s ratio ours/HF: "
        f"{hf_decode / ours.decode_s:.2f}x"
    )
    print(
        f"headline: prefill+{g}-token decode time, qevict-jax / transformers eager = {ours_total / hf_total:.2f}x"
    )


if __name__ == "__main__":
    main()
