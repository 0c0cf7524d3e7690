"""One Flax NNX decoder for Llama, Mistral, Qwen2 and Qwen3.

Layer parameters are stacked on a leading ``[L, ...]`` axis and the forward pass is a ``lax.scan`` over
layers. The KV cache is not module state: it is a pytree with a leading layer axis passed in and out, and
what a layer does with its keys and values is an ``AttendFn`` supplied by the caller (Full-KV, QEvict and
every baseline plug in there). By default the scan hands the attend fn one layer's slice of the cache; with
``stacked_cache=True`` (the caller passes its method's ``stacked_cache``) it gets the whole stacked cache and
``ctx.layer`` and updates it in place. With ``cache=None`` the forward is plain causal attention, no cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import apply_rope, chunked_attention
from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What an attention function may need besides q, k, v (built inside the traced forward).

    positions: [B, T] int32 absolute positions of the current tokens.
    layer: [] int32 index of the layer being run.
    inv_freq: [D/2] float32 RoPE inverse frequencies (to un-rotate / re-rotate keys).
    cfg: the static model config.
    wo: [H*D, Dm] the layer's output projection (value-aware scoring: CriticalKV, ReST-KV), or None.
    prompt_attention: (out [B, T, H, D], column mass [B, Hkv, G, T]) of the prompt pass when a shared
        prefill already computed it (several methods' caches from one pass), else None.
    hidden: [B, T, Dm] the layer's normed attention input (what q, k, v are projected from), for methods
        that score tokens from it (learned retention gates, ``qevict_jax.rankings.gates``), or None.
    weights: the attend fn's own learned parameters (a pytree of arrays with a leading layer axis, e.g. the
        gates'), an argument of the traced program rather than constants in it, or None.
    """

    positions: jax.Array
    layer: jax.Array
    inv_freq: jax.Array
    cfg: ModelConfig
    wo: jax.Array | None = None
    prompt_attention: tuple[jax.Array, jax.Array] | None = None
    hidden: jax.Array | None = None
    weights: Any = None


TOKEN_CHUNK = 512
"""Tokens per chunk of a layer's position-wise parts (norms, projections, MLP) in a long forward pass."""

# (q [B,T,H,D] post-RoPE, k [B,T,Hkv,D] post-RoPE, v [B,T,Hkv,D], layer_cache, ctx) -> (out [B,T,H,D], cache)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any, LayerContext], tuple[jax.Array, Any]]


def read_layer(cache: Any, layer: jax.Array) -> Any:
    """One layer's slice of a stacked cache (every array leaf [L, ...] -> [...]); None stays None."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), cache)


def write_layer(cache: Any, old: Any, new: Any, layer: jax.Array) -> Any:
    """``cache`` with layer ``layer`` set to ``new``, writing only the leaves that are not ``old``'s own.

    ``old`` is ``read_layer(cache, layer)``; a leaf the attend fn passed through unchanged is the same traced
    value (``is``) and is not written. A 16-bit float leaf is written as its raw 16-bit words: XLA's CPU
    backend would otherwise convert the whole stacked buffer to float32 and back for one layer's update.
    """
    stacked, treedef = jax.tree.flatten(cache)
    before, new_leaves = jax.tree.leaves(old), jax.tree.leaves(new)
    out = []
    for buf, a, b in zip(stacked, before, new_leaves, strict=True):
        if b is a:
            out.append(buf)
            continue
        b = b.astype(buf.dtype)
        if jnp.issubdtype(buf.dtype, jnp.floating) and buf.dtype.itemsize == 2:
            words = jax.lax.bitcast_convert_type(buf, jnp.uint16)
            words = jax.lax.dynamic_update_index_in_dim(
                words, jax.lax.bitcast_convert_type(b, jnp.uint16), layer, 0
            )
            out.append(jax.lax.bitcast_convert_type(words, buf.dtype))
        else:
            out.append(jax.lax.dynamic_update_index_in_dim(buf, b, layer, 0))
    return jax.tree.unflatten(treedef, out)


def attend_stacked(
    attend: AttendFn, q, k, v, cache: Any, ctx: LayerContext, *, stacked_cache: bool
) -> tuple[jax.Array, Any]:
    """``attend`` of a method over a stacked cache ``[L, ...]``: the whole cache when the method takes it
    (``stacked_cache``), else the layer ``ctx.layer``'s slice, written back (``write_layer``)."""
    if stacked_cache:
        return attend(q, k, v, cache, ctx)
    old = read_layer(cache, ctx.layer)
    out, new = attend(q, k, v, old, ctx)
    return out, write_layer(cache, old, new, ctx.layer)


def uncached_attend(q, k, v, layer_cache, ctx: LayerContext):
    """Causal attention over the current tokens only (no cache); ``layer_cache`` is passed through."""
    out, _ = chunked_attention(
        q, k, v, q_pos=ctx.positions, k_pos=ctx.positions, sliding_window=ctx.cfg.sliding_window
    )
    return out, layer_cache


