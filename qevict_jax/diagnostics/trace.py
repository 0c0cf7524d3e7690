"""The traces the diagnostics read: a Full-KV reference trace and a policy trace, both teacher-forced on the
same token sequences (prompt = the first P tokens, then G decode steps feeding the rest).

Full-KV reference (``reference_trace``): one causal forward over prompt + targets; per layer, the head-mean
attention rows of the last G queries (decode step g = the query at position P + g) and of the prompt's last
``n_obs`` queries (what the cache's default ranking starts from), i.e. ``attention_scores.observation_mass`` with
``end`` = the full length. Rows are per token ([rows, L, T]); ``window_mass`` sums them per window for each
policy's W. The keys the rows attend over are rounded to the cache's storage dtype, as a Full-KV decode
reads them.

Policy trace (``policy_trace``): the compressed method is prefilled on the prompt, then teacher-forced one
interval of Ω decode steps per jitted call; after each interval (which ends with the decode routing event),
``window_view`` reduces the cache to the tier and score of every window id ([L, B, NW] each), so the host
keeps a few small arrays per routing event and never the caches. The score of every window just before the
event routes is kept too: with the cumulative ranking the growth of a Q window's score over an interval is
exactly the mass the compressed decode credited it (RQ).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import chunked_attention
from models.model import LayerContext, Transformer
from qevict_jax.core.budget import BudgetedTiers
from qevict_jax.core.cache import TieredCache
from qevict_jax.core.config import num_windows
from qevict_jax.core.kv import DEFAULT_KV_DTYPE, KVMethod
from qevict_jax.diagnostics.metrics import LOCAL, E, F, Q
from qevict_jax.engines.window import fold_head_means
from qevict_jax.eval.fidelity import fidelity_sample
from qevict_jax.methods.qevict import WindowMethod
from qevict_jax.rankings.attention_scores import observation_mass
from qevict_jax.rankings.scoring import Ranking
from qevict_jax.runtime.compiled import EXECUTABLES
from qevict_jax.runtime.prefill import method_weights, prefill_logits

# ---------------------------------------------------------------------------------------------- reference


@dataclasses.dataclass(frozen=True)
class ReferenceTrace:
    """Full-KV attention rows of a batch of sequences (numpy, float32).

    prompt_rows: [B, L, T] the summed head-mean rows of the prompt's last ``n_obs`` queries.
    prompt_all: [B, L, T] the summed head-mean rows of every prompt query (the "cumulative-all" start; from
        the forward's own prompt attention, keys not rounded to the storage dtype, as the cache's prefill).
    rows: [B, G, L, T] head-mean row of decode step g's query (position P + g) per layer; T = P + G keys.
    """

    prompt_rows: np.ndarray
    prompt_all: np.ndarray
    rows: np.ndarray


def _reference(graphdef, state, tokens, num_steps: int, n_obs: int, kv_dtype, chunk: int):
    """tokens [B, T] -> (observation-window prompt rows [L, B, T], every prompt row [L, B, T], decode rows
    [L, B, G, T]) of a causal forward."""
    model: Transformer = nnx.merge(graphdef, state)
    b, t = tokens.shape
    n = num_steps + n_obs

    def attend(q, k, v, layer_cache, ctx: LayerContext):
        prompt_q = ctx.positions < t - num_steps
        out, col = chunked_attention(
            q,
            k,
            v,
            q_pos=ctx.positions,
            k_pos=ctx.positions,
            sliding_window=ctx.cfg.sliding_window,
            chunk=chunk,
            q_valid=prompt_q,
        )
        stored = k.astype(kv_dtype).astype(jnp.float32)
        end = jnp.full((b,), t, jnp.int32)
        rows = observation_mass(q.astype(jnp.float32), stored, end, n, ctx.cfg.sliding_window)  # [B, n, T]
        prompt = {"prompt": rows[:, :n_obs].sum(axis=1), "all": col.mean(axis=(1, 2))}
        return out, {**prompt, "rows": rows[:, n_obs:]}

    L = model.cfg.num_layers
    zeros = jnp.zeros((L, b, t), jnp.float32)
    cache = {"prompt": zeros, "all": zeros, "rows": jnp.zeros((L, b, num_steps, t), jnp.float32)}
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, cache = model(tokens, positions, cache, attend=attend, logit_index=jnp.zeros((b,), jnp.int32))
    return cache["prompt"], cache["all"], cache["rows"]


_reference_jit = jax.jit(_reference, static_argnames=("graphdef", "num_steps", "n_obs", "kv_dtype", "chunk"))


def reference_trace(
    model: Transformer,
    sequences: np.ndarray,
    num_steps: int,
    n_obs: int = 32,
    kv_dtype: Any = DEFAULT_KV_DTYPE,
    chunk: int = 512,
) -> ReferenceTrace:
    """Full-KV rows of sequences [B, P + G] (every row the same length): the last ``num_steps`` = G queries
    are the decode steps, the ``n_obs`` before them the prompt's observation window."""
    sequences = np.asarray(sequences, np.int32)
    if sequences.ndim != 2 or sequences.shape[1] <= num_steps + n_obs:
        raise ValueError(
            f"need sequences [B, T] with T > G + n_obs = {num_steps + n_obs}, got {sequences.shape}"
        )
    graphdef, state = nnx.split(model)
    (prompt, prompt_all, rows), _ = EXECUTABLES.run(
        _reference_jit,
        dict(graphdef=graphdef, num_steps=num_steps, n_obs=n_obs, kv_dtype=kv_dtype, chunk=chunk),
        state=state,
        tokens=jnp.asarray(sequences),
    )
    return ReferenceTrace(
        prompt_rows=np.asarray(prompt).swapaxes(0, 1),
        prompt_all=np.asarray(prompt_all).swapaxes(0, 1),
        rows=np.asarray(rows).transpose(1, 2, 0, 3),
    )


