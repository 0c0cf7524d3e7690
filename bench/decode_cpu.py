"""Decode speed of QEvict (β = 0.2) vs Full-KV on SmolLM2-135M-Instruct, CPU, one process.

For each context length: TTFT, decode tokens/s and step latency of Full-KV and QEvict, the routing share of
QEvict's decode time (one routing event of every layer, jitted and timed alone on the final cache, times the
number of routing events, over the decode time), and the measured memory ratio. The last line is the
headline ratio.
Usage: python bench/decode_cpu.py [--contexts 4000,8000] [--new-tokens 64] [--budget 0.2] [--repeats 2]
"""

from __future__ import annotations

import argparse


def timed(model, ids, sampler, method, repeats: int):
    """Best of ``repeats`` runs (``generate`` compiles ahead of time and excludes compilation from its
    timings, so no warm-up run is needed)."""
    from qevict_jax.generate import generate

    runs = [generate(model, [ids], sampler, method) for _ in range(repeats)]
    return min(runs, key=lambda r: r.decode_s), min(r.ttft_s for r in runs)


def routing_seconds(cache, model, method, repeats: int = 5) -> float:
    """Seconds of one routing event over all layers and rows of a stacked ``TieredCache``."""
    import time

    import jax
    import jax.numpy as jnp

    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)
    route = jax.jit(lambda c: method.route(c, inv_freq))
    jax.block_until_ready(route(cache))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(route(cache))
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4000,8000")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()

    from models.checkpoint import load_model
    from models.registry import resolve_model
    from models.tokenizer import Tokenizer
    from qevict_jax.generate import SamplerConfig
    from qevict_jax.methods import make_method
    from qevict_jax.needle import needle_prompt_text, needle_sample

    path = resolve_model("smollm2-135m-instruct")
    cfg, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    g = args.new_tokens
    sampler = SamplerConfig(max_new_tokens=g)  # no EOS: every run decodes g tokens
    full = make_method("full", 1.0)
    qevict = make_method("qevict", args.budget)

    rows = []
    for ctx in [int(c) for c in args.contexts.split(",")]:
        s = needle_sample(0, ctx - 100, lambda t: len(tok.encode(t, add_bos=False)))
        text = tok.apply_chat_template(
            [{"role": "user", "content": needle_prompt_text(s)}], add_generation_prompt=True
        )
        ids = tok.encode(text + s.answer_prefix)
        f_res, f_ttft = timed(model, ids, sampler, full, args.repeats)
        q_res, q_ttft = timed(model, ids, sampler, qevict, args.repeats)
        steps = g - 1
        events = int(q_res.cache.routing_events[0, 0])
        share = events * routing_seconds(q_res.cache, model, qevict) / q_res.decode_s
        rows.append(
            (
                len(ids),
                f_ttft,
                q_ttft,
                f_res.decode_s / steps,
                q_res.decode_s / steps,
                share,
                q_res.memory_ratio,
                steps / f_res.decode_s,
                steps / q_res.decode_s,
            )
        )

    print(
        f"SmolLM2-135M-Instruct f32 on CPU, {g} new tokens, QEvict β={args.budget} (Ω={qevict.cache.omega}, "
        f"W={qevict.cache.window})"
    )
    print(
        "| prompt tokens | TTFT full (s) | TTFT qevict (s) | TTFT ratio | step full (ms) | step qevict (ms) "
        "| tok/s full | tok/s qevict | tok/s ratio | routing share | memory ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for p, ft, qt, fs, qs, share, mem, ftps, qtps in rows:
        print(
            f"| {p} | {ft:.3f} | {qt:.3f} | {qt / ft:.3f} | {fs * 1e3:.1f} | {qs * 1e3:.1f} | {ftps:.1f} | "
            f"{qtps:.1f} | {qtps / ftps:.2f} | {share:.1%} | {mem:.3f} |"
        )
    worst = max(rows, key=lambda r: r[0])
    print(
        f"headline at {worst[0]} tokens: QEvict/Full-KV decode tok/s = {worst[8] / worst[7]:.2f}x, "
        f"TTFT = {worst[2] / worst[1]:.3f}x, routing share = {worst[5]:.1%}"
    )


if __name__ == "__main__":
    main()
