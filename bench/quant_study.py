"""Which low-bit format should QEvict's Q tier use? A study on real K/V and real decode queries.

One prose prompt (the Python manual, ``--context`` tokens) goes through the model with Full-KV; the model then
decodes ``--queries`` tokens greedily. One forward pass over prompt + decoded tokens records every layer's
post-RoPE queries, keys and values (the decoded tokens' queries are the decode queries: Full-KV decoding runs
the same computation). For every ``--layer-stride``-th layer, each candidate format quantizes the prompt's
windows of W = 8 tokens between the 5 sinks and the last ``--recent`` prompt tokens (what a Q tier holds when
every window is kept); sinks, the recent region and the decoded tokens stay exact, in the 16-bit K/V the F
tier stores. One row per format:

- bytes per window: the ledger slot's bytes for one window (all layers, KV heads), grids and the ledger's
  metadata (window id, score, flags) included, measured from the real cache pytree for today's format and
  with the candidate's codes and grids substituted for the others; and that as a share of an F window;
- key and value relative error (Frobenius, over every quantized window);
- attention-output relative error of the decode queries against Full-KV;
- per-window attention mass of the decode queries against Full-KV's: cosine (the paper reports 0.9824 for
  its INT2 tier) and Spearman rank correlation, mean over queries and heads.

Formats:
- ``today``: the landed ledger format (``pallas_kernels.quant.quantize_windows``): pre-RoPE keys with one
  grid per channel over the window, values one grid per token, asymmetric, f16 grids;
- ``rot-kXvY``: a fixed randomized Hadamard rotation of each head's channels (QuaRot-style: ``H diag(s)``,
  orthogonal), applied to post-RoPE keys and to values; one asymmetric grid per token for both, X / Y bits;
  attention reads rotated keys with the query rotated once, the value output is rotated back once;
- ``tok-kXvY``: the same per-token grids without the rotation (what the rotation buys);
- ``kch2-rotvY``: today's keys, values rotated per token (``kch2-vY``: not rotated);
- ``cen-kXvY``: ``rot-kXvY`` with each window's per-channel mean of the post-RoPE keys (f16, D values per
  window and head) subtracted before the rotation and added back after: attention adds ``q . mean`` once per
  window, and a per-token grid no longer spends its range on a channel offset (Qwen2's QKV bias);
  ``crot-kXvY`` (the ledger format of that name): the mean taken over the pre-RoPE keys (where a bias is
  constant) and RoPE'd at each token's position (attention adds ``q . RoPE_t(mean)`` per token);
- suffixes ``-bf16`` / ``-fp8``: grids stored as bfloat16 / float8 e4m3 (rounded outward, so the grid still
  covers each group's range) instead of float16; ``-q8``: each grid value an 8-bit code on a linear scale
  (f16 offset and step) shared by the groups of one window and head, as llama.cpp's k-quants do;
- ``-lloyd``: the Lloyd-Max codebook of the standard normal (2 bits: levels +-0.4528, +-1.5104; 3 and 4
  bits likewise) in units of each token's standard deviation about its mean (grid = mean and deviation)
  instead of uniform levels, for the per-token groups (after the rotation a token's channels are close to
  Gaussian); keys with per-channel grids stay uniform.

Usage: python bench/quant_study.py [--model NAME] [--context 4096] [--queries 32] [--layer-stride 3]
    [--formats today,rot-k2v2,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from models.attention import chunked_attention, rope_cos_sin
from models.checkpoint import load_model
from models.registry import DEFAULT_MODEL, resolve_model
from models.tokenizer import Tokenizer
from pallas_kernels.quant import quantize_windows
from qevict_jax.core.cache import abstract_cache
from qevict_jax.core.config import Capacities, ring_capacity
from qevict_jax.core.kv import DEFAULT_KV_DTYPE
from qevict_jax.eval.needle import prose_paragraphs
from qevict_jax.methods.full import FullKV
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig

SINK, WINDOW = 5, 8
_HALF_LEVELS = {  # Lloyd-Max quantizer of N(0, 1): the positive levels (Max 1960), 4 / 8 / 16 levels
    2: (0.4528, 1.5104),
    3: (0.2451, 0.7560, 1.3439, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}
LLOYD = {bits: np.array([-x for x in reversed(h)] + list(h)) for bits, h in _HALF_LEVELS.items()}
GRID_DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn, "q8": np.uint8}
GRID_MANTISSA = {"f16": 10, "bf16": 7, "fp8": 3}


# ---------------------------------------------------------------------------------------------- recording
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Recorded:
    """Per layer (leading [L]): q [L, B, T, H, D], k, v [L, B, T, Hkv, D] post-RoPE, as the attention saw them."""

    q: jax.Array
    k: jax.Array
    v: jax.Array


def record_attend(q, k, v, layer_cache: Recorded, ctx):
    """Causal attention over the current tokens, recording q, k, v of the layer."""
    out, _ = chunked_attention(
        q, k, v, q_pos=ctx.positions, k_pos=ctx.positions, sliding_window=ctx.cfg.sliding_window
    )
    return out, Recorded(q=q.astype(jnp.float32), k=k.astype(jnp.float32), v=v.astype(jnp.float32))


def record_qkv(model, ids: list[int]) -> Recorded:
    """q, k, v of every layer for one sequence (batch 1)."""
    cfg = model.cfg
    t = len(ids)
    empty = Recorded(
        q=jnp.zeros((cfg.num_layers, 1, t, cfg.num_heads, cfg.head_dim), jnp.float32),
        k=jnp.zeros((cfg.num_layers, 1, t, cfg.num_kv_heads, cfg.head_dim), jnp.float32),
        v=jnp.zeros((cfg.num_layers, 1, t, cfg.num_kv_heads, cfg.head_dim), jnp.float32),
    )
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, cache):
        m = nnx.merge(graphdef, state)
        pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return m(tokens, pos, cache, attend=record_attend, logit_index=jnp.zeros((1,), jnp.int32))[1]

    return run(state, jnp.asarray([ids], jnp.int32), empty)


# ---------------------------------------------------------------------------------------------- formats
def round_grid(x: np.ndarray, kind: str, direction: int) -> np.ndarray:
    """``x`` [..., G, 1] (float64; one grid value per group) stored as grid kind ``kind``, rounded outward:
    down (direction -1) or up (+1). "q8": an 8-bit code per group on a linear scale ``lo + u * step`` whose
    ``lo`` and ``step`` (f16) the G groups of one window and head share (k-quant style)."""
    if kind == "q8":
        lo = round_grid(x.min(-2, keepdims=True), "f16", -1)
        step = round_grid(np.maximum((x.max(-2, keepdims=True) - lo) / 255, 1e-12), "f16", +1)
        u = np.clip(np.floor((x - lo) / step) if direction < 0 else np.ceil((x - lo) / step), 0, 255)
        return lo + u * step
    dt = GRID_DTYPES[kind]
    y = x.astype(dt).astype(np.float64)
    bump = np.abs(x) * 2.0 ** -GRID_MANTISSA[kind] + float(ml_dtypes.finfo(dt).smallest_normal)
    for k in range(1, 5):  # a nudge of one or two steps reaches the next representable value outward
        bad = (y > x) if direction < 0 else (y < x)
        if not bad.any():
            break
        y = np.where(bad, (x + direction * k * bump).astype(dt).astype(np.float64), y)
    return y


def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """x [..., N, W, D] rotated at positions pos [N, W] (negative positions undo a rotation), float64."""
    cos, sin = (np.asarray(a, np.float64) for a in rope_cos_sin(jnp.asarray(pos), jnp.asarray(inv_freq)))
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def uniform_groups(x: np.ndarray, bits: int, grid: str) -> tuple[np.ndarray, int]:
    """Asymmetric uniform quantization of each group (last axis) of ``x``; (x_hat, grid values per group)."""
    levels = (1 << bits) - 1
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    zero = round_grid(lo, grid, -1)
    scale = round_grid(np.maximum((hi - zero) / levels, 1e-12), grid, +1)
    codes = np.clip(np.round((x - zero) / scale), 0, levels)
    return codes * scale + zero, 2


def lloyd_groups(x: np.ndarray, bits: int, grid: str) -> tuple[np.ndarray, int]:
    """Lloyd-Max (standard normal) quantization of each group (last axis) about its mean, in units of its
    standard deviation (the grid: mean and deviation)."""
    levels = LLOYD[bits]
    mu = round_grid(x.mean(-1, keepdims=True), grid, -1)
    sd = round_grid(np.maximum(x.std(-1, keepdims=True), 1e-12), grid, +1)
    idx = np.abs(((x - mu) / sd)[..., None] - levels).argmin(-1)
    return levels[idx] * sd + mu, 2


def hadamard(d: int, seed: int = 0) -> np.ndarray:
    """A randomized Hadamard rotation ``H diag(s) / sqrt(d)`` [d, d] (orthogonal), d a power of two."""
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two")
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], d)
    return (h * signs[None, :]) / math.sqrt(d)


@dataclasses.dataclass(frozen=True)
class Format:
    """A candidate Q-tier format. k_bits / v_bits: code widths; rotate_k / rotate_v: Hadamard-rotate the
    channels first; key_grids: "token" (one grid per token) or "channel" (today's: per channel over the
    window, pre-RoPE); grid: grid dtype; codebook: "uniform" or "lloyd"."""

    name: str
    k_bits: int
    v_bits: int
    rotate_k: bool = True
    rotate_v: bool = True
    key_grids: str = "token"
    grid: str = "f16"
    codebook: str = "uniform"
    center_k: bool = False
    center_pre_rope: bool = False

    def data_bytes(self, d: int) -> float:
        """Codes + grids of one window of one KV head (K and V)."""
        gb = np.dtype(GRID_DTYPES[self.grid]).itemsize
        supers = 4 * 2 if self.grid == "q8" else 0  # lo and step of both grid values, f16
        k_grid = (d if self.key_grids == "channel" else WINDOW) * 2 * gb + supers + (2 * d if self.center_k else 0)
        v_grid = WINDOW * 2 * gb + supers
        return WINDOW * d * (self.k_bits + self.v_bits) / 8 + k_grid + v_grid


def parse_format(name: str) -> Format:
    """``today``, ``rot-k2v2[-bf16|-fp8][-lloyd]``, ``tok-k2v2``, ``kch2-rotv2``, ``kch2-v2-fp8``, ..."""
    if name == "today":
        return Format(name, 2, 2, rotate_k=False, rotate_v=False, key_grids="channel")
    parts = name.split("-")
    grid = next((p for p in parts[2:] if p in GRID_DTYPES), "f16")
    codebook = "lloyd" if "lloyd" in parts else "uniform"
    head, spec = parts[0], parts[1]
    if head in ("rot", "tok", "cen", "crot"):
        k_bits, v_bits = int(spec[1 : spec.index("v")]), int(spec[spec.index("v") + 1 :])
        rot = head != "tok"
        center = head in ("cen", "crot")
        return Format(
            name, k_bits, v_bits, rot, rot, "token", grid, codebook, center_k=center, center_pre_rope=head == "crot"
        )
    if head.startswith("kch") and spec.startswith(("rotv", "v")):  # kch2-rotv2 / kch2-v2 (today's, at a grid)
        rot_v = spec.startswith("rotv")
        return Format(
            name, int(head[3:]), int(spec[4 if rot_v else 1 :]), False, rot_v, "channel", grid, codebook
        )
    raise ValueError(f"unknown format {name!r}")


def quantize_tokens(x: np.ndarray, bits: int, fmt: Format) -> np.ndarray:
    """x [..., W, D] with one group per token (over D)."""
    if fmt.codebook == "lloyd":
        return lloyd_groups(x, bits, fmt.grid)[0]
    return uniform_groups(x, bits, fmt.grid)[0]


def reconstruct(
    fmt: Format, k_post: np.ndarray, v: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, rot: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize then dequantize windows k_post, v [Hkv, N, W, D] (positions pos [N, W]) -> (k_hat post-RoPE,
    v_hat), float64, in the original (un-rotated) channel basis."""
    if fmt.name == "today":  # the landed ledger format, through its own code
        qw = quantize_windows(
            jnp.asarray(rope(k_post, -pos, inv_freq), jnp.float32), jnp.asarray(v, jnp.float32), 2
        )
        k_hat_pre, v_hat = (np.asarray(a, np.float64) for a in qw.dequantize(2))
        return rope(k_hat_pre, pos, inv_freq), v_hat
    if fmt.key_grids == "channel":  # today's key grids, at the format's grid dtype
        k_pre = rope(k_post, -pos, inv_freq)
        k_hat_pre = np.swapaxes(uniform_groups(np.swapaxes(k_pre, -1, -2), fmt.k_bits, fmt.grid)[0], -1, -2)
        k_hat = rope(k_hat_pre, pos, inv_freq)
    elif fmt.center_k:
        if fmt.center_pre_rope:  # the window's pre-RoPE channel mean, RoPE'd at every token's position
            mean_pre = rope(k_post, -pos, inv_freq).mean(-2, keepdims=True).astype(np.float16).astype(np.float64)
            mean = rope(np.broadcast_to(mean_pre, k_post.shape), pos, inv_freq)
        else:
            mean = k_post.mean(-2, keepdims=True).astype(np.float16).astype(np.float64)  # [Hkv, N, 1, D]
        k_hat = quantize_tokens((k_post - mean) @ rot, fmt.k_bits, fmt) @ rot.T + mean
    elif fmt.rotate_k:
        k_hat = quantize_tokens(k_post @ rot, fmt.k_bits, fmt) @ rot.T
    else:
        k_hat = quantize_tokens(k_post, fmt.k_bits, fmt)
    if fmt.rotate_v:
        v_hat = quantize_tokens(v @ rot, fmt.v_bits, fmt) @ rot.T
    else:
        v_hat = quantize_tokens(v, fmt.v_bits, fmt)
    return k_hat, v_hat