def window_mass(token_mass: np.ndarray, sink: int, window: int, nw: int) -> np.ndarray:
    """Per-token mass [..., T] summed per window (window w = positions [S + wW, S + (w+1)W)) -> [..., NW]."""
    body = token_mass[..., sink:]
    need = nw * window
    pad = [(0, 0)] * (body.ndim - 1) + [(0, max(0, need - body.shape[-1]))]
    body = np.pad(body, pad)[..., :need]
    return body.reshape(*body.shape[:-1], nw, window).sum(-1)


# ---------------------------------------------------------------------------------------------- policy


def window_view(cache: TieredCache, nw: int) -> tuple[jax.Array, jax.Array]:
    """Tier and score of every window id of a stacked cache: (tiers [L, B, NW] int8, scores [L, B, NW] f32).

    F: held by an F slot; Q: held by an active ledger entry; E: routed (id < ``next_win``) and in neither;
    LOCAL: not routed yet (in the ring, or not written). Scores: the slot's score for F and Q windows, NaN
    elsewhere.
    """
    ids = jnp.arange(nw, dtype=jnp.int32)
    cache = fold_head_means(cache)  # the scores include the masses since the last routing event

    def row(r: TieredCache):
        tier = jnp.where(ids < r.next_win, E, LOCAL).astype(jnp.int8)
        score = jnp.full((nw,), jnp.nan, jnp.float32)
        q_idx = jnp.where(r.ledger.active & (r.ledger.win >= 0), r.ledger.win, nw)
        tier = tier.at[q_idx].set(Q, mode="drop")
        score = score.at[q_idx].set(r.ledger.score.astype(jnp.float32), mode="drop")
        f_idx = jnp.where(r.f_win >= 0, r.f_win, nw)
        tier = tier.at[f_idx].set(F, mode="drop")
        score = score.at[f_idx].set(r.f_score.astype(jnp.float32), mode="drop")
        return tier, score

    return jax.vmap(jax.vmap(row))(cache)


