"""Attention math shared by the decoder and every KV-cache method.

Layout convention: model activations are ``[B, T, H, D]``; caches store ``[B, Hkv, T, D]``.
Key positions of ``-1`` mark invalid (empty) key slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    *,
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
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    sliding_window: int | None = None,
    chunk: int = 512,
    q_valid: jax.Array | None = None,
    causal_blocks: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of q [B, Tq, H, D] over k, v [B, Tk, Hkv, D], one query chunk at a time.

    Also returns the exact column sums of the attention probabilities, ``mass [B, Hkv, G, Tk]`` (float32):
    the attention each key received from every valid query (``q_valid`` [B, Tq], default all), which
    cumulative scoring methods need. The mass is a pass of its own: a caller that drops it does not run it
    (XLA removes the unused loop).

    causal_blocks (default: Tq == Tk): queries and keys are the same tokens with non-decreasing positions,
    so query chunk i only needs keys [0, end of chunk i). Then the attention runs flash style over blocks of
    ``chunk`` queries x ``chunk`` keys with an online softmax (``flash_causal_attention``): the key blocks
    after each query chunk are skipped (half the work of a causal prefill) and the working memory is a few
    [B, H, chunk, chunk] blocks whatever the prompt length. The mass re-visits the same blocks with each
    query's final log-sum-exp (``causal_column_mass``). Masking by positions applies inside every block.
    Otherwise (any positions): a ``lax.scan`` over query chunks against all keys, O(chunk * Tk) per head.
    """
    b, tq = q.shape[:2]
    if q_valid is None:
        q_valid = jnp.ones((b, tq), bool)
    if causal_blocks is None:
        causal_blocks = tq == k.shape[1]
    if not causal_blocks:
        return _scan_chunked_attention(
            q, k, v, q_pos, k_pos, q_valid, sliding_window=sliding_window, chunk=chunk
        )
    blocks = dict(q_pos=q_pos, k_pos=k_pos, sliding_window=sliding_window, chunk=chunk)
    out, lse = flash_causal_attention(q, k, v, **blocks)
    mass = causal_column_mass(q, k, lse=lse, q_valid=q_valid, **blocks)
    return out, mass


def over_blocks(fn: Callable[..., Any], carry: Any, t: int, size: int, count: Any = None) -> Any:
    """``carry = fn(carry, start, length)`` over consecutive blocks [start, start + length) of ``t`` positions.

    The ``t // size`` full blocks run in a ``lax.fori_loop`` (``start`` traced), then the static tail block
    of ``t % size``. count: run only the first ``count`` full blocks (may be traced) and no tail.
    """
    n, tail = divmod(t, size)
    if n:  # (a loop body is traced at the block size even when it runs zero times)
        carry = jax.lax.fori_loop(0, n if count is None else count, lambda j, c: fn(c, j * size, size), carry)
    if tail and count is None:
        carry = fn(carry, n * size, tail)
    return carry


def _causal_blocks(query_chunk: Callable[..., Any], carry: Any, t: int, chunk: int, offset: int = 0) -> Any:
    """Visit every causal (query chunk, key block) pair of t queries, the last t of ``offset + t`` keys, once,
    in order of query chunks (``offset``: a multiple of ``chunk``; 0 when queries and keys are one sequence).

    ``carry = query_chunk(carry, qs, qlen, key_blocks)`` runs for each query chunk [qs, qs + qlen)
    (``over_blocks``: the full chunks in a loop, then the tail). ``key_blocks(block, c)`` runs
    ``c = block(c, ks, klen)`` over the key blocks [ks, ks + klen) up to and including the chunk's own.
    """
    if offset % chunk:
        raise ValueError(f"the keys before the queries ({offset}) must be a multiple of the chunk ({chunk})")
    n = t // chunk

    def one(carry, qs, qlen):
        if qlen == chunk:  # full chunk i = qs / chunk: key blocks 0..offset / chunk + i
            count = (offset + qs) // chunk + 1
            key_blocks = lambda block, c: over_blocks(block, c, offset + t, chunk, count=count)
        else:  # the tail chunk: every full key block, then its own (the tail)
            key_blocks = lambda block, c: over_blocks(block, c, offset + n * chunk + qlen, chunk)
        return query_chunk(carry, qs, qlen, key_blocks)

    return over_blocks(one, carry, t, chunk)