def over_token_chunks(
    fn: Callable[..., tuple[jax.Array, ...]],
    inputs: tuple[jax.Array, ...],
    chunk: int,
    state: tuple[jax.Array, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """Apply a position-wise function ``chunk`` tokens at a time.

    inputs: arrays [B, T, ...]. ``fn(state_chunk, *input_chunks)`` maps the chunks [B, C, ...] of one token
    range to the outputs' chunks. state: output buffers [B, T, ...] that ``fn`` updates (it gets their
    chunks; the buffers are updated in place: each range is read before it is written), or None for fresh
    outputs (``fn`` gets None; shapes and dtypes from ``fn`` itself). Full chunks run in a
    ``lax.fori_loop``, then the static tail. With T <= chunk this is ``fn(state, *inputs)`` on the whole
    arrays: decode steps and short prompts compute exactly what an unchunked layer does.
    """
    b, t = inputs[0].shape[:2]
    if t <= chunk:
        return tuple(fn(state, *inputs))
    if state is None:
        shapes = jax.eval_shape(lambda *a: fn(None, *a), *(a[:, :chunk] for a in inputs))
        state = tuple(jnp.zeros((b, t, *s.shape[2:]), s.dtype) for s in shapes)
        fresh = True
    else:
        fresh = False

    def run(start, size, state):
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, 1)
        new = fn(None if fresh else tuple(take(a) for a in state), *(take(a) for a in inputs))
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(a, n, start, 1) for a, n in zip(state, new, strict=True)
        )

    n, tail = divmod(t, chunk)
    state = jax.lax.fori_loop(0, n, lambda i, st: run(i * chunk, chunk, st), tuple(state))
    return run(n * chunk, tail, state) if tail else state


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32 (as Hugging Face does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """Nested dict of every parameter's shape, the checkpoint layout (linear weights are [in, out])."""
    L, dm, f = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    hq, hkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (L, dm),
        "wq": (L, dm, hq),
        "wk": (L, dm, hkv),
        "wv": (L, dm, hkv),
        "wo": (L, hq, dm),
        "mlp_norm": (L, dm),
        "w_gate": (L, dm, f),
        "w_up": (L, dm, f),
        "w_down": (L, f, dm),
    }
    if cfg.attention_bias:
        layers |= {"bq": (L, hq), "bk": (L, hkv), "bv": (L, hkv)}
    if cfg.qk_norm:
        layers |= {"q_norm": (L, cfg.head_dim), "k_norm": (L, cfg.head_dim)}
    shapes: dict[str, Any] = {
        "embed": (cfg.vocab_size, dm),
        "layers": layers,
        "final_norm": (dm,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (dm, cfg.vocab_size)
    return shapes


class DecoderLayers(nnx.Module):
    """All decoder layers' parameters, stacked on a leading [L] axis."""

    def __init__(self, cfg: ModelConfig, dtype: Any, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        for name, shape in param_shapes(cfg)["layers"].items():
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name.startswith("b"):
                value = jnp.zeros(shape, dtype)
            else:
                value = init(rngs.params(), shape, dtype)
            setattr(self, name, nnx.Param(value))
        self.names = tuple(param_shapes(cfg)["layers"])

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in self.names}


class Transformer(nnx.Module):
    """Decoder-only transformer. Params: embed [V, Dm], layers.* [L, ...], final_norm [Dm], lm_head [Dm, V]."""

    def __init__(self, cfg: ModelConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        shapes = param_shapes(cfg)
        self.embed = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shapes["embed"], dtype))
        self.layers = DecoderLayers(cfg, dtype, rngs)
        self.final_norm = nnx.Param(jnp.ones(shapes["final_norm"], dtype))
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), shapes["lm_head"], dtype))

    def _layer(
        self,
        x: jax.Array,
        p: dict[str, jax.Array],
        layer_cache: Any,
        ctx: LayerContext,
        attend: AttendFn,
        token_chunk: int,
    ) -> tuple[jax.Array, Any]:
        """One decoder layer: x [B, T, Dm] -> x [B, T, Dm].

        The position-wise parts (norms, q/k/v projections and RoPE; output projection, residuals and MLP) run
        over ``token_chunk`` tokens at a time (``over_token_chunks``), the second pass updating x in place:
        besides x, q, k, v and the attention output, a long prompt's layer holds [B, token_chunk, ...]
        temporaries (the MLP's [B, token_chunk, F]), not [B, T, F].
        """
        cfg = self.cfg
        hq, hkv = cfg.num_heads, cfg.num_kv_heads

        def project(_, xc, pos):  # xc [B, C, Dm], pos [B, C] -> q [B, C, H, D], k, v [B, C, Hkv, D]
            b, c, _ = xc.shape
            h = rms_norm(xc, p["attn_norm"], cfg.rms_norm_eps)
            q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
            if cfg.attention_bias:
                q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
            q = q.reshape(b, c, hq, cfg.head_dim)
            k = k.reshape(b, c, hkv, cfg.head_dim)
            v = v.reshape(b, c, hkv, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
            return apply_rope(q, pos, ctx.inv_freq), apply_rope(k, pos, ctx.inv_freq), v

        q, k, v = over_token_chunks(project, (x, ctx.positions), token_chunk)
        hidden = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)  # computed only if the attend fn reads it
        attn, layer_cache = attend(q, k, v, layer_cache, dataclasses.replace(ctx, wo=p["wo"], hidden=hidden))

        def output_and_mlp(state, ac):  # x [B, C, Dm], attention output [B, C, H, D] -> x [B, C, Dm]
            (xc,) = state
            xc = xc + ac.reshape(*ac.shape[:2], -1).astype(xc.dtype) @ p["wo"]
            h = rms_norm(xc, p["mlp_norm"], cfg.rms_norm_eps)
            return (xc + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"],)

        (x,) = over_token_chunks(output_and_mlp, (attn,), token_chunk, state=(x,))
        return x, layer_cache

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: Any = None,
        attend: AttendFn = uncached_attend,
        logit_index: jax.Array | None = None,
        token_chunk: int | None = None,
        weights: Any = None,
        stacked_cache: bool = False,
    ) -> tuple[jax.Array, Any]:
        """Forward pass.

        tokens, positions: [B, T] int32. cache: pytree with leading [L] axis on every array, or None.
        logit_index: [B] int32, when given only the logits at ``tokens[b, logit_index[b]]`` are computed.
        token_chunk: tokens per chunk of the position-wise parts of each layer (``_layer``); None: the module's
        ``TOKEN_CHUNK`` when traced (a bench may set it). weights: the attend fn's learned parameters
        (``LayerContext.weights``), or None. stacked_cache: the attend fn takes the whole stacked cache and
        ``ctx.layer`` (its method's ``stacked_cache``), else one layer's slice.
        Returns (logits [B, T, V] float32, or [B, V] with logit_index; the updated cache).
        """
        cfg = self.cfg
        token_chunk = token_chunk or TOKEN_CHUNK
        x = self.embed[...][tokens]
        inv_freq = jnp.asarray(cfg.inv_freq(), jnp.float32)
        stacked = self.layers.stacked()

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)

        # The stacked cache rides in the scan carry: the attend fn updates its layer in place
        # (``stacked_cache``), or reads its slice and writes back only the fields it replaced
        # (``attend_stacked``), so a decode step copies no unchanged tier (scan xs -> ys would copy all).
        def layer_attend(q, k, v, layer_cache, ctx):
            return attend_stacked(attend, q, k, v, layer_cache, ctx, stacked_cache=stacked_cache)

        def body(carry, xs):
            x, cache = carry
            p, layer = xs
            ctx = LayerContext(positions=positions, layer=layer, inv_freq=inv_freq, cfg=cfg, weights=weights)
            x, cache = self._layer(x, p, cache, ctx, layer_attend, token_chunk)
            return (x, cache), None

        (x, cache), _ = jax.lax.scan(body, (x, cache), (stacked, layer_ids))
        if logit_index is not None:
            x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)[:, 0]
        x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:  # contract with the embedding [V, Dm] as stored: no transposed copy
            logits = jnp.einsum("...d,vd->...v", x, self.embed[...], preferred_element_type=jnp.float32)
        else:
            logits = jnp.dot(x, self.lm_head[...], preferred_element_type=jnp.float32)
        return logits, cache


