"""The KV-cache method interface, and the uncompressed Full-KV cache.

A method is a frozen, hashable dataclass (a static argument under ``jax.jit``) with three functions:

- ``init_cache(model_cfg, prompt_lengths, prompt_capacity, max_new_tokens, dtype, budget_tokens)``: an empty
  cache pytree, every array with a leading layer axis ``[L, ...]``; ``prompt_lengths`` [B] int32 are the real
  lengths of the right-padded prompts (``prompt_capacity`` tokens each); a budgeted method sizes its buffers
  for ``budget_tokens`` tokens per row (static; methods with ``uses_budget = False`` ignore it).
- ``prefill_attend(q, k, v, layer_cache, ctx)`` and ``decode_attend(...)``: the decoder's ``AttendFn`` for the
  prompt pass (positions ``0..P-1``, rows right-padded) and for one decoded token per row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import chunked_attention, dense_attention
from models.config import ModelConfig
from models.model import LayerContext


class KVMethod(Protocol):
    name: str

    def init_cache(
        self,
        model_cfg: ModelConfig,
        prompt_lengths: jax.Array,
        prompt_capacity: int,
        max_new_tokens: int,
        dtype: Any,
        budget_tokens: int,
    ) -> Any: ...

    def prefill_attend(self, q, k, v, layer_cache, ctx: LayerContext) -> tuple[jax.Array, Any]: ...

    def decode_attend(self, q, k, v, layer_cache, ctx: LayerContext) -> tuple[jax.Array, Any]: ...


def full_kv_bytes(model_cfg: ModelConfig, num_tokens: int, dtype: Any, batch: int = 1) -> int:
    """Bytes of the uncompressed cache of ``num_tokens`` tokens: L * 2 * Hkv * D * T * itemsize * B."""
    return batch * num_tokens * model_cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize)


def cache_nbytes(cache: Any) -> int:
    """Measured size of a cache: the sum of ``nbytes`` over every array in the pytree, metadata included."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(cache)))


def write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Write new [B, Hkv, T, D] into buffer [B, Hkv, C, D] at per-row offsets ``start`` [B]."""

    def one(buf, x, s):
        return jax.lax.dynamic_update_slice(buf, x.astype(buf.dtype), (0, s, 0))

    return jax.vmap(one)(buffer, new, start)


@struct.dataclass
class FullCache:
    """Uncompressed KV cache (per layer; stacked caches carry a leading [L] axis on every field).

    k, v: [B, Hkv, C, D] post-RoPE keys and values, slot index = absolute position.
    length: [B] int32 tokens written so far.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array


@dataclasses.dataclass(frozen=True)
class FullKV:
    """The uncompressed baseline: every token kept in full precision."""

    name: str = "full"
    prefill_chunk: int = 512

    def init_cache(
        self, model_cfg, prompt_lengths, prompt_capacity, max_new_tokens, dtype, budget_tokens=0
    ) -> FullCache:
        b = prompt_lengths.shape[0]
        cap = prompt_capacity + max_new_tokens
        shape = (model_cfg.num_layers, b, model_cfg.num_kv_heads, cap, model_cfg.head_dim)
        length = jnp.broadcast_to(prompt_lengths.astype(jnp.int32), (model_cfg.num_layers, b))
        return FullCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=length)

    def prefill_attend(self, q, k, v, cache: FullCache, ctx: LayerContext):
        out, _ = chunked_attention(
            q, k, v, ctx.positions, ctx.positions, ctx.cfg.sliding_window, self.prefill_chunk
        )
        zeros = jnp.zeros((q.shape[0],), jnp.int32)
        cache = cache.replace(
            k=write_rows(cache.k, k.swapaxes(1, 2), zeros), v=write_rows(cache.v, v.swapaxes(1, 2), zeros)
        )
        return out, cache

    def decode_attend(self, q, k, v, cache: FullCache, ctx: LayerContext):
        pos = ctx.positions[:, 0]
        kbuf = write_rows(cache.k, k.swapaxes(1, 2), pos)
        vbuf = write_rows(cache.v, v.swapaxes(1, 2), pos)
        b, cap = kbuf.shape[0], kbuf.shape[2]
        k_pos = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (b, cap))
        out, _ = dense_attention(
            q, kbuf.swapaxes(1, 2), vbuf.swapaxes(1, 2), ctx.positions, k_pos, ctx.cfg.sliding_window
        )
        return out, FullCache(k=kbuf, v=vbuf, length=pos + 1)
