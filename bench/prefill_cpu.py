"""How much of the machine a prefill uses: achieved GFLOP/s of a Full-KV prefill against a jitted matmul.

  python bench/prefill_cpu.py --model qwen2.5-coder-0.5b-instruct --context 4096
  python bench/prefill_cpu.py --model qwen2.5-coder-0.5b-instruct --context 4096 --dtype bfloat16 --token-chunk 1024

In one process: (1) a jitted matmul of the MLP's shape ([T, Dm] x [Dm, F]) in float32 and in bfloat16 with a
float32 result, the machine's attainable rate for this model's largest products; (2) the Full-KV prefill of
one random-token prompt of ``--context`` tokens through ``generate`` (one new token; TTFT of the second of two
runs, so compilation is excluded), its FLOPs counted from the shapes: 2 x T x (every layer's projection and
MLP weights) + 2 x T^2 x H x D per layer (causal q.k and p.v) + the last token's logits. It prints the
prefill's GFLOP/s and its share of each matmul rate, and the gap the issue asks about (matmul f32 / prefill).

``--dtype bfloat16`` loads the weights in bfloat16 (the activations follow; norms and softmax stay float32);
``--logits-vs-float32`` then also compares its logits at every position of a ~2,100-token needle prompt (the
Qwen parity test's third prompt) with the float32 model's, against the parity test's tolerance (max |diff| <=
1e-3 max |logit|, top-1 agreement >= 0.99; the float32 model meets it against transformers);
``--token-chunk`` sets the tokens per chunk of each layer's position-wise parts (``models.model.TOKEN_CHUNK``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import model as model_lib  # noqa: E402
from models.checkpoint import load_model  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from models.registry import resolve_model  # noqa: E402
from models.tokenizer import Tokenizer  # noqa: E402
from qevict_jax.eval.needle import needle_prompt_text, needle_sample  # noqa: E402
from qevict_jax.methods.registry import make_method  # noqa: E402
from qevict_jax.model_args import add_model_arg  # noqa: E402
from qevict_jax.runtime.generate import generate  # noqa: E402
from qevict_jax.runtime.sampling import SamplerConfig  # noqa: E402


def prefill_flops(cfg: ModelConfig, t: int) -> float:
    """FLOPs of a causal prefill of ``t`` tokens with logits at the last token only."""
    hq, hkv, d = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    per_token = 2 * (d * hq + 2 * d * hkv + hq * d + 3 * d * cfg.intermediate_size)
    attention = 2 * t * t * cfg.num_heads * cfg.head_dim  # causal half of q.k and of p.v, 2 FLOPs a MAC
    return float(cfg.num_layers * (t * per_token + attention) + 2 * d * cfg.vocab_size)


def matmul_gflops(m: int, k: int, n: int, dtype, reps: int = 5) -> float:
    """GFLOP/s of a jitted [m, k] x [k, n] product with a float32 result (median of ``reps``)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((k, n), np.float32), dtype)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--token-chunk", type=int, default=model_lib.TOKEN_CHUNK)
    ap.add_argument("--runs", type=int, default=2, help="prefills; the first one's time includes compiling")
    ap.add_argument(
        "--logits-vs-float32", action="store_true", help="compare logits with the float32 model's"
    )
    args = ap.parse_args(argv)
    if args.context < 16 or args.token_chunk < 1 or args.runs < 2:
        ap.error("--context must be >= 16, --token-chunk >= 1, --runs >= 2")
    cfg, model = load_model(resolve_model(args.model), dtype=args.dtype)
    model_lib.TOKEN_CHUNK = args.token_chunk
    f32 = matmul_gflops(args.context, cfg.hidden_size, cfg.intermediate_size, jnp.float32)
    bf16 = matmul_gflops(args.context, cfg.hidden_size, cfg.intermediate_size, jnp.bfloat16)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.context).tolist()
    ttfts = []
    for _ in range(args.runs):
        res = generate(model, [prompt], SamplerConfig(max_new_tokens=1), make_method("full"))
        ttfts.append(res.ttft_s)
    ttft = min(ttfts[1:])
    flops = prefill_flops(cfg, args.context)
    rate = flops / ttft / 1e9
    print(
        f"{args.model}, {args.dtype} weights, token chunk {args.token_chunk}, {args.context} tokens, "
        f"jax {jax.__version__} on {jax.default_backend()}"
    )
    print(f"matmul [{args.context}, {cfg.hidden_size}] x [{cfg.hidden_size}, {cfg.intermediate_size}]:")
    print(f"  float32: {f32:.0f} GFLOP/s; bfloat16 (float32 result): {bf16:.0f} GFLOP/s")
    print(
        f"prefill: {flops / 1e12:.2f} TFLOP in {ttft:.2f} s (TTFT, runs {', '.join(f'{t:.2f}' for t in ttfts)}) "
        f"= {rate:.0f} GFLOP/s: {rate / f32:.2f} of the float32 matmul, {rate / bf16:.2f} of the bfloat16 one"
    )
    print(f"gap (float32 matmul / prefill): {f32 / rate:.2f}x")
    if args.logits_vs_float32:
        compare_logits(resolve_model(args.model), model)


def compare_logits(folder: Path, model) -> None:
    """Logits of ``model`` against the float32 model's at every position of the parity test's needle prompt."""
    _, ref_model = load_model(folder, dtype="float32")
    tok = Tokenizer.from_dir(folder)
    needle = needle_sample(0, 2100, lambda t: len(tok.encode(t, add_bos=False)))
    text = (
        tok.apply_chat_template([{"role": "user", "content": needle_prompt_text(needle)}])
        + needle.answer_prefix
    )
    tokens = jnp.asarray([tok.encode(text)], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def forward(m) -> np.ndarray:  # the weights enter the program as an argument, not as constants
        graphdef, state = nnx.split(m)
        run = jax.jit(lambda st, t, p: nnx.merge(graphdef, st)(t, p)[0])
        return np.asarray(run(state, tokens, positions)[0], np.float32)

    got, want = forward(model), forward(ref_model)
    diff = np.abs(got - want)
    top1 = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    bound = 1e-3 * np.abs(want).max()
    print(
        f"logits vs float32, {tokens.shape[1]} tokens: max |diff| {diff.max():.3e} (parity bound {bound:.3e}: "
        f"{'within' if diff.max() <= bound else 'OUTSIDE'}), mean |diff| {diff.mean():.3e}, top-1 agreement "
        f"{top1:.4f} ({'>=' if top1 >= 0.99 else '<'} 0.99)"
    )


if __name__ == "__main__":
    main()
