"""Per-window reductions of per-token values, and window ages (docs/design.md §6, §8): window w covers the positions
[S + wW, S + (w+1)W) after the S sinks. What the rankings' window scores and the routing's ranking key are
built from."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def window_sums(x: jax.Array, sink: int, window: int, num_windows: int) -> jax.Array:
    """Sum per-token values x [B, T] over windows: window w = positions [S + wW, S + (w+1)W) -> [B, NW]."""
    body = x[:, sink:]
    need = num_windows * window
    t = body.shape[1]
    body = jnp.pad(body, ((0, 0), (0, max(0, need - t))))[:, :need]
    return body.reshape(x.shape[0], num_windows, window).sum(-1)


def spilled_key(
    win: jax.Array, score: jax.Array, valid: jax.Array, spill: int, num_windows: int
) -> jax.Array:
    """Ranking key [N] of windows win [N] (ids < ``num_windows``) with scores score [N], valid [N] bool: each
    valid window's score raised to the highest score of the valid windows among the ``spill`` ids before it,
    ``key_w = max(s_w, s_{w-1}, ..., s_{w-spill})`` over the windows present (``spill`` = 0: the score).

    The observation window (and a question appended later) attends to where an answer *starts*: a key, the
    first digits of a value. What is read next lies in the windows after it, which the question barely
    attends to; ranking them with their start keeps an answer's continuation in the tier of its start.
    """
    if spill == 0:
        return score
    score = score.astype(jnp.float32)
    dump = num_windows  # invalid entries land in one extra slot and never spill
    dense = jnp.full((num_windows + 1,), -jnp.inf, jnp.float32).at[jnp.where(valid, win, dump)].max(score)
    dense = dense.at[dump].set(-jnp.inf)
    spread = dense
    for j in range(1, min(spill, num_windows) + 1):
        spread = jnp.maximum(spread, jnp.pad(dense, (j, 0), constant_values=-jnp.inf)[:-j])
    return jnp.where(valid, jnp.maximum(score, spread[jnp.clip(win, 0, dump)]), score)


def key_norms(k: jax.Array) -> jax.Array:
    """L2 norm of each key: k [..., D] -> [...] f32."""
    return jnp.sqrt(jnp.sum(jnp.square(k.astype(jnp.float32)), axis=-1))


def key_norm_score(k: jax.Array) -> jax.Array:
    """Minus the mean L2 norm of the keys of a window: k [..., Hkv, W, D] -> [...] f32."""
    return -jnp.mean(key_norms(k), axis=(-1, -2))


GATE_FLOOR = -1e9
"""log beta of a token past a row's length (padding): below every real one."""


def window_centers(win: jax.Array, sink: int, window: int) -> jax.Array:
    """Centre position [...] f32 of window ids win [...] (window w = positions [S + wW, S + (w+1)W))."""
    return sink + win.astype(jnp.float32) * window + (window - 1) / 2


def window_ages(win: jax.Array, length: jax.Array, sink: int, window: int) -> jax.Array:
    """Age ``max(t - centre, 1)`` [..., N] f32 of windows win [..., N] at time t = length [...]."""
    return jnp.maximum(length[..., None].astype(jnp.float32) - window_centers(win, sink, window), 1.0)


def window_max(x: jax.Array, sink: int, window: int, num_windows: int) -> jax.Array:
    """Max of per-token values x [B, T] over each window -> [B, NW] (``GATE_FLOOR`` where a window is past T)."""
    body = x[:, sink:]
    need = num_windows * window
    t = body.shape[1]
    body = jnp.pad(body, ((0, 0), (0, max(0, need - t))), constant_values=GATE_FLOOR)[:, :need]
    return body.reshape(x.shape[0], num_windows, window).max(-1)


def prompt_windows(x: jax.Array, sink: int, window: int, num_windows: int) -> jax.Array:
    """Windows of a prompt tensor x [B, T, Hkv, D] -> [B, NW, W, Hkv, D] (zero-padded past T)."""
    body = x[:, sink:]
    need = num_windows * window
    t = body.shape[1]
    body = jnp.pad(body, ((0, 0), (0, max(0, need - t)), (0, 0), (0, 0)))[:, :need]
    return body.reshape(x.shape[0], num_windows, window, *x.shape[2:])
