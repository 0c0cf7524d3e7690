"""Window ranking functions behind one interface (DESIGN §5-§6; QEvict Appendix J).

A window's score is a running statistic of the head-mean attention mass it receives (or, for "keynorm", a
static function of its keys); higher = more important. Every ranking provides:

- ``update(score, mass)``: one decode step, ``mass`` = head-mean attention mass of each window this step;
- ``prefill_window_scores(...)``: the score of every prompt window after the prompt pass;
- ``candidate_score(ring_score, k_window)``: the score of a window when it leaves the recent region.

Rankings: "cumulative" (sum of mass, H2O), "decayed" (score <- decay * score + mass), "pnorm" (sum of
mass^p; rank-equivalent to the p-norm of the window's mass over queries), "keynorm" (minus the mean key norm:
low key norm = important; independent of attention).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.attention import NEG_INF, attention_mask, grouped_scores


def window_sums(x: jax.Array, sink: int, window: int, num_windows: int) -> jax.Array:
    """Sum per-token values x [B, T] over windows: window w = positions [S + wW, S + (w+1)W) -> [B, NW]."""
    body = x[:, sink:]
    need = num_windows * window
    t = body.shape[1]
    body = jnp.pad(body, ((0, 0), (0, max(0, need - t))))[:, :need]
    return body.reshape(x.shape[0], num_windows, window).sum(-1)


def key_norm_score(k: jax.Array) -> jax.Array:
    """Minus the mean L2 norm of the keys of a window: k [..., Hkv, W, D] -> [...] f32."""
    norms = jnp.sqrt(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1))
    return -jnp.mean(norms, axis=(-1, -2))


def chunked_head_mean_probs_reduce(
    q: jax.Array,
    k: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    reduce_fn,
    init: jax.Array,
    sliding_window: int | None,
    chunk: int,
) -> jax.Array:
    """Fold ``reduce_fn(acc, probs [B, C, Tk], q_pos [B, C]) -> acc`` over query chunks of the head-mean
    attention probabilities of q [B, Tq, H, D] over k [B, Tk, Hkv, D] (padding queries have q_pos = -1)."""
    b, tq, h, d = q.shape
    n = -(-tq // chunk)
    pad = n * chunk - tq
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
    qc = q.reshape(b, n, chunk, h, d).swapaxes(0, 1)
    pc = q_pos.reshape(b, n, chunk).swapaxes(0, 1)

    def body(acc, xs):
        q_i, p_i = xs
        logits = grouped_scores(q_i, k)
        mask = attention_mask(p_i, k_pos, sliding_window)[:, None, None]
        probs = jnp.where(mask, jax.nn.softmax(jnp.where(mask, logits, NEG_INF), axis=-1), 0.0)
        return reduce_fn(acc, probs.mean(axis=(1, 2)), p_i), None

    acc, _ = jax.lax.scan(body, init, (qc, pc))
    return acc


@dataclasses.dataclass(frozen=True)
class Ranking:
    """A ranking function (static, hashable). kind: one of ``config.RANKINGS``."""

    kind: str = "cumulative"
    decay: float = 0.98
    p: float = 3.0

    @property
    def attention_based(self) -> bool:
        return self.kind != "keynorm"

    def update(self, score: jax.Array, mass: jax.Array) -> jax.Array:
        """One decode step: score [...] f32, mass [...] head-mean window mass -> new score."""
        if self.kind == "cumulative":
            return score + mass
        if self.kind == "decayed":
            return self.decay * score + mass
        if self.kind == "pnorm":
            return score + jnp.power(jnp.maximum(mass, 0.0), self.p)
        return score

    def candidate_score(self, ring_score: jax.Array, k_window: jax.Array) -> jax.Array:
        """Score of a window leaving the ring: ring_score [...], k_window [..., Hkv, W, D] -> [...]."""
        if self.kind == "keynorm":
            return key_norm_score(k_window)
        return ring_score

    def prefill_window_scores(
        self,
        q: jax.Array,
        k: jax.Array,
        positions: jax.Array,
        lengths: jax.Array,
        column_mass: jax.Array,
        sink: int,
        window: int,
        num_windows: int,
        sliding_window: int | None,
        chunk: int,
    ) -> jax.Array:
        """Scores [B, NW] of the prompt windows after the prompt pass.

        q [B, T, H, D], k [B, T, Hkv, D] (post-RoPE), positions [B, T], lengths [B] (right padding);
        column_mass [B, Hkv, G, T]: attention each key received from every valid query (cumulative case).
        """
        valid = positions < lengths[:, None]
        k_pos = jnp.where(valid, positions, -1)
        if self.kind == "cumulative":
            token = column_mass.mean(axis=(1, 2))
            return window_sums(token, sink, window, num_windows)
        if self.kind == "keynorm":
            kw = prompt_windows(k, sink, window, num_windows)  # [B, NW, W, Hkv, D]
            return key_norm_score(kw.swapaxes(2, 3))
        q_pos = jnp.where(valid, positions, -1)
        b = q.shape[0]
        if self.kind == "decayed":
            last = lengths[:, None] - 1

            def reduce_fn(acc, probs, p_i):
                w = jnp.where(p_i >= 0, jnp.power(self.decay, (last - p_i).astype(jnp.float32)), 0.0)
                return acc + jnp.einsum("bts,bt->bs", probs, w)

            token = chunked_head_mean_probs_reduce(
                q, k, q_pos, k_pos, reduce_fn, jnp.zeros(k_pos.shape, jnp.float32), sliding_window, chunk
            )
            return window_sums(token, sink, window, num_windows)

        def reduce_fn(acc, probs, p_i):
            wm = jax.vmap(lambda x: window_sums(x, sink, window, num_windows))(probs)  # [B, C, NW]
            return acc + jnp.sum(jnp.where((p_i >= 0)[..., None], jnp.power(wm, self.p), 0.0), axis=1)

        init = jnp.zeros((b, num_windows), jnp.float32)
        return chunked_head_mean_probs_reduce(q, k, q_pos, k_pos, reduce_fn, init, sliding_window, chunk)


def prompt_windows(x: jax.Array, sink: int, window: int, num_windows: int) -> jax.Array:
    """Windows of a prompt tensor x [B, T, Hkv, D] -> [B, NW, W, Hkv, D] (zero-padded past T)."""
    body = x[:, sink:]
    need = num_windows * window
    t = body.shape[1]
    body = jnp.pad(body, ((0, 0), (0, max(0, need - t)), (0, 0), (0, 0)))[:, :need]
    return body.reshape(x.shape[0], num_windows, window, *x.shape[2:])