def _policy_prefill(
    graphdef, state, tokens, method: KVMethod, capacity_new: int, kv_dtype, nw: int, weights: Any = None
):
    """tokens [B, P] (no padding) -> (cache, tiers [L, B, NW], scores [L, B, NW]) after the prefill;
    ``weights``: the method's learned parameters (``KVMethod.weights``)."""
    model: Transformer = nnx.merge(graphdef, state)
    b, p = tokens.shape
    lengths = jnp.full((b,), p, jnp.int32)
    _, cache = prefill_logits(
        model,
        tokens,
        lengths,
        method,
        max_new_tokens=capacity_new,
        budget_tokens=p + capacity_new,
        kv_dtype=kv_dtype,
        weights=weights,
    )
    return (cache, *window_view(cache, nw))


def _policy_interval(graphdef, state, cache, tokens, start, method: KVMethod, nw: int, weights: Any = None):
    """Ω teacher-forced decode steps: tokens [B, Ω] at positions ``start + i`` ([B] start); the last step's
    routing event is due. Returns (cache, scores before the event routes [L, B, NW], tiers and scores after
    it [L, B, NW])."""
    model: Transformer = nnx.merge(graphdef, state)
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)

    def step(cache, xs):
        token, i = xs
        attend = method.decode_attend
        _, cache = model(
            token[:, None],
            (start + i)[:, None],
            cache,
            attend=attend,
            weights=weights,
            stacked_cache=method.stacked_cache,
        )
        return cache

    def body(cache, xs):
        return method.decode_route(step(cache, xs), inv_freq), None

    omega = tokens.shape[1]
    idx = jnp.arange(omega, dtype=jnp.int32)
    cache, _ = jax.lax.scan(body, cache, (tokens[:, :-1].T, idx[:-1]))
    cache = step(cache, (tokens[:, -1], idx[-1]))
    _, pre = window_view(cache, nw)
    cache = method.decode_route(cache, inv_freq)
    return (cache, pre, *window_view(cache, nw))


_policy_prefill_jit = jax.jit(
    _policy_prefill, static_argnames=("graphdef", "method", "capacity_new", "kv_dtype", "nw")
)
_policy_interval_jit = jax.jit(
    _policy_interval, static_argnames=("graphdef", "method", "nw"), donate_argnames=("cache",)
)


@dataclasses.dataclass(frozen=True)
class PolicyTrace:
    """The tiers of one method over a batch of teacher-forced sequences (numpy).

    tiers: [B, R, L, NW] int8 after each routing event (event 0 = prefill placement; R = G / Ω + 1).
    scores: [B, R, L, NW] f32 cache score after each event (NaN outside F and Q).
    scores_pre: [B, R-1, L, NW] f32 score just before event r + 1 routes.
    sink, window, omega: the cache's S, W, Ω; nf, nq: its F slots and Q capacity; ranking: its name.
    """

    tiers: np.ndarray
    scores: np.ndarray
    scores_pre: np.ndarray
    sink: int
    window: int
    omega: int
    nf: int
    nq: int
    ranking: str


def require_traceable(method: KVMethod) -> None:
    """Raise ValueError unless ``policy_trace`` can trace ``method``: a window-tier method (QEvict, R1-R4)
    whose ranking accumulates attention mass (what the diagnosis reads the mass credited to Q windows from)."""
    if not (isinstance(method, WindowMethod) and isinstance(method.allocation, BudgetedTiers)):
        raise ValueError(f"method {method.name!r} has no window tiers to diagnose (QEvict and R1-R4 do)")
    ranking = method.ranking
    if type(ranking).update is not Ranking.update:
        raise ValueError(
            f"the diagnosis reads the mass credited to Q windows from cumulative scores; method {method.name!r} "
            f"ranks by {ranking.name!r}"
        )


