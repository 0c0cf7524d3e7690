"""Full-KV: the uncompressed method, every token kept in full precision (the cache every budget β is
measured against, ``core.kv.full_kv_bytes``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from models.attention import chunked_attention, dense_attention
from models.config import ModelConfig
from models.model import LayerContext
from qevict_jax.core.kv import CacheRequest, FullCache, from_words, to_words


@dataclasses.dataclass(frozen=True)
class FullKV:
    """The uncompressed baseline: every token kept in full precision.

    Its attend fns take the whole stacked cache (``stacked_cache``) and write the new token in place, so a
    decode step never copies the cache.
    """

    name: str = "full"
    prefill_chunk: int = 512
    compresses: ClassVar[bool] = False
    stacked_cache: ClassVar[bool] = True
    uses_budget: ClassVar[bool] = False
    options: ClassVar[tuple[str, ...]] = ("prefill_chunk",)
    protects_recent: ClassVar[bool] = False
    reconstruction: ClassVar[None] = None  # reconstructs nothing in its prompt pass

    @property
    def budget(self) -> float | None:
        return None

    def init_cache(self, request: CacheRequest, prompt_lengths: jax.Array) -> FullCache:
        cfg, b, dtype = request.model_cfg, request.batch, request.dtype
        shape = (cfg.num_layers, b, cfg.num_kv_heads, request.max_tokens, cfg.head_dim)
        length = jnp.broadcast_to(prompt_lengths.astype(jnp.int32), (cfg.num_layers, b))
        zeros = to_words(jnp.zeros(shape, dtype), dtype)
        return FullCache(k=zeros, v=zeros, length=length, dtype=jnp.dtype(dtype))

    def uncompressed(self) -> FullKV:
        return self

    def at_budget(self, beta: float) -> None:
        return None  # keeps every token: no β applies

    def weights(self, model_cfg: ModelConfig) -> None:
        return None

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
        """q [B, P, H, D], k, v [B, P, Hkv, D]; cache: stacked [L, ...]. Writes the layer's prompt KV (the
        attention is the shared prefill's when it computed it: ``LayerContext.prompt_attention``)."""
        if ctx.prompt_attention is not None:
            out = ctx.prompt_attention[0]
        else:
            out, _ = chunked_attention(q, k, v, **self._prompt_blocks(ctx))
        at = (ctx.layer, 0, 0, 0, 0)
        cache = cache.replace(
            k=jax.lax.dynamic_update_slice(cache.k, to_words(k.swapaxes(1, 2)[None], cache.dtype), at),
            v=jax.lax.dynamic_update_slice(cache.v, to_words(v.swapaxes(1, 2)[None], cache.dtype), at),
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


class Compressing:
    """The protocol's answers of every method that compresses (both engines): it does, and when compressing a
    prompt saves nothing the runtime runs Full-KV instead."""

    compresses: ClassVar[bool] = True
    # the context reconstruction its prompt pass runs (``reconstruction.Reconstruction``; the kvzip ranking), or None
    reconstruction: Any = None

    def uncompressed(self) -> FullKV:
        return FullKV()

    def weights(self, model_cfg: ModelConfig) -> None:
        """None: no learned parameters (the gate methods override it)."""
        return None
