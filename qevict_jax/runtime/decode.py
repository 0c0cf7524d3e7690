"""The decode side of generation: the jitted ``lax.while_loop`` that samples one token per row and step over a
method's cache (``decode_jit``: no host round trip per token, routing events inside), and its teacher-forced
twin (``teacher_forced_jit``: feeds given tokens and returns every step's log-probabilities).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from models.model import Transformer
from qevict_jax.core.kv import KVMethod
from qevict_jax.core.sharding import Mesh, constrain_cache, constrain_rows, mesh_context
from qevict_jax.runtime.prefill import prefill_logits
from qevict_jax.runtime.sampling import SamplerConfig, sample
from qevict_jax.runtime.streaming import emit_in_loop


@struct.dataclass
class DecodeState:
    """The carry of the decode loop: step [] int32 (tokens[:, step] is the last sampled token, not yet in the
    cache), the cache pytree, tokens [B, G] int32 sampled so far, done [B] bool (row hit EOS), rng key."""

    step: jax.Array
    cache: Any
    tokens: jax.Array
    done: jax.Array
    rng: jax.Array


def _decode(
    graphdef,
    state,
    cache,
    first,
    lengths,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    mesh: Mesh | None = None,
    stream_id: jax.Array | None = None,
    weights: Any = None,
):
    """Decode loop: first [B] token (at positions ``lengths``) -> (tokens [B, G], num_tokens [B], steps
    taken [], cache). After it, each row's cache holds ``lengths + steps`` tokens and ``tokens[:, steps]``
    is the last sampled token, not yet in the cache. On a ``mesh`` the loop carry's cache is constrained to
    its sharding every step (and the token buffer [B, G] to the batch split), so it never moves. With a
    ``stream_id`` [] (``streaming.open_stream``) each step's tokens [B] also go to that stream's host sink as
    they are sampled; without one the loop contains no callback. ``weights``: the method's learned parameters
    (``KVMethod.weights``)."""
    model: Transformer = nnx.merge(graphdef, state)
    b = first.shape[0]
    g = sampler.max_new_tokens
    eos = jnp.asarray(sampler.eos_ids or (-1,), jnp.int32)
    out = constrain_rows(jnp.zeros((b, g), jnp.int32).at[:, 0].set(first), mesh)
    done = jnp.isin(first, eos)
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)

    def more(state: DecodeState) -> jax.Array:
        return (state.step + 1 < g) & ~jnp.all(state.done)

    def step(state: DecodeState) -> DecodeState:
        rng, key = jax.random.split(state.rng)
        token = state.tokens[:, state.step]
        pos = (lengths + state.step)[:, None]
        logits, cache = model(
            token[:, None],
            pos,
            state.cache,
            attend=method.decode_attend,
            weights=weights,
            stacked_cache=method.stacked_cache,
        )
        cache = constrain_cache(method.decode_route(cache, inv_freq), mesh)
        nxt = sample(logits[:, 0], key, sampler)
        nxt = jnp.where(state.done, eos[0], nxt)
        emit_in_loop(stream_id, nxt, ~state.done)
        return DecodeState(
            step=state.step + 1,
            cache=cache,
            tokens=constrain_rows(state.tokens.at[:, state.step + 1].set(nxt), mesh),
            done=state.done | jnp.isin(nxt, eos),
            rng=rng,
        )

    start = DecodeState(step=jnp.int32(0), cache=constrain_cache(cache, mesh), tokens=out, done=done, rng=rng)
    with mesh_context(mesh):  # the decode attention maps its kernels over the mesh's shards (``on_shards``)
        final = jax.lax.while_loop(more, step, start)
    steps, cache, out = final.step, final.cache, final.tokens
    # a row's output ends at its first EOS (inclusive) or at the last step taken
    is_eos = jnp.isin(out, eos) & (jnp.arange(g) <= steps)
    first_eos = jnp.where(is_eos.any(axis=1), jnp.argmax(is_eos, axis=1), steps)
    return out, first_eos + 1, steps, cache


decode_jit = jax.jit(
    _decode, static_argnames=("graphdef", "method", "sampler", "mesh"), donate_argnames=("cache",)
)


def _teacher_forced(
    graphdef, state, tokens, lengths, targets, method: KVMethod, budget_tokens: int, kv_dtype, weights=None
):
    """Prefill, then feed ``targets`` [B, T] one token per step (teacher forcing); ``weights``: the method's
    learned parameters (``KVMethod.weights``).

    Returns (log-probabilities [B, T, V] of each target position given everything before it, cache).
    """
    model: Transformer = nnx.merge(graphdef, state)
    t = targets.shape[1]
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)
    logits0, cache = prefill_logits(
        model,
        tokens,
        lengths,
        method,
        max_new_tokens=t,
        budget_tokens=budget_tokens,
        kv_dtype=kv_dtype,
        weights=weights,
    )

    def body(cache, xs):
        token, step = xs
        attend = method.decode_attend
        positions = (lengths + step)[:, None]
        logits, cache = model(
            token[:, None],
            positions,
            cache,
            attend=attend,
            weights=weights,
            stacked_cache=method.stacked_cache,
        )
        cache = method.decode_route(cache, inv_freq)
        return cache, jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)

    steps = jnp.arange(t - 1, dtype=jnp.int32)
    cache, rest = jax.lax.scan(body, cache, (targets[:, :-1].T, steps))
    first = jax.nn.log_softmax(logits0.astype(jnp.float32), axis=-1)
    return jnp.concatenate([first[:, None], rest.swapaxes(0, 1)], axis=1), cache


teacher_forced_jit = jax.jit(
    _teacher_forced, static_argnames=("graphdef", "method", "budget_tokens", "kv_dtype")
)
