"""Where QEvict's decode-time routing cost comes from, CPU, one process (``--model``, default SmolLM2).

One prompt pass builds QEvict's cache (β = 0.2, bf16 KV) for a batch of needle prompts; then, on copies of
that same cache, interleaved and repeated:

- the decode loop (``max_new_tokens`` greedy steps) with routing, without routing (same buffers,
  ``Capacities.decode_routing=False``), and with a route that returns the cache unchanged;
- one routing event of the whole stacked cache (``QEvict.route``), the same call on a step without an
  event (``due=False``: the idle plan, no move), the plan alone, and the moves of one row on the single-shot
  path (``migrate.finish_row``, one chunk of ``ROUTING_CHUNK`` windows and every F slot).

Every timing is the median over ``--repeats`` interleaved rounds, with its spread (min-max). The last line
is the headline: routing's share of the decode loop (with - without, over with).

Usage: python bench/routing_cpu.py [--model NAME] [--context 4000] [--batch 4] [--new-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.checkpoint import load_model
from models.registry import resolve_model
from models.tokenizer import Tokenizer
from qevict_jax.core.cache import TieredCache
from qevict_jax.core.kv import DEFAULT_KV_DTYPE
from qevict_jax.engines.migrate import ROUTING_CHUNK, finish_row
from qevict_jax.engines.routing import plan_counts, plan_row
from qevict_jax.eval.needle import needle_prompt_text, needle_sample
from qevict_jax.methods.qevict import WindowMethod
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import add_model_arg
from qevict_jax.runtime.decode import decode_jit
from qevict_jax.runtime.prefill import pad_prompts, prefill_jit, tokens_for_budget
from qevict_jax.runtime.sampling import SamplerConfig


@dataclasses.dataclass(frozen=True)
class IdentityRoute(WindowMethod):
    """QEvict whose routing changes nothing: the decode loop calls it, nothing runs."""

    def route(self, cache: TieredCache, inv_freq: jax.Array, due: jax.Array | None = None) -> TieredCache:
        return cache


def copy_tree(tree: Any) -> Any:
    """A fresh copy of every array (the decode loop donates its cache)."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def timed(fn: Callable[[Any], Any], arg: Any) -> float:
    """Seconds of one call of ``fn`` on a fresh copy of ``arg`` (copied before the clock starts), outputs
    ready."""
    arg = jax.block_until_ready(copy_tree(arg))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(arg))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_arg(ap)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    path = resolve_model(args.model)
    cfg, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    g = args.new_tokens
    sampler = SamplerConfig(max_new_tokens=g)
    qevict = make_method("qevict", args.budget)
    fields = {f.name: getattr(qevict, f.name) for f in dataclasses.fields(qevict)}
    identity = IdentityRoute(**fields)
    prompts = []
    for i in range(args.batch):
        s = needle_sample(i, args.context - 100, lambda t: len(tok.encode(t, add_bos=False)))
        text = tok.apply_chat_template(
            [{"role": "user", "content": needle_prompt_text(s)}], add_generation_prompt=True
        )
        prompts.append(tok.encode(text + s.answer_prefix))
    tokens, lengths = pad_prompts(prompts)
    budget = tokens_for_budget(qevict, lengths, g, "bucket")
    graphdef, state = nnx.split(model)
    rng = jax.random.key(0)
    t0 = time.perf_counter()
    first, cache = prefill_jit(
        graphdef,
        state,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        rng,
        qevict,
        sampler,
        budget,
        g,
        DEFAULT_KV_DTYPE,
    )
    jax.block_until_ready(cache)
    print(f"prefill (with compilation) {time.perf_counter() - t0:.1f} s; caps {cache.caps}")
    no_route_cache = cache.replace(caps=dataclasses.replace(cache.caps, decode_routing=False))
    inv_freq = jnp.asarray(cfg.inv_freq(), jnp.float32)
    lengths_j = jnp.asarray(lengths)

    def decode(method):
        return lambda c: decode_jit(graphdef, state, c, first, lengths_j, rng, method, sampler, None)

    rows = lambda f: jax.vmap(jax.vmap(f))
    route = jax.jit(lambda c: qevict.route(c, inv_freq), donate_argnums=0)
    idle = jax.jit(lambda c: qevict.route(c, inv_freq, due=jnp.bool_(False)), donate_argnums=0)
    plan = jax.jit(rows(lambda r: plan_row(r, qevict.ranking, qevict.cache.promotion)))
    planned = plan(cache)
    counts = plan_counts(planned[0], cache.caps.nl)
    print(
        f"F windows a plan quantizes/dequantizes per row (max over rows): {int(counts.max())} "
        f"(chunk {ROUTING_CHUNK})"
    )

    def mover(bound):
        f = jax.jit(
            rows(lambda r, p, c: finish_row(r, p, c, inv_freq, bound=bound)), donate_argnums=0
        )
        return lambda c: f(c, *planned)

    pieces = {  # name: (function of a fresh copy of the input, input)
        "decode loop, routing": (decode(qevict), cache),
        "decode loop, no routing": (decode(qevict), no_route_cache),
        "decode loop, identity route": (decode(identity), cache),
        "routing event (route)": (route, cache),
        "route on a step without an event": (idle, cache),
        "plan only": (plan, cache),
        f"single-shot move, bound {ROUTING_CHUNK}": (mover(ROUTING_CHUNK), cache),
        "single-shot move, every F slot": (mover(None), cache),
    }
    for fn, arg in pieces.values():  # compile and warm
        timed(fn, arg)
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for _ in range(args.repeats):
        for name, (fn, arg) in pieces.items():
            times[name].append(timed(fn, arg))
    steps = g - 1
    print(f"\ncontext {len(prompts[0])}, batch {args.batch}, {steps} decode steps, {args.repeats} rounds")
    print("| piece | median (ms) | min (ms) | max (ms) | per decode step (ms) |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        per = f"{med / steps * 1e3:.1f}" if name.startswith("decode") else "-"
        print(f"| {name} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} | {per} |")
    shares = [
        (a - b) / a
        for a, b in zip(times["decode loop, routing"], times["decode loop, no routing"], strict=True)
    ]
    print(
        f"routing share of the decode loop: median {statistics.median(shares):.1%} "
        f"(rounds {min(shares):.1%} to {max(shares):.1%})"
    )


if __name__ == "__main__":
    main()