def _query_block(q: jax.Array, qs: Any, qlen: int, hkv: int) -> jax.Array:
    """Queries [qs, qs + qlen) of q [B, T, H, D] as [B, Hkv, G*qlen, D] f32 scaled by D^-1/2 (head h = kv*G + g;
    row m = g*qlen + query)."""
    b, _, h, d = q.shape
    qi = jax.lax.dynamic_slice_in_dim(q, qs, qlen, 1).reshape(b, qlen, hkv, h // hkv, d)
    return (qi.transpose(0, 2, 3, 1, 4) * d**-0.5).astype(jnp.float32).reshape(b, hkv, -1, d)


def _key_block(k: jax.Array, ks: Any, klen: int) -> jax.Array:
    """Keys (or values) [ks, ks + klen) of k [B, T, Hkv, D] as [B, Hkv, klen, D] f32."""
    return jax.lax.dynamic_slice_in_dim(k, ks, klen, 1).astype(jnp.float32).transpose(0, 2, 1, 3)


def _block_mask(q_pos, k_pos, qs, qlen, ks, klen, g: int, sliding_window: int | None) -> jax.Array:
    """[B, 1, G*qlen, klen] mask of a block: ``attention_mask`` of its positions, repeated over the G rows."""
    qp = jax.lax.dynamic_slice_in_dim(q_pos, qs, qlen, 1)
    kp = jax.lax.dynamic_slice_in_dim(k_pos, ks, klen, 1)
    mask = attention_mask(qp, kp, sliding_window)  # [B, qlen, klen]
    return jnp.tile(mask, (1, g, 1))[:, None]


def flash_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    sliding_window: int | None,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of q [B, T, H, D] over k, v [B, S + T, Hkv, D]: the queries are the last T of the
    keys' tokens (S a multiple of ``chunk``; 0: the same tokens). Positions q_pos [B, T], k_pos [B, S + T],
    non-decreasing; k_pos -1 = invalid key. Blocks of ``chunk`` queries x ``chunk`` keys with an online
    softmax (running max m, sum l, output accumulator; key blocks after the query chunk skipped).

    Returns (out [B, T, H, D] in q's dtype, log-sum-exp [B, Hkv, G, T] f32 of each query's logits; a query
    with no visible key has out 0 and lse 0). Working memory: a few [B, H, chunk, chunk] f32 blocks.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv

    def query_chunk(carry, qs, qlen, key_blocks):
        out, lse = carry
        qi = _query_block(q, qs, qlen, hkv)

        def block(c, ks, klen):
            m, total, acc = c
            mask = _block_mask(q_pos, k_pos, qs, qlen, ks, klen, g, sliding_window)
            s = jnp.where(mask, jnp.einsum("bkmd,bksd->bkms", qi, _key_block(k, ks, klen)), NEG_INF)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkms,bksd->bkmd", p, _key_block(v, ks, klen))
            return m_new, total * alpha + p.sum(-1), acc * alpha[..., None] + pv

        rows = g * qlen
        init = (
            jnp.full((b, hkv, rows), NEG_INF, jnp.float32),
            jnp.zeros((b, hkv, rows), jnp.float32),
            jnp.zeros((b, hkv, rows, d), jnp.float32),
        )
        m, total, acc = key_blocks(block, init)
        seen = total > 0
        o = acc / jnp.where(seen, total, 1.0)[..., None]
        o = o.reshape(b, hkv, g, qlen, d).transpose(0, 3, 1, 2, 4).reshape(b, qlen, h, d)
        lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), 0.0).reshape(b, hkv, g, qlen)
        out = jax.lax.dynamic_update_slice_in_dim(out, o.astype(out.dtype), qs, 1)
        return out, jax.lax.dynamic_update_slice_in_dim(lse, lse_i, qs, 3)

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros((b, hkv, g, t), jnp.float32))
    return _causal_blocks(query_chunk, init, t, chunk, offset=k.shape[1] - t)


def causal_column_mass(
    q: jax.Array,
    k: jax.Array,
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    lse: jax.Array,
    q_valid: jax.Array,
    sliding_window: int | None,
    chunk: int,
) -> jax.Array:
    """Column sums [B, Hkv, G, T] f32 of the causal attention probabilities of ``flash_causal_attention``
    (same blocks, same logits), each query weighted by q_valid [B, T]: the probabilities of a block are
    ``exp(logit - lse)`` with the final log-sum-exp lse [B, Hkv, G, T] of each query."""
    b, t, h, _ = q.shape
    hkv = k.shape[2]
    g = h // hkv
    weight = q_valid.astype(jnp.float32)

    def query_chunk(mass, qs, qlen, key_blocks):
        qi = _query_block(q, qs, qlen, hkv)
        lse_i = jax.lax.dynamic_slice_in_dim(lse, qs, qlen, 3).reshape(b, hkv, g * qlen)
        w_i = jnp.tile(jax.lax.dynamic_slice_in_dim(weight, qs, qlen, 1), (1, g)).reshape(b, g, qlen)

        def block(mass, ks, klen):
            mask = _block_mask(q_pos, k_pos, qs, qlen, ks, klen, g, sliding_window)
            s = jnp.einsum("bkmd,bksd->bkms", qi, _key_block(k, ks, klen))
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            add = jnp.einsum("bkgcs,bgc->bkgs", p.reshape(b, hkv, g, qlen, klen), w_i)
            now = jax.lax.dynamic_slice_in_dim(mass, ks, klen, 3)
            return jax.lax.dynamic_update_slice_in_dim(mass, now + add, ks, 3)

        return key_blocks(block, mass)

    return _causal_blocks(query_chunk, jnp.zeros((b, hkv, g, t), jnp.float32), t, chunk)