def policy_trace(
    model: Transformer,
    sequences: np.ndarray,
    prompt_len: int,
    method: KVMethod,
    kv_dtype: Any = DEFAULT_KV_DTYPE,
    on_event: Callable[[], None] | None = None,
) -> PolicyTrace:
    """Teacher-force sequences [B, P + G] through ``method`` (a window-tier method: QEvict or R1-R4) and
    record its tiers at every routing event. The cache is sized for exactly P + G tokens. ``on_event`` is
    called after each routing event (a progress bar)."""
    require_traceable(method)
    caps_cfg = method.cache
    ranking = method.ranking
    sequences = np.asarray(sequences, np.int32)
    b, t = sequences.shape
    g = t - prompt_len
    omega = caps_cfg.omega
    if g < omega or g % omega:
        raise ValueError(f"the decode steps G = {g} must be a positive multiple of Ω = {omega}")
    nw = num_windows(t, caps_cfg.sink, caps_cfg.window)
    graphdef, state = nnx.split(model)
    weights = method_weights(method, model.cfg, None)
    (cache, tier0, score0), _ = EXECUTABLES.run(
        _policy_prefill_jit,
        dict(graphdef=graphdef, method=method, capacity_new=g, kv_dtype=kv_dtype, nw=nw),
        state=state,
        tokens=jnp.asarray(sequences[:, :prompt_len]),
        weights=weights,
    )
    caps = cache.caps
    tiers, scores, pre = [np.asarray(tier0)], [np.asarray(score0)], []
    if on_event is not None:
        on_event()
    for s in range(0, g, omega):
        chunk = jnp.asarray(sequences[:, prompt_len + s : prompt_len + s + omega])
        start = jnp.full((b,), prompt_len + s, jnp.int32)
        (cache, sp, tr, sc), _ = EXECUTABLES.run(
            _policy_interval_jit,
            dict(graphdef=graphdef, method=method, nw=nw),
            state=state,
            cache=cache,
            tokens=chunk,
            start=start,
            weights=weights,
        )
        pre.append(np.asarray(sp))
        tiers.append(np.asarray(tr))
        scores.append(np.asarray(sc))
        if on_event is not None:
            on_event()
    # [R, L, B, NW] -> [B, R, L, NW]
    to_rows = lambda xs: np.stack(xs).transpose(2, 0, 1, 3)
    return PolicyTrace(
        tiers=to_rows(tiers),
        scores=to_rows(scores),
        scores_pre=to_rows(pre),
        sink=caps.sink,
        window=caps.window,
        omega=omega,
        nf=caps.nf,
        nq=caps.nq,
        ranking=ranking.name,
    )


def num_events(num_steps: int, omega: int) -> int:
    """Routing events a policy trace of G decode steps records: the prefill placement and one per Ω steps."""
    return num_steps // omega + 1


def passages(
    encode: Callable[[str], list[int]],
    count: int,
    prompt_len: int,
    num_steps: int,
    *,
    text: str | None = None,
    bos: Sequence[int] = (),
    seed: int = 0,
) -> np.ndarray:
    """[count, P + G] int32 token sequences: consecutive spans of ``text`` (a user's text, ``bos`` first) or,
    by default, spans of the Python reference manual (``pydoc_data.topics``) from seeded paragraphs
    (``eval.fidelity.fidelity_sample``: prefix P, then G targets)."""
    if text is None:
        samples = [fidelity_sample(seed + i, prompt_len, num_steps, encode, list(bos)) for i in range(count)]
        return np.asarray([s.prefix + s.targets for s in samples], np.int32)
    length = prompt_len + num_steps
    ids = encode(text)
    body = length - len(bos)
    if len(ids) < count * body:
        raise ValueError(
            f"the text has {len(ids)} tokens; {count} passages of {length} tokens need {count * body}"
        )
    return np.asarray([list(bos) + ids[i * body : (i + 1) * body] for i in range(count)], np.int32)