def to_params(model: Transformer) -> dict[str, Any]:
    """The model's parameters as a nested dict of arrays, in the checkpoint layout of ``param_shapes``."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def from_params(cfg: ModelConfig, params: dict[str, Any], dtype: Any = None) -> Transformer:
    """Build a Transformer holding ``params`` (checked against ``param_shapes(cfg)``, cast to ``dtype``)."""
    check_param_shapes(cfg, params)
    if dtype is None:
        dtype = jnp.asarray(params["embed"]).dtype
    model = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    cast = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    nnx.replace_by_pure_dict(state, cast)
    nnx.update(model, state)
    return model


def check_param_shapes(cfg: ModelConfig, params: dict[str, Any]) -> None:
    """Raise a ValueError naming every missing, unexpected or mis-shaped parameter."""
    expected = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    want = {jax.tree_util.keystr(path): shape for path, shape in expected[0]}
    got = {
        jax.tree_util.keystr(path): tuple(np.shape(a))
        for path, a in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    problems = []
    for name in sorted(want.keys() - got.keys()):
        problems.append(f"missing {name} (expected shape {want[name]})")
    for name in sorted(got.keys() - want.keys()):
        problems.append(f"unexpected {name}")
    for name in sorted(want.keys() & got.keys()):
        if want[name] != got[name]:
            problems.append(f"{name}: shape {got[name]}, expected {want[name]}")
    if problems:
        raise ValueError("checkpoint does not match the model config: " + "; ".join(problems))
