"""The KV-cache method interface, and the uncompressed Full-KV cache.

A method is a frozen, hashable dataclass (a static argument under ``jax.jit``) with these functions:

- ``init_cache(request, prompt_lengths)``: an empty cache pytree for a ``CacheRequest`` (what the cache is
  sized for, static), every array with a leading layer axis ``[L, ...]``; ``prompt_lengths`` [B] int32 are the
  real lengths of the right-padded prompts.
- ``prefill_attend(q, k, v, layer_cache, ctx)`` and ``decode_attend(...)``: the decoder's ``AttendFn`` for the
  prompt pass (positions ``0..P-1``, rows right-padded) and for one decoded token per row.
- ``route(cache, inv_freq, due=None)``: a routing event on the whole stacked cache, now (``due`` None: after
  an appended chunk of tokens, before decoding) or only where the traced bool ``due`` [] holds; identity for
  methods that never route. The one routing contract of every method.
- ``decode_route(cache, inv_freq)``: after a decode step, ``route`` with ``due`` = an event is due now.
- ``reserve(cache, total_tokens)``: a cache with room for ``total_tokens`` tokens per row (a continued
  conversation), or a clear error when the method cannot grow.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import chunked_attention, dense_attention
from models.config import ModelConfig
from models.model import LayerContext


@dataclasses.dataclass(frozen=True)
class CacheRequest:
    """What a method's cache is sized for (static: one compilation per request).

    model_cfg: the decoder. batch: B rows. prompt_capacity: tokens of each right-padded prompt (the length
    bucket). max_new_tokens: tokens after the prompt the cache must hold. dtype: the KV storage dtype.
    budget_tokens: a budgeted method sizes its buffers for β of this many uncompressed tokens per row
    (methods with ``uses_budget`` False ignore it; a ``Fanout`` gets one per member).
    """

    model_cfg: ModelConfig
    batch: int
    prompt_capacity: int
    max_new_tokens: int
    dtype: Any
    budget_tokens: int | tuple[int, ...] = 0

    @property
    def max_tokens(self) -> int:
        """Prompt capacity + new tokens: the most tokens a row can have."""
        return self.prompt_capacity + self.max_new_tokens


class KVMethod(Protocol):
    """name: registry name; uses_budget: sized by a byte budget β; options: names ``configure`` may set;
    protects_recent: has a protected recent region (``recent``) that a benchmark's protocol may set;
    stacked_cache: its attend fns take the whole stacked cache and ``ctx.layer`` (else one layer's slice);
    budget: the β it runs at, None when no budget applies."""

    name: str
    uses_budget: bool
    options: tuple[str, ...]
    protects_recent: bool
    stacked_cache: bool

    @property
    def budget(self) -> float | None: ...

    def init_cache(self, request: CacheRequest, prompt_lengths: jax.Array) -> Any: ...

    def prefill_attend(self, q, k, v, layer_cache, ctx: LayerContext) -> tuple[jax.Array, Any]: ...

    def decode_attend(self, q, k, v, layer_cache, ctx: LayerContext) -> tuple[jax.Array, Any]: ...

    def route(self, cache: Any, inv_freq: jax.Array, due: jax.Array | None = None) -> Any: ...

    def decode_route(self, cache: Any, inv_freq: jax.Array) -> Any: ...

    def reserve(self, cache: Any, total_tokens: int) -> Any: ...


DEFAULT_KV_DTYPE = jnp.bfloat16
"""The KV cache is stored in a 16-bit dtype whatever the compute dtype (docs/design.md §3), as deployments do."""


def full_kv_bytes(model_cfg: ModelConfig, num_tokens: int, dtype: Any, batch: int = 1) -> int:
    """Bytes of the uncompressed cache of ``num_tokens`` tokens: L * 2 * Hkv * D * T * itemsize * B."""
    return batch * num_tokens * model_cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize)


def cache_nbytes(cache: Any) -> int:
    """Measured size of a cache: the sum of ``nbytes`` over every array in the pytree, metadata included."""
    return int(sum(leaf.nbytes for leaf in jax.tree.leaves(cache)))


def to_words(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` in the storage form of ``dtype``: a 16-bit float is kept as its raw 16-bit words (uint16).

    XLA's CPU backend rewrites a scatter or dynamic-update-slice on a 16-bit float buffer into f32 and back,
    converting the *whole* buffer (17 ms per write into SmolLM2's 2K stacked cache, against microseconds on
    uint16 words): the uncompressed cache, written one token per layer per step, and QEvict's F tier
    (``cache.TieredCache.fp_kw``), into which routing scatters windows, are kept as words.
    """
    x = x.astype(dtype)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if jnp.dtype(dtype).itemsize == 2 else x


def from_words(words: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of ``to_words``: the values in ``dtype``."""
    return jax.lax.bitcast_convert_type(words, dtype) if words.dtype != jnp.dtype(dtype) else words


@struct.dataclass
class FullCache:
    """Uncompressed KV cache (per layer; stacked caches carry a leading [L] axis on every field).

    k, v: [B, Hkv, C, D] post-RoPE keys and values, slot index = absolute position, in the storage form of
    ``dtype`` (``to_words``: uint16 words of a 16-bit float; ``keys()``/``values()`` give the values).
    length: [B] int32 tokens written so far.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array
    dtype: Any = struct.field(pytree_node=False, default=jnp.float32)

    def keys(self) -> jax.Array:
        return from_words(self.k, self.dtype)

    def values(self) -> jax.Array:
        return from_words(self.v, self.dtype)


@dataclasses.dataclass(frozen=True)
class FullKV:
    """The uncompressed baseline: every token kept in full precision.

    Its attend fns take the whole stacked cache (``stacked_cache``) and write the new token in place, so a
    decode step never copies the cache.
    """

    name: str = "full"
    prefill_chunk: int = 512
    stacked_cache: ClassVar[bool] = True
    uses_budget: ClassVar[bool] = False
    options: ClassVar[tuple[str, ...]] = ("prefill_chunk",)
    protects_recent: ClassVar[bool] = False

    @property
    def budget(self) -> float | None:
        return None

    def init_cache(self, request: CacheRequest, prompt_lengths: jax.Array) -> FullCache:
        cfg, b, dtype = request.model_cfg, request.batch, request.dtype
        shape = (cfg.num_layers, b, cfg.num_kv_heads, request.max_tokens, cfg.head_dim)
        length = jnp.broadcast_to(prompt_lengths.astype(jnp.int32), (cfg.num_layers, b))
        zeros = to_words(jnp.zeros(shape, dtype), dtype)
        return FullCache(k=zeros, v=zeros, length=length, dtype=jnp.dtype(dtype))

    def route(self, cache: FullCache, inv_freq: jax.Array, due: jax.Array | None = None) -> FullCache:
        return cache

    def decode_route(self, cache: FullCache, inv_freq: jax.Array) -> FullCache:
        return cache

    def reserve(self, cache: FullCache, total_tokens: int) -> FullCache:
        """Grow the buffers [L, B, Hkv, C, D] to at least ``total_tokens`` slots (zero padding)."""
        extra = total_tokens - cache.k.shape[3]
        if extra <= 0:
            return cache
        pad = ((0, 0), (0, 0), (0, 0), (0, extra), (0, 0))
        return cache.replace(k=jnp.pad(cache.k, pad), v=jnp.pad(cache.v, pad))

    def _prompt_blocks(self, ctx: LayerContext) -> dict[str, Any]:
        """``chunked_attention``'s keyword arguments of a prompt pass over its own tokens."""
        return dict(
            q_pos=ctx.positions, k_pos=ctx.positions, sliding_window=ctx.cfg.sliding_window, chunk=self.prefill_chunk
        )

    def prefill_attend(self, q, k, v, cache: FullCache, ctx: LayerContext):
        """q [B, P, H, D], k, v [B, P, Hkv, D]; cache: stacked [L, ...]. Writes the layer's prompt KV."""
        out, _ = chunked_attention(
            q, k, v, **self._prompt_blocks(ctx)
        )
        at = (ctx.layer, 0, 0, 0, 0)
        cache = cache.replace(
            k=jax.lax.dynamic_update_slice(cache.k, to_words(k.swapaxes(1, 2)[None], cache.dtype), at),
            v=jax.lax.dynamic_update_slice(cache.v, to_words(v.swapaxes(1, 2)[None], cache.dtype), at),
        )
        return out, cache

    def prefill_attend_slice(self, q, k, v, cache: FullCache, ctx: LayerContext):
        """``prefill_attend`` on one layer's slice of the cache ([B, Hkv, C, D] fields), for a shared prefill
        (``prefill.Fanout``) whose layer scan hands every member its slice and the prompt attention."""
        if ctx.prompt_attention is not None:
            out = ctx.prompt_attention[0]
        else:
            out, _ = chunked_attention(
                q, k, v, **self._prompt_blocks(ctx)
            )
        cache = cache.replace(
            k=jax.lax.dynamic_update_slice(cache.k, to_words(k.swapaxes(1, 2), cache.dtype), (0, 0, 0, 0)),
            v=jax.lax.dynamic_update_slice(cache.v, to_words(v.swapaxes(1, 2), cache.dtype), (0, 0, 0, 0)),
        )
        return out, cache

    def decode_attend(self, q, k, v, cache: FullCache, ctx: LayerContext):
        """q [B, 1, H, D], k, v [B, 1, Hkv, D]; cache: stacked [L, ...]. One token per row, in place."""
        pos = ctx.positions[:, 0]
        rows = jnp.arange(pos.shape[0])
        kbuf = cache.k.at[ctx.layer, rows, :, pos].set(to_words(k[:, 0], cache.dtype))
        vbuf = cache.v.at[ctx.layer, rows, :, pos].set(to_words(v[:, 0], cache.dtype))
        k_layer = from_words(kbuf[ctx.layer], cache.dtype)  # [B, Hkv, C, D]
        v_layer = from_words(vbuf[ctx.layer], cache.dtype)
        b, cap = k_layer.shape[0], k_layer.shape[2]
        k_pos = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (b, cap))
        out, _ = dense_attention(
            q,
            k_layer.swapaxes(1, 2),
            v_layer.swapaxes(1, 2),
            q_pos=ctx.positions,
            k_pos=k_pos,
            sliding_window=ctx.cfg.sliding_window,
        )
        length = cache.length.at[ctx.layer].set(pos + 1)
        return out, cache.replace(k=kbuf, v=vbuf, length=length)