def column_max(
    q: jax.Array,
    k: jax.Array,
    *,
    q_pos: jax.Array,
    k_pos: jax.Array,
    lse: jax.Array,
    q_rows: jax.Array,
    sliding_window: int | None,
    chunk: int,
) -> jax.Array:
    """Column maxima [B, Hkv, S] f32 of attention probabilities: for each key of k [B, S, Hkv, D] (positions
    k_pos [B, S], -1 invalid), the largest probability any query of q [B, T, H, D] (positions q_pos [B, T])
    in ``q_rows`` [B, T] bool gives it, over the G query heads of its KV head (0: none). The probabilities
    are ``exp(logit - lse)`` with each query's log-sum-exp lse [B, Hkv, G, T] over all the keys it sees
    (``flash_causal_attention``'s), so k may be any subset of them. Every (query chunk, key block) pair is
    visited, masked by positions: meant for keys that precede the queries."""
    b, t, h, _ = q.shape
    hkv = k.shape[2]
    g = h // hkv

    def query_chunk(best, qs, qlen):
        qi = _query_block(q, qs, qlen, hkv)
        lse_i = jax.lax.dynamic_slice_in_dim(lse, qs, qlen, 3).reshape(b, hkv, g * qlen)
        rows = jnp.tile(jax.lax.dynamic_slice_in_dim(q_rows, qs, qlen, 1), (1, g))[:, None, :, None]

        def block(best, ks, klen):
            mask = _block_mask(q_pos, k_pos, qs, qlen, ks, klen, g, sliding_window) & rows
            s = jnp.einsum("bkmd,bksd->bkms", qi, _key_block(k, ks, klen))
            top = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0).max(axis=2)  # [B, Hkv, klen]
            now = jax.lax.dynamic_slice_in_dim(best, ks, klen, 2)
            return jax.lax.dynamic_update_slice_in_dim(best, jnp.maximum(now, top), ks, 2)

        return over_blocks(block, best, k.shape[1], chunk)

    return over_blocks(query_chunk, jnp.zeros((b, hkv, k.shape[1]), jnp.float32), t, chunk)


def prompt_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    positions: jax.Array,
    lengths: jax.Array,
    sliding_window: int | None = None,
    chunk: int = 512,
) -> tuple[jax.Array, jax.Array]:
    """Causal attention of a right-padded prompt: q [B, T, H, D], k, v [B, T, Hkv, D] at positions [B, T],
    row b valid below lengths[b]. Returns (out [B, T, H, D], column mass [B, Hkv, G, T] of valid queries)."""
    valid = positions < lengths[:, None]
    k_pos = jnp.where(valid, positions, -1)
    return chunked_attention(
        q, k, v, q_pos=positions, k_pos=k_pos, sliding_window=sliding_window, chunk=chunk, q_valid=valid
    )


def _scan_chunked_attention(q, k, v, q_pos, k_pos, q_valid, *, sliding_window: int | None, chunk: int):
    """General chunked attention (any query/key positions): a ``lax.scan`` over query chunks."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    if tq <= chunk:
        out, probs = dense_attention(q, k, v, q_pos=q_pos, k_pos=k_pos, sliding_window=sliding_window)
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
        out_i, probs_i = dense_attention(q_i, k, v, q_pos=p_i, k_pos=k_pos, sliding_window=sliding_window)
        mass = mass + jnp.einsum("bkgts,bt->bkgs", probs_i, valid_i.astype(jnp.float32))
        return mass, out_i

    mass0 = jnp.zeros((b, hkv, g, k.shape[1]), jnp.float32)
    mass, outs = jax.lax.scan(body, mass0, (qc, pc, vc))
    out = outs.swapaxes(0, 1).reshape(b, n * chunk, h, d)[:, :tq]
    return out, mass
