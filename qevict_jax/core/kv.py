"""The KV-cache method interface, byte accounting and the uncompressed cache pytree (``FullCache``).

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
- ``uncompressed()``: the method that runs instead when compressing a prompt saves nothing (Full-KV,
  ``qevict_jax.methods.full``; Full-KV is its own).
- ``at_budget(beta)``: the same method at β = ``beta`` (a prompt whose β cannot hold the method's smallest
  cache is compressed at the least β that can), or None where the size is not a β (Full-KV, a fixed
  ``budget_bytes``).

- ``weights(model_cfg)``: the method's learned parameters for a model as host arrays (a pytree; None for a
  method without any), read once on the host; the runtime passes them into every program as an argument,
  which the attend fns read from ``LayerContext.weights``: new parameters of the same shapes reuse the
  compiled programs.

The runtime sees methods only through this protocol: it never names a concrete method, Full-KV included.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

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
    """name: registry name; compresses: the cache holds less than every token in full precision (False for
    Full-KV alone); uses_budget: sized by a byte budget β; options: names ``configure`` may set;
    protects_recent: has a protected recent region (``recent``) that a benchmark's protocol may set;
    stacked_cache: its attend fns take the whole stacked cache and ``ctx.layer`` (else one layer's slice);
    budget: the β it runs at, None when no budget applies; reconstruction: the context reconstruction its prompt
    pass runs (``rankings.reconstruction.Reconstruction``: the runtime hands each layer's scores in as its
    traced ``weights``), or None."""

    name: str
    compresses: bool
    uses_budget: bool
    options: tuple[str, ...]
    protects_recent: bool
    stacked_cache: bool
    reconstruction: Any

    @property
    def budget(self) -> float | None: ...

    def init_cache(self, request: CacheRequest, prompt_lengths: jax.Array) -> Any: ...

    def prefill_attend(self, q, k, v, layer_cache, ctx: LayerContext) -> tuple[jax.Array, Any]: ...

    def decode_attend(self, q, k, v, layer_cache, ctx: LayerContext) -> tuple[jax.Array, Any]: ...

    def route(self, cache: Any, inv_freq: jax.Array, due: jax.Array | None = None) -> Any: ...

    def decode_route(self, cache: Any, inv_freq: jax.Array) -> Any: ...

    def reserve(self, cache: Any, total_tokens: int) -> Any: ...

    def uncompressed(self) -> KVMethod: ...

    def at_budget(self, beta: float) -> KVMethod | None: ...

    def weights(self, model_cfg: ModelConfig) -> Any: ...


DEFAULT_KV_DTYPE = jnp.bfloat16
"""The KV cache is stored in a 16-bit dtype whatever the compute dtype (docs/design.md §3), as deployments do."""


def full_kv_bytes(model_cfg: ModelConfig, num_tokens: int, dtype: Any, batch: int = 1) -> int:
    """Bytes of the uncompressed cache of ``num_tokens`` tokens: L * 2 * Hkv * D * T * itemsize * B."""
    return batch * num_tokens * model_cfg.kv_bytes_per_token(jnp.dtype(dtype).itemsize)


def cache_nbytes(cache: Any) -> int:
    """Measured size of a cache: the bytes of every array in the pytree, metadata included; an abstract cache
    (``jax.ShapeDtypeStruct`` leaves, ``jax.eval_shape``) counts what it would allocate."""
    return int(sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(cache)))


def to_words(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` in the storage form of ``dtype``: a 16-bit float is kept as its raw 16-bit words (uint16).

    XLA's CPU backend rewrites a scatter or dynamic-update-slice on a 16-bit float buffer into f32 and back,
    converting the *whole* buffer (17 ms per write into SmolLM2's 2K stacked cache, against microseconds on
    uint16 words): the uncompressed cache, written one token per layer per step, and QEvict's F tier
    (``cache.TieredCache.f_k_words``), into which routing scatters windows, are kept as words.
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