# ---------------------------------------------------------------------------------------------- metrics
def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rank correlation of a, b [..., N] along the last axis (average ranks for ties are not needed here)."""
    ra = a.argsort(-1).argsort(-1).astype(np.float64)
    rb = b.argsort(-1).argsort(-1).astype(np.float64)
    ra -= ra.mean(-1, keepdims=True)
    rb -= rb.mean(-1, keepdims=True)
    return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))


@dataclasses.dataclass
class Sums:
    """Running sums of one format's errors over layers."""

    k_err: float = 0.0
    k_ref: float = 0.0
    v_err: float = 0.0
    v_ref: float = 0.0
    o_err: float = 0.0
    o_ref: float = 0.0
    cos: list[float] = dataclasses.field(default_factory=list)
    rho: list[float] = dataclasses.field(default_factory=list)


def layer_metrics(
    fmt: Format,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    prompt: int,
    recent: int,
    inv_freq,
    rot,
    sums: Sums,
):
    """q [T, H, D], k, v [T, Hkv, D] (float64, 16-bit-rounded K/V) of one layer; decode queries = t >= prompt."""
    t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    n_win = (prompt - recent - SINK) // WINDOW
    lo, hi = SINK, SINK + n_win * WINDOW
    kw = k[lo:hi].reshape(n_win, WINDOW, hkv, d).transpose(2, 0, 1, 3)  # [Hkv, N, W, D]
    vw = v[lo:hi].reshape(n_win, WINDOW, hkv, d).transpose(2, 0, 1, 3)
    pos = np.arange(lo, hi).reshape(n_win, WINDOW)
    k_hat, v_hat = reconstruct(fmt, kw, vw, pos, inv_freq, rot)
    sums.k_err += float(((k_hat - kw) ** 2).sum())
    sums.k_ref += float((kw**2).sum())
    sums.v_err += float(((v_hat - vw) ** 2).sum())
    sums.v_ref += float((vw**2).sum())
    kq, vq = k.copy(), v.copy()
    kq[lo:hi] = k_hat.transpose(1, 2, 0, 3).reshape(hi - lo, hkv, d)
    vq[lo:hi] = v_hat.transpose(1, 2, 0, 3).reshape(hi - lo, hkv, d)
    for i in range(prompt, t):
        qi = q[i].reshape(hkv, g, d) / math.sqrt(d)  # [Hkv, G, D]
        for keys, vals, which in ((k, v, "ref"), (kq, vq, "hat")):
            s = np.einsum("kgd,tkd->kgt", qi, keys[: i + 1])
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            o = np.einsum("kgt,tkd->kgd", p, vals[: i + 1])
            mass = p[..., lo:hi].reshape(hkv, g, n_win, WINDOW).sum(-1).reshape(h, n_win)
            if which == "ref":
                o_ref, m_ref = o, mass
        sums.o_err += float(((o - o_ref) ** 2).sum())
        sums.o_ref += float((o_ref**2).sum())
        cos = (mass * m_ref).sum(-1) / np.sqrt((mass**2).sum(-1) * (m_ref**2).sum(-1))
        sums.cos.extend(cos.tolist())
        sums.rho.extend(spearman(mass, m_ref).tolist())


