"""What streaming costs: decode tokens/s of the same generation with no stream (the loop compiled without a
callback) and with the text stream that ``qevict generate --stream`` uses (one host callback per decoded token,
the tokenizer decoding the answer so far, written to a null sink), Full-KV and QEvict, in one process.

Runs alternate between off and on, and each row reports the fastest of ``--repeats`` (compilation is ahead of
time and excluded), so a load that changes during the run weighs on both sides alike.

Usage: python bench/stream_cost.py [--model NAME] [--context 2000] [--new-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse

from qevict_jax.eval.needle import needle_prompt_text, needle_sample
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import add_model_args, load
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig
from qevict_jax.runtime.streaming import TextStream


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    _, model, tok = load(args)
    s = needle_sample(0, args.context - 100, lambda t: len(tok.encode(t, add_bos=False)))
    text = tok.apply_chat_template(
        [{"role": "user", "content": needle_prompt_text(s)}], add_generation_prompt=True
    )
    prompts = [tok.encode(text + s.answer_prefix)]
    sampler = SamplerConfig(max_new_tokens=args.new_tokens)  # no EOS: every run decodes the same count
    steps = args.new_tokens - 1
    print(
        f"{args.model}, prompt {len(prompts[0])} tokens, {args.new_tokens} new, batch 1, fastest of {args.repeats}"
    )
    print("| method | tok/s, no stream | tok/s, --stream | cost per token (ms) | same tokens |")
    print("|---|---|---|---|---|")
    for method in (make_method("full", 1.0), make_method("qevict", args.budget)):
        off, on = [], []
        for _ in range(args.repeats + 1):  # the first pair compiles
            off.append(generate(model, prompts, sampler, method))
            sink = TextStream(decode=tok.decode, write=lambda _t: None)
            on.append(generate(model, prompts, sampler, method, on_token=sink))
            assert sink.text == tok.decode(on[-1].tokens[0])
        t_off = min(r.decode_s for r in off[1:])
        t_on = min(r.decode_s for r in on[1:])
        print(
            f"| {method.name} | {steps / t_off:.1f} | {steps / t_on:.1f} | {1e3 * (t_on - t_off) / steps:.2f} "
            f"| {off[-1].tokens == on[-1].tokens} |"
        )


if __name__ == "__main__":
    main()
