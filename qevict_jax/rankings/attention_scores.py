"""The published prompt-time attention scores the rankings are built from (``qevict_jax.rankings.scoring``).

The observation window's attention (the last ``n_obs`` prompt queries: ``observation_attention``, head-mean rows
``observation_mass``), SnapKV's pooled scores, ReST-KV's output-change scores and CriticalKV's value-aware
two-stage selection, each a pure function of the prompt's q/k/v with the shapes in its docstring, checked
against float64 references of the papers' rules in ``tests/test_baselines.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from models.attention import NEG_INF, attention_mask, over_blocks


def observation_mass(
    q: jax.Array, k: jax.Array, end: jax.Array, n_obs: int, sliding_window: int | None, pool: int = 0
) -> jax.Array:
    """Head-mean attention rows of the observation window: the last ``n_obs`` queries before ``end`` [B].

    q [B, T, H, D], k [B, T, Hkv, D] post-RoPE at positions 0..T-1. Returns [B, n_obs, T] f32: row i is the
    attention of the query at position ``end - n_obs + i`` averaged over all query heads (zero for rows
    before position 0 and for keys at or after ``end``). ``pool`` > 1: each row is max-pooled over
    ``pool`` neighbouring keys (centred, as SnapKV's ``max_pool1d``), then masked to keys before ``end``.
    """
    n_obs = min(n_obs, q.shape[1])
    rows = observation_attention(q, k, end, n_obs, sliding_window, lambda p: p.mean(axis=(1, 2)))  # [B, n, T]
    if pool > 1:
        pooled = jax.lax.reduce_window(
            rows,
            -jnp.inf,
            jax.lax.max,
            (1, 1, pool),
            (1, 1, 1),
            ((0, 0), (0, 0), (pool // 2, (pool - 1) // 2)),
        )
        keys = jnp.arange(rows.shape[-1])[None, None]
        rows = jnp.where(keys < end[:, None, None], pooled, 0.0)
    return rows


# ------------------------------------------------------------------------ token scores of prompt-based methods


OBS_KEY_BLOCK = 512
"""Keys per block of the observation-window attention (``observation_attention``)."""


def observation_attention(
    q: jax.Array,
    k: jax.Array,
    end: jax.Array,
    n_obs: int,
    sliding_window: int | None,
    reduce: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """Attention rows of the ``n_obs`` queries just before ``end`` [B] (the observation window).

    q [B, T, H, D], k [B, T, Hkv, D] post-RoPE at positions 0..T-1; keys at positions >= end are masked.
    The probabilities probs [B, Hkv, G, n_obs, T] f32 (row i = query at position end - n_obs + i, causal;
    rows before position 0 are zero) are computed over blocks of ``OBS_KEY_BLOCK`` keys: a first pass takes
    each row's running max and sum (online softmax), a second normalizes each block and hands it to
    ``reduce`` (probs of C keys -> [..., C], default the identity), so the temporaries are a few blocks and
    the result is ``reduce``'s output for every key, [..., T].
    """
    b, t, h, d = q.shape
    n_obs = min(n_obs, t)  # a window longer than the prompt is the whole prompt: no work past its size
    hkv = k.shape[2]
    g = h // hkv
    idx = end[:, None] - n_obs + jnp.arange(n_obs, dtype=jnp.int32)  # [B, n_obs]
    q_pos = jnp.where(idx >= 0, idx, -1)
    qo = jnp.take_along_axis(q, jnp.clip(idx, 0, t - 1)[:, :, None, None], axis=1)  # [B, n, H, D]
    qo = qo.reshape(b, n_obs, hkv, g, d).astype(jnp.float32) * d**-0.5
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    k_pos = jnp.where(pos < end[:, None], pos, -1)  # [B, T]
    reduce = reduce or (lambda p: p)

    def logits(start, size):  # -> (logits [B, Hkv, G, n, C] masked to NEG_INF, mask)
        kb = jax.lax.dynamic_slice_in_dim(k, start, size, 1).astype(jnp.float32)
        mask = attention_mask(q_pos, jax.lax.dynamic_slice_in_dim(k_pos, start, size, 1), sliding_window)
        mask = mask[:, None, None]
        return jnp.where(mask, jnp.einsum("bnkgd,bskd->bkgns", qo, kb), NEG_INF), mask

    def stats(carry, start, size):
        m, total = carry
        s, mask = logits(start, size)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        return m_new, total * jnp.exp(m - m_new) + p.sum(-1)

    rows = (b, hkv, g, n_obs)
    m, total = over_blocks(
        stats, (jnp.full(rows, NEG_INF, jnp.float32), jnp.zeros(rows, jnp.float32)), t, OBS_KEY_BLOCK
    )
    total = jnp.where(total > 0, total, 1.0)

    def probs(start, size):
        s, mask = logits(start, size)
        return jnp.where(mask, jnp.exp(s - m[..., None]) / total[..., None], 0.0)

    def write(out, start, size):
        return jax.lax.dynamic_update_slice_in_dim(out, reduce(probs(start, size)), start, out.ndim - 1)

    # the result buffer starts as the first block's result, padded: a zero-filled buffer depends on nothing,
    # and XLA's scheduler allocated it early, alive across the prompt attention (measured); the loop then
    # writes every block (the first again, with the same values)
    first = reduce(probs(0, min(t, OBS_KEY_BLOCK)))
    out = jnp.pad(first, [(0, 0)] * (first.ndim - 1) + [(0, t - first.shape[-1])])
    return over_blocks(write, out, t, OBS_KEY_BLOCK)


def avg_pool(x: jax.Array, n: jax.Array, kernel: jax.Array, left: jax.Array, replicate: bool) -> jax.Array:
    """Stride-1 average pooling of x [..., T] whose valid part is ``[0, n)`` (n [...] int).

    Output t averages the ``kernel`` entries ``t - left .. t - left + kernel - 1`` (kernel, left [...]
    int, may differ per row), reading zeros (``replicate=False``: ``F.avg_pool1d`` with zero padding,
    ``count_include_pad``) or the edge values (``replicate=True``: ``F.pad(mode="replicate")``) outside.
    """
    t = jnp.arange(x.shape[-1])
    n, kernel, left = (jnp.asarray(a)[..., None] for a in (n, kernel, left))
    xv = jnp.where(t < n, x.astype(jnp.float32), 0.0)
    csum = jnp.concatenate([jnp.zeros((*x.shape[:-1], 1), jnp.float32), jnp.cumsum(xv, axis=-1)], axis=-1)
    a = t - left
    lo = jnp.clip(a, 0, n)
    hi = jnp.clip(a + kernel, 0, n)
    total = jnp.take_along_axis(csum, hi, axis=-1) - jnp.take_along_axis(csum, lo, axis=-1)
    total = jnp.where(hi > lo, total, 0.0)
    if replicate:
        first = xv[..., :1]
        last = jnp.take_along_axis(xv, jnp.clip(n - 1, 0, x.shape[-1] - 1), axis=-1)
        total += jnp.clip(-a, 0, kernel) * first + jnp.clip(a + kernel - n, 0, kernel) * last
    return total / kernel


def snapkv_scores(
    q: jax.Array, k: jax.Array, end: jax.Array, n_obs: int, kernel: int, sliding_window: int | None
) -> jax.Array:
    """SnapKV (arXiv 2404.14469; kvpress ``SnapKVPress``): token scores [B, Hkv, T] f32.

    Mean over the observation window (the last ``n_obs`` queries before ``end`` [B]) of each query head's
    attention to the prefix keys (positions < end - n_obs), average pooling (kernel ``kernel``, zero padded),
    then the mean over the query heads of each KV group (GQA).
    """
    n_obs = min(n_obs, q.shape[1])
    rows = observation_attention(q, k, end, n_obs, sliding_window, lambda p: p.mean(axis=3))  # [B, Hkv, G, T]
    prefix = jnp.broadcast_to((end - n_obs)[:, None, None], rows.shape[:3])
    pooled = avg_pool(rows, prefix, kernel, kernel // 2, replicate=False)
    return pooled.mean(axis=2)


def ema_weights(n: int, alpha: float) -> jax.Array:
    """Weights [n] of an EMA over n rows initialized with the first row: ``e_0 = x_0``,
    ``e_i = alpha x_i + (1 - alpha) e_{i-1}``; the result is ``sum_i w_i x_i``."""
    i = jnp.arange(n, dtype=jnp.float32)
    w = alpha * jnp.power(1.0 - alpha, n - 1 - i)
    return w.at[0].set((1.0 - alpha) ** (n - 1))


def restkv_scores(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    end: jax.Array,
    wo: jax.Array,
    *,
    n_obs: int,
    alpha: float,
    sliding_window: int | None,
    capacity: int | None,
    min_kernel: int = 5,
    scale: float = 200.0,
) -> jax.Array:
    """ReST-KV (arXiv 2605.08840, reference code ``restkv_utils.RestKVCluster``, "after" metric with EMA and
    W_O): token scores [B, Hkv, T] f32.

    Per query head h: ``a = EMA_alpha`` over the observation rows of the attention to the prefix keys
    (positions < end - n_obs); ``o = sum_j a_j v_j`` over the prefix; ``score_j = a_j / (1 - a_j) *
    ||W_O,h (o - v_j)||_2`` (the output change when j is removed and the softmax renormalizes), with
    ``W_O,h = wo[h D:(h+1) D]`` [D, Dm]. Spatial smoothing: ``capacity=None`` -> average pooling with kernel
    ``min_kernel`` (zero padded); else the adaptive window: per head, ``t`` = mean position shift of the top
    ``capacity`` keys between the first and second half of the observation rows, kernel
    ``max(min_kernel, 2 floor(|t| / scale) + 1)``, shift ``floor(t / scale)`` (t > 0) or
    ``floor(t / scale) + 1``, asymmetric replicate padding. Finally the mean over each KV group (GQA).
    """
    b, t, hkv, d = k.shape
    n_obs = min(n_obs, t)
    probs = observation_attention(q, k, end, n_obs, sliding_window)  # [B, Hkv, G, n, T]
    g = probs.shape[2]
    prefix = end - n_obs
    in_prefix = (jnp.arange(t)[None] < prefix[:, None])[:, None, None, :]
    abar = jnp.einsum("bkgnt,n->bkgt", probs, ema_weights(n_obs, alpha))
    abar = jnp.where(in_prefix, abar, 0.0)
    obar = jnp.einsum("bkgt,btkd->bkgd", abar, v.astype(jnp.float32))
    w = wo.astype(jnp.float32).reshape(hkv, g, d, -1)
    gram = jnp.einsum("kgdm,kgem->kgde", w, w)  # ||x W||^2 = x^T (W W^T) x
    diff = obar[:, :, :, None, :] - v.astype(jnp.float32).transpose(0, 2, 1, 3)[:, :, None]  # [B,Hkv,G,T,D]
    sq = jnp.einsum("bkgtd,kgde,bkgte->bkgt", diff, gram, diff)
    score = abar / (1.0 - abar) * jnp.sqrt(jnp.maximum(sq, 0.0))
    score = jnp.where(in_prefix, score, 0.0)
    n_pre = jnp.broadcast_to(prefix[:, None, None], score.shape[:3])
    if capacity is None:
        pooled = avg_pool(score, n_pre, min_kernel, min_kernel // 2, replicate=False)
    else:
        kk = max(1, min(capacity, t))
        half = n_obs // 2
        order = jnp.argsort(probs, axis=-1)[..., t - kk :]  # [B, Hkv, G, n, kk] top keys, ascending
        shift_t = (
            (order[..., :half, :] - order[..., half : 2 * half, :]).astype(jnp.float32).mean(axis=(-1, -2))
        )
        kernel = jnp.maximum(min_kernel, 2 * jnp.floor(jnp.abs(shift_t) / scale) + 1).astype(jnp.int32)
        shift = jnp.where(shift_t > 0, jnp.floor(shift_t / scale), jnp.floor(shift_t / scale) + 1).astype(
            jnp.int32
        )
        pooled = avg_pool(score, n_pre, kernel, kernel // 2 - shift, replicate=True)
    return pooled.mean(axis=2)


def projected_value_l1(v: jax.Array, wo: jax.Array) -> jax.Array:
    """CriticalKV's value weight: ``||v_j W_O,h||_1`` per query head, mean over each KV group.

    v [B, T, Hkv, D], wo [H*D, Dm] -> [B, Hkv, T] f32 (kvpress ``CriticalKVPress.vwl1norm``).
    """
    b, t, hkv, d = v.shape
    w = wo.astype(jnp.float32).reshape(hkv, -1, d, wo.shape[-1])
    proj = jnp.einsum("btkd,kgdm->bkgtm", v.astype(jnp.float32), w)
    return jnp.abs(proj).sum(-1).mean(axis=2)


def criticalkv_scores(
    base: jax.Array,
    v: jax.Array,
    wo: jax.Array,
    eligible: jax.Array,
    capacity: int,
    *,
    first_stage_ratio: float = 0.5,
    epsilon: float = 1e-4,
) -> jax.Array:
    """CriticalKV two-stage selection (arXiv 2502.03805; kvpress ``CriticalKVPress``) as scores [B, Hkv, T].

    Stage 1: each head's top ``int(capacity * first_stage_ratio)`` eligible tokens by the base (attention)
    score are kept outright (score = float max). Stage 2: the rest are ranked by
    ``(base + epsilon) * ||W_O v||_1`` (output-perturbation bound of the value-aware reweighting).
    """
    s2 = (base + epsilon) * projected_value_l1(v, wo)
    n1 = int(capacity * first_stage_ratio)
    if n1 == 0:
        return s2
    hit = head_top_mask(jnp.where(eligible[:, None, :], base, -jnp.inf), n1)
    return jnp.where(hit, jnp.finfo(jnp.float32).max, s2)


def head_top_mask(scores: jax.Array, n: int) -> jax.Array:
    """[B, Hkv, T] bool: each head's ``n`` highest of scores [B, Hkv, T] (finite ones only; ties: lower index)."""
    vals, top = jax.lax.top_k(scores, min(n, scores.shape[-1]))
    b, hkv = scores.shape[:2]
    rows, heads = jnp.arange(b)[:, None, None], jnp.arange(hkv)[None, :, None]
    return jnp.zeros(scores.shape, bool).at[rows, heads, top].set(vals > -jnp.inf)