def window_bytes(model_cfg, fmt: Format, dtype: Any) -> tuple[float, float, float]:
    """(ledger slot bytes of one window with ``fmt``, F slot bytes, today's ledger slot bytes), all layers."""
    ring = ring_capacity(64, WINDOW, 8)

    def caps(nf: int, nl: int) -> Capacities:
        return Capacities(
            sink=SINK,
            window=WINDOW,
            recent=64,
            ring=ring,
            nf=nf,
            nq=nl,
            nl=nl,
            nw_max=1024,
            bits=2,
            omega=8,
        )

    def nbytes(c: Capacities) -> int:
        return sum(
            math.prod(x.shape) * x.dtype.itemsize
            for x in jax.tree.leaves(abstract_cache(c, model_cfg, 1, dtype))
        )

    fixed = nbytes(caps(0, 0))
    per_f = nbytes(caps(1, 0)) - fixed
    per_l = nbytes(caps(0, 1)) - fixed
    today = parse_format("today")
    heads = model_cfg.num_layers * model_cfg.num_kv_heads
    d = model_cfg.head_dim
    slot = per_l - heads * today.data_bytes(d) + heads * fmt.data_bytes(d)
    return slot, per_f, per_l


DEFAULT_FORMATS = (
    "today,kch2-v2-bf16,kch2-v2-fp8,tok-k2v2,rot-k2v2,rot-k2v2-lloyd,rot-k2v2-bf16,rot-k2v2-fp8,rot-k3v3,"
    "rot-k3v3-lloyd,rot-k3v3-fp8,rot-k4v2,rot-k4v2-lloyd,rot-k2v4,rot-k4v4,rot-k4v4-lloyd,kch2-rotv2,"
    "kch2-rotv2-lloyd,kch2-rotv3-lloyd,kch2-rotv4,kch2-rotv4-lloyd,kch2-rotv2-lloyd-fp8,kch2-rotv3-lloyd-fp8,"
    "kch2-v2-q8,kch2-rotv2-lloyd-q8,kch2-rotv3-lloyd-q8,kch2-rotv4-lloyd-q8,kch3-rotv3-lloyd-q8,kch4-rotv2-lloyd-q8"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens (prose)")
    ap.add_argument("--queries", type=int, default=32, help="decode queries (greedy tokens after the prompt)")
    ap.add_argument("--recent", type=int, default=64, help="prompt tokens before the queries kept exact")
    ap.add_argument("--layer-stride", type=int, default=3, help="study every n-th layer")
    ap.add_argument("--formats", default=DEFAULT_FORMATS)
    args = ap.parse_args()

    path = resolve_model(args.model)
    cfg, model = load_model(path)
    tok = Tokenizer.from_dir(path)
    ids: list[int] = []
    for para in prose_paragraphs():
        ids += tok.encode(para + "\n\n", add_bos=False)
        if len(ids) >= args.context:
            break
    ids = ids[: args.context]
    t0 = time.perf_counter()
    res = generate(model, [ids], SamplerConfig(max_new_tokens=args.queries), FullKV())
    seq = ids + res.tokens[0][: args.queries]
    rec = record_qkv(model, seq)
    kv16 = lambda a: np.asarray(jnp.asarray(a).astype(DEFAULT_KV_DTYPE).astype(jnp.float32), np.float64)
    print(
        f"# {args.model}: {len(ids)}-token prose prompt, {len(seq) - len(ids)} decode queries, layers "
        f"0..{cfg.num_layers - 1} step {args.layer_stride}, windows of {WINDOW} between {SINK} sinks and the "
        f"last {args.recent} prompt tokens ({time.perf_counter() - t0:.0f} s to record)"
    )
    inv_freq = np.asarray(cfg.inv_freq(), np.float64)
    rot = hadamard(cfg.head_dim)
    formats = [parse_format(n.strip()) for n in args.formats.split(",") if n.strip()]
    print(
        "| format | bytes / window (all layers) | share of an F window | key rel. err | value rel. err | "
        "attn-output rel. err | window-mass cosine | window-mass Spearman |"
    )
    print("|---|---|---|---|---|---|---|---|")
    layers = range(0, cfg.num_layers, args.layer_stride)
    for fmt in formats:
        sums = Sums()
        for layer in layers:
            q = np.asarray(rec.q[layer, 0], np.float64)
            layer_metrics(
                fmt,
                q,
                kv16(rec.k[layer, 0]),
                kv16(rec.v[layer, 0]),
                len(ids),
                args.recent,
                inv_freq,
                rot,
                sums,
            )
        slot, per_f, _ = window_bytes(cfg, fmt, DEFAULT_KV_DTYPE)
        print(
            f"| {fmt.name} | {slot:.0f} | {slot / per_f:.1%} | {math.sqrt(sums.k_err / sums.k_ref):.3f} | "
            f"{math.sqrt(sums.v_err / sums.v_ref):.3f} | {math.sqrt(sums.o_err / sums.o_ref):.3f} | "
            f"{np.mean(sums.cos):.4f} | {np.nanmean(sums.rho):.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
