"""Attention math shared by the decoder and every KV-cache method.

Layout convention: model activations are ``[B, T, H, D]``; caches store ``[B, Hkv, T, D]``.
Key positions of ``-1`` mark invalid (empty) key slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so a fully masked row stays NaN-free


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x`` [..., T, H, D] at ``positions`` [..., T] (rotate-half convention, as in Hugging Face).

    Rotating at ``-positions`` undoes a rotation at ``positions``.
    """
    cos, sin = rope_cos_sin(positions, inv_freq)
    return rotate_half(x, cos[..., None, :], sin[..., None, :]).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [..., D/2] f32 of the RoPE angles ``positions`` [...] x ``inv_freq`` [D/2]."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., D] rotated by angles whose cos, sin [..., D/2] broadcast against x's halves; f32."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """Boolean mask [B, Tq, Tk]: causal, valid keys (pos >= 0), optional sliding window."""
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    allowed = (kp <= qp) & (kp >= 0)
    if sliding_window is not None:
        allowed &= qp - kp < sliding_window
    return allowed


def grouped_scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled logits [B, Hkv, G, Tq, Tk] from q [B, Tq, H, D] and k [B, Tk, Hkv, D] (GQA)."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, tq, hkv, h // hkv, d).astype(jnp.float32)
    scale = d**-0.5
    return jnp.einsum("btkgd,bskd->bkgts", qg * scale, k.astype(jnp.float32))


def grouped_output(probs: jax.Array, v: jax.Array, out_dtype) -> jax.Array:
    """Output [B, Tq, H, D] from probs [B, Hkv, G, Tq, Tk] and v [B, Tk, Hkv, D]."""
    b, hkv, g, tq, _ = probs.shape
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, tq, hkv * g, v.shape[-1]).astype(out_dtype)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    sliding_window: int | None = None,
    logit_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q [B, Tq, H, D] over k, v [B, Tk, Hkv, D].

    logit_bias: added to the scaled logits before masking, broadcast against [B, Hkv, G, Tq, Tk] (the
    retention gates' ``(t - i) log beta_i`` is [B, Hkv, 1, Tq, Tk]), or None.
    Returns (out [B, Tq, H, D], probs [B, Hkv, G, Tq, Tk] in float32).
    """
    logits = grouped_scores(q, k)
    if logit_bias is not None:
        logits = logits + logit_bias
    mask = attention_mask(q_pos, k_pos, sliding_window)[:, None, None]
    logits = jnp.where(mask, logits, NEG_INF)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0)
    return grouped_output(probs, v, q.dtype), probs


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    sliding_window: int | None = None,
    chunk: int = 512,
    q_valid: jax.Array | None = None,
    causal_blocks: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of q [B, Tq, H, D] over k, v [B, Tk, Hkv, D], one query chunk at a time.

    Memory is O(chunk * Tk) per head instead of O(Tq * Tk). Also returns the exact column sums of the
    attention probabilities, ``mass [B, Hkv, G, Tk]`` (float32): the attention each key received from
    every valid query (``q_valid`` [B, Tq], default all), which cumulative scoring methods need.

    causal_blocks (default: Tq == Tk): queries and keys are the same tokens with non-decreasing positions,
    so query chunk i only needs keys [0, end of chunk i): the key blocks after it are skipped (half the work
    of a causal prefill). Masking by positions still applies inside the kept blocks.
    """
    b, tq, h, d = q.shape
    tk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    if q_valid is None:
        q_valid = jnp.ones((b, tq), bool)
    if causal_blocks is None:
        causal_blocks = tq == tk
    if not causal_blocks:
        return _scan_chunked_attention(q, k, v, q_pos, k_pos, sliding_window, chunk, q_valid)
    # [B, Hkv, T, D] keys/values and [B, Hkv, G, T, D] queries: each block is one batched matmul over Hkv
    kt = k.transpose(0, 2, 1, 3).astype(jnp.float32)
    vt = v.transpose(0, 2, 1, 3).astype(jnp.float32)
    qt = (q.reshape(b, tq, hkv, g, d).transpose(0, 2, 3, 1, 4) * d**-0.5).astype(jnp.float32)
    weight = q_valid.astype(jnp.float32)
    mass = jnp.zeros((b, hkv, g, tk), jnp.float32)
    outs = []
    for start in range(0, tq, chunk):
        end = min(start + chunk, tq)
        c = end - start
        qi = qt[:, :, :, start:end].reshape(b, hkv, g * c, d)
        s = jnp.einsum("bkmd,bksd->bkms", qi, kt[:, :, :end]).reshape(b, hkv, g, c, end)
        mask = attention_mask(q_pos[:, start:end], k_pos[:, :end], sliding_window)[:, None, None]
        s = jnp.where(mask, s, NEG_INF)
        p = jnp.exp(s - s.max(-1, keepdims=True))
        p = jnp.where(mask, p / p.sum(-1, keepdims=True), 0.0)
        o = jnp.einsum("bkms,bksd->bkmd", p.reshape(b, hkv, g * c, end), vt[:, :, :end])
        outs.append(o.reshape(b, hkv, g, c, d))
        mass = mass.at[..., :end].add(jnp.einsum("bkgts,bt->bkgs", p, weight[:, start:end]))
    out = jnp.concatenate(outs, axis=3).transpose(0, 3, 1, 2, 4).reshape(b, tq, h, d)
    return out.astype(q.dtype), mass


def prompt_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    lengths: jax.Array,
    sliding_window: int | None = None,
    chunk: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of a right-padded prompt: q [B, T, H, D], k, v [B, T, Hkv, D] at positions [B, T],
    row b valid below lengths[b]. Returns (out [B, T, H, D], column mass [B, Hkv, G, T] of valid queries)."""
    valid = positions < lengths[:, None]
    k_pos = jnp.where(valid, positions, -1)
    return chunked_attention(q, k, v, positions, k_pos, sliding_window, chunk, q_valid=valid)


def _scan_chunked_attention(q, k, v, q_pos, k_pos, sliding_window, chunk, q_valid):
    """General chunked attention (any query/key positions): a ``lax.scan`` over query chunks."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    if tq <= chunk:
        out, probs = dense_attention(q, k, v, q_pos, k_pos, sliding_window)
        mass = jnp.einsum("bkgts,bt->bkgs", probs, q_valid.astype(jnp.float32))
        return out, mass
    n = -(-tq // chunk)
    pad = n * chunk - tq
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
        q_valid = jnp.pad(q_valid, ((0, 0), (0, pad)))
    qc = q.reshape(b, n, chunk, h, d).swapaxes(0, 1)  # [n, B, C, H, D]
    pc = q_pos.reshape(b, n, chunk).swapaxes(0, 1)
    vc = q_valid.reshape(b, n, chunk).swapaxes(0, 1)

    def body(mass, xs):
        q_i, p_i, valid_i = xs
        out_i, probs_i = dense_attention(q_i, k, v, p_i, k_pos, sliding_window)
        mass = mass + jnp.einsum("bkgts,bt->bkgs", probs_i, valid_i.astype(jnp.float32))
        return mass, out_i

    mass0 = jnp.zeros((b, hkv, g, k.shape[1]), jnp.float32)
    mass, outs = jax.lax.scan(body, mass0, (qc, pc, vc))
    out = outs.swapaxes(0, 1).reshape(b, n * chunk, h, d)[:, :tq]
    return out, mass
