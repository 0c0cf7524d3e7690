"""The cache pytrees of the budgeted methods, their constructor and abstract shapes, and the sink and ring
helpers both engines share (docs/design.md §5).

Per layer and batch row a cache holds sink tokens, a ring (recent region + the window being filled +
the windows that left the recent region since the last routing event) and the counters (``SinkRingCache``),
and the history in the tiers of one of two engines: ``TieredCache``, the window engine
(``qevict_jax.engines.window``: F windows in full precision, post-RoPE, and the ledger of INT2/INT4 windows, keys
pre-RoPE; active = Q tier, dormant = codes kept for a promoted window), or ``PoolCache``, the token pool of
the per-head eviction baselines (``qevict_jax.engines.pool``). Window w covers absolute positions
``[S + wW, S + (w+1)W)``; positions are never renumbered.

Scores are kept per slot (``f_score`` [B, NF], ``ledger.score`` [B, NL], ``ring_score`` [B, RING/W]) and move
with their window, not in one array indexed by window id: evicted windows never come back, so nothing is
lost, and the cache size does not grow with the maximum sequence length (at a fixed byte budget NF and NQ
are the same for any length).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

import chex
import jax
import jax.numpy as jnp
from flax import struct

from models.attention import prompt_attention
from models.config import ModelConfig
from models.model import LayerContext
from pallas_kernels.quant import QuantizedWindows
from qevict_jax.core.config import CacheConfig, Capacities
from qevict_jax.core.kv import CacheRequest, from_words, to_words


@struct.dataclass
class Ledger:
    """The persistent ledger of INT2/INT4 windows of one layer: NL entries, each free (win -1), active (in the
    Q tier) or dormant (the codes of a window promoted to F, kept for its next demotion). Stacked caches
    carry a leading [L] axis on every array.

    codes: ``QuantizedWindows`` [B, Hkv, NL, ...] in the format ``caps.format`` (``pallas_kernels.formats``). win: [B, NL] int32 window id, -1 = free. active: [B, NL] bool.
    score: [B, NL] f32 ranking score (meaningful for active entries).
    norm_score: [B, NL | 0] f32 minus the mean key norm of each entry's window, set when it is quantized and
    never changed (``caps.norm_scored``: the Q key reads it, ``q_keys.QKey``; else 0 wide).
    """

    codes: QuantizedWindows
    win: jax.Array
    active: jax.Array
    score: jax.Array
    norm_score: jax.Array

    def slot_start(self, sink: int, window: int) -> jax.Array:
        """[B, NL] absolute position of each entry's first token (window w starts at S + wW)."""
        return sink + self.win * window


@struct.dataclass
class SinkRingCache:
    """What every budgeted cache keeps of one layer: the sink tokens, the ring and the counters (stacked
    caches carry a leading [L] axis on every array field). S = sink, RING = ring slots."""

    sink_k: jax.Array  # [B, Hkv, S, D] model dtype, post-RoPE, slot = position
    sink_v: jax.Array  # [B, Hkv, S, D]
    ring_k: jax.Array  # [B, Hkv, RING, D] post-RoPE; position p >= S lives in slot (p - S) % RING
    ring_v: jax.Array  # [B, Hkv, RING, D]
    length: jax.Array  # [B] int32 tokens seen
    next_win: jax.Array  # [B] int32 first window id still in the ring (lower ids have been routed)
    steps: jax.Array  # [B] int32 decode steps since prefill
    routing_events: jax.Array  # [B] int32 decode routing events
    evictions: jax.Array  # [B] int32 windows (tokens, in the pool) evicted, prefill included
    caps: Capacities = struct.field(pytree_node=False)


@struct.dataclass
class TieredCache(SinkRingCache):
    """The window engine's cache (``qevict_jax.engines.window``): sinks, ring, F windows and the ledger of one layer.
    RW = RING / W, NF = F slots, NL = ledger slots."""

    ring_score: jax.Array  # [B, RW] f32 score of the window in each ring window slot (window w -> w % RW)
    f_k_words: jax.Array  # [B, Hkv, NF, W, D] F tier, post-RoPE, in the storage form of the KV dtype (``f_k``)
    f_v_words: jax.Array  # [B, Hkv, NF, W, D] (``f_v``)
    f_win: jax.Array  # [B, NF] int32 window id in each F slot, -1 = empty
    f_score: jax.Array  # [B, NF] f32
    ledger: Ledger  # the Q tier and the dormant codes of promoted windows
    promotions: jax.Array  # [B] int32 Q -> F transitions
    demotions: jax.Array  # [B] int32 F -> Q transitions
    # with ``caps.deferred_head_mean`` the masses of the decode steps since the last routing event, per KV
    # head, for each F slot, ledger slot and ring window (folded into the scores by ``fold_head_means``);
    # else the last axis is 0
    f_pending: jax.Array  # [B, Hkv, NF | 0] f32
    q_pending: jax.Array  # [B, Hkv, NL | 0] f32
    ring_pending: jax.Array  # [B, Hkv, RW | 0] f32

    # The F tier is stored as 16-bit words (``kv.to_words``, as Full-KV's cache): routing scatters windows
    # into it, and XLA's CPU backend converts a whole bf16 buffer to f32 and back around every scatter.

    @property
    def f_k(self) -> jax.Array:
        """[B, Hkv, NF, W, D] the F tier's keys in the KV dtype (that of the ring)."""
        return from_words(self.f_k_words, self.ring_k.dtype)

    @property
    def f_v(self) -> jax.Array:
        """[B, Hkv, NF, W, D] the F tier's values in the KV dtype."""
        return from_words(self.f_v_words, self.ring_v.dtype)


@struct.dataclass
class PoolCache(SinkRingCache):
    """The token-pool engine's cache (``qevict_jax.engines.pool``): sinks, ring and a pool of NP = Hkv * pool_per_head
    token slots of one layer, each owned by one KV head."""

    pool_k: jax.Array  # [B, NP, D] post-RoPE key of one KV head at one position
    pool_v: jax.Array  # [B, NP, D]
    pool_pos: jax.Array  # [B, NP] int32 absolute position, -1 = empty
    pool_head: jax.Array  # [B, NP] int8 owning KV head
    pool_score: jax.Array  # [B, NPS] f32 running score (NPS = NP with decode-time eviction, else 0)
    ring_head_score: jax.Array  # [B, Hkv, RS] f32 per-head score of each ring slot (RS = RING or 0, as NPS)


def init_cache(
    caps: Capacities,
    model_cfg: ModelConfig,
    batch: int,
    dtype: Any,
    lengths: jax.Array | None = None,
) -> TieredCache | PoolCache:
    """An empty stacked cache (a ``PoolCache`` when ``caps.pool``, else a ``TieredCache``): every array field
    has a leading [L] axis. lengths: [B] tokens seen."""
    L, hkv, d = model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim
    b, w, nf, nl = batch, caps.window, caps.nf, caps.nl
    shapes = caps.format.field_shapes(w, d)  # trailing shape of every ledger field

    def z(shape, dt):
        return jnp.zeros((L, b, *shape), dt)

    if lengths is None:
        lengths = jnp.zeros((b,), jnp.int32)
    counter = z((), jnp.int32)
    common = dict(
        sink_k=z((hkv, caps.sink, d), dtype),
        sink_v=z((hkv, caps.sink, d), dtype),
        ring_k=z((hkv, caps.ring, d), dtype),
        ring_v=z((hkv, caps.ring, d), dtype),
        length=jnp.broadcast_to(lengths.astype(jnp.int32), (L, b)),
        next_win=counter,
        steps=counter,
        routing_events=counter,
        evictions=counter,
        caps=caps,
    )
    if caps.pool:
        npool = hkv * caps.pool_per_head
        nps = npool if caps.pool_scores else 0
        return PoolCache(
            **common,
            pool_k=z((npool, d), dtype),
            pool_v=z((npool, d), dtype),
            pool_pos=jnp.full((L, b, npool), -1, jnp.int32),
            pool_head=jnp.broadcast_to(
                (jnp.arange(npool, dtype=jnp.int32) // max(1, caps.pool_per_head)).astype(jnp.int8),
                (L, b, npool),
            ),
            pool_score=z((nps,), jnp.float32),
            ring_head_score=z((hkv, caps.ring if caps.pool_scores else 0), jnp.float32),
        )
    return TieredCache(
        **common,
        ring_score=z((caps.ring_windows,), jnp.float32),
        f_k_words=to_words(z((hkv, nf, w, d), dtype), dtype),
        f_v_words=to_words(z((hkv, nf, w, d), dtype), dtype),
        f_win=jnp.full((L, b, nf), -1, jnp.int32),
        f_score=z((nf,), jnp.float32),
        ledger=Ledger(
            codes=QuantizedWindows(
                **{
                    # packed codes are bytes, grids and key means float16; a field the format lacks is None
                    f.name: z(
                        (hkv, nl, *getattr(shapes, f.name)), jnp.uint8 if "codes" in f.name else jnp.float16
                    )
                    for f in dataclasses.fields(shapes)
                    if getattr(shapes, f.name) is not None
                }
            ),
            win=jnp.full((L, b, nl), -1, jnp.int32),
            active=z((nl,), bool),
            score=z((nl,), jnp.float32),
            norm_score=z((nl if caps.norm_scored else 0,), jnp.float32),
        ),
        promotions=counter,
        demotions=counter,
        **{
            name: z((hkv, n if caps.deferred_head_mean else 0), jnp.float32)
            for name, n in (("f_pending", nf), ("q_pending", nl), ("ring_pending", caps.ring_windows))
        },
    )


class SizedByCapacities(abc.ABC):
    """Base of the methods whose cache is a ``TieredCache`` or ``PoolCache`` sized by their ``capacities``:
    the protocol's sizing, budget and routing-event answers from what a subclass declares (its static
    configuration ``cache``, ``uses_budget``, ``capacities`` and ``route``)."""

    cache: CacheConfig
    stacked_cache: ClassVar[bool] = False  # attend fns see one layer's slice (``models.model.write_layer``)

    @property
    @abc.abstractmethod
    def uses_budget(self) -> bool:
        """Sized by a byte budget β (``CacheConfig.budget``)."""

    @abc.abstractmethod
    def capacities(self, request: CacheRequest) -> Capacities:
        """Static buffer sizes for a request."""

    @abc.abstractmethod
    def route(self, cache: Any, inv_freq: jax.Array, due: jax.Array | None = None) -> Any:
        """A routing event on the stacked cache (every layer), where ``due`` (None: always)."""

    @property
    def budget(self) -> float | None:
        """β of a budgeted method (``cache.budget``); None for one that keeps what it keeps (KIVI)."""
        return float(self.cache.budget) if self.uses_budget else None

    def at_budget(self, beta: float) -> Any:
        """This method at β = ``beta``; None where its size is no β (KIVI keeps what it keeps; a fixed
        ``budget_bytes`` overrides β)."""
        if not self.uses_budget or self.cache.budget_bytes is not None:
            return None
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache, budget=beta))

    def init_cache(self, request: CacheRequest, prompt_lengths: jax.Array) -> TieredCache | PoolCache:
        """Empty stacked cache sized by ``capacities(request)``; ``prompt_lengths`` [B] int32."""
        chex.assert_shape(prompt_lengths, (request.batch,))
        caps = self.capacities(request)
        cache = init_cache(caps, request.model_cfg, request.batch, request.dtype, prompt_lengths)
        chex.assert_tree_shape_prefix(cache, (request.model_cfg.num_layers, request.batch))  # [L, B, ...]
        return cache

    def routing_due(self, cache: TieredCache) -> jax.Array:
        """[] bool: the step just taken brings the decode step count to a multiple of Ω (every row and layer
        counts the same steps), so a routing event is due now."""
        if not cache.caps.decode_routing:
            return jnp.bool_(False)
        return jnp.mod(cache.steps[0, 0], cache.caps.omega) == 0

    def decode_route(self, cache: TieredCache | PoolCache, inv_freq: jax.Array) -> TieredCache | PoolCache:
        """After a decode step of every layer, outside the layer scan: ``route(cache, inv_freq, due)`` with
        ``due`` = a routing event is due now (``routing_due``). How a step without one costs nothing is the
        method's ``route``: a conditional around the event, or moves masked by ``due``."""
        if not cache.caps.decode_routing:
            return cache
        return self.route(cache, inv_freq, due=self.routing_due(cache))


def abstract_cache(
    caps: Capacities, model_cfg: ModelConfig, batch: int, dtype: Any
) -> TieredCache | PoolCache:
    """Shapes and dtypes of the stacked cache, without allocating (``jax.eval_shape``)."""
    return jax.eval_shape(lambda: init_cache(caps, model_cfg, batch, dtype))


# ---------------------------------------------------------------------------------------------- sink and ring


def ring_positions(length: jax.Array, caps: Capacities) -> jax.Array:
    """Absolute position held by each ring slot: [B] lengths -> [B, RING] (the newest position <= n - 1
    congruent to the slot; may be < S, i.e. never written)."""
    j = jnp.arange(caps.ring, dtype=jnp.int32)
    n1 = length[:, None] - 1
    return n1 - jnp.mod(n1 - caps.sink - j, caps.ring)


def ring_valid(length: jax.Array, next_win: jax.Array, caps: Capacities) -> jax.Array:
    """[B, RING] bool: slot holds a token of a window not routed yet."""
    pos = ring_positions(length, caps)
    return (pos >= caps.sink) & (pos >= caps.sink + next_win[:, None] * caps.window)


def window_mask(q_pos: jax.Array, k_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """[B, N] keys within the sliding window of the query at q_pos [B] (all True without one)."""
    if sliding_window is None:
        return jnp.ones(k_pos.shape, bool)
    return q_pos[:, None] - k_pos < sliding_window


def write_slot(buf: jax.Array, x: jax.Array, slot: jax.Array, enabled: jax.Array) -> jax.Array:
    """buf [B, Hkv, N, D] with x [B, Hkv, D] written at slot [B] where enabled [B]."""
    hit = (jnp.arange(buf.shape[2])[None, :] == slot[:, None]) & enabled[:, None]
    return jnp.where(hit[:, None, :, None], x[:, :, None, :].astype(buf.dtype), buf)


def shared_prompt_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, ctx: LayerContext, chunk: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(out [B, T, H, D], column mass [B, Hkv, G, T], q, k, v) of the prompt pass: ``ctx.prompt_attention``
    when a shared prefill computed it, else ``models.attention.prompt_attention``.

    q, k, v come back through a ``lax.optimization_barrier`` with the attention output: what the caller
    computes from them (scores, window copies, quantization) is then scheduled after the attention, and its
    temporaries never coexist with the attention's blocks (XLA's scheduler hoisted them there: measured).
    The mass stays outside the barrier, so that XLA still drops its pass when the caller does not read it.
    """
    if ctx.prompt_attention is not None:
        out, mass = ctx.prompt_attention
    else:
        out, mass = prompt_attention(
            q, k, v, positions=ctx.positions, lengths=lengths, sliding_window=ctx.cfg.sliding_window, chunk=chunk
        )
    out, q, k, v = jax.lax.optimization_barrier((out, q, k, v))
    return out, mass, q, k, v


def fill_sink_and_ring(
    cache: TieredCache, k: jax.Array, v: jax.Array, lengths: jax.Array, routed: jax.Array
) -> tuple[TieredCache, jax.Array]:
    """After a prompt pass: the first S tokens into the sinks, the unrouted tail into the ring.

    k, v [B, T, Hkv, D] post-RoPE (right-padded rows, row b holds ``lengths[b]`` tokens); routed [B]: the
    prompt's windows (window layouts) or tokens (pool layout, W = 1) that already left the ring.
    Returns (cache with sink_k/v, ring_k/v and next_win set, ring_ok [B, RING]: slots holding a token).
    """
    caps = cache.caps
    s = caps.sink
    b, t = k.shape[:2]

    def take(x, idx):  # tokens idx [B, N] of x [B, T, Hkv, D] -> [B, Hkv, N, D]; no transposed prompt copy
        return jnp.take_along_axis(x, jnp.clip(idx, 0, t - 1)[:, :, None, None], axis=1).swapaxes(1, 2)

    sink_pos = jnp.arange(s, dtype=jnp.int32)
    sink_ok = (sink_pos[None] < lengths[:, None])[:, None, :, None]
    sink_idx = jnp.broadcast_to(sink_pos, (b, s))
    ring_pos = ring_positions(lengths, caps)
    ring_ok = ring_valid(lengths, routed, caps)
    cache = cache.replace(
        sink_k=jnp.where(sink_ok, take(k, sink_idx), 0).astype(cache.sink_k.dtype),
        sink_v=jnp.where(sink_ok, take(v, sink_idx), 0).astype(cache.sink_v.dtype),
        ring_k=jnp.where(ring_ok[:, None, :, None], take(k, ring_pos), 0).astype(cache.ring_k.dtype),
        ring_v=jnp.where(ring_ok[:, None, :, None], take(v, ring_pos), 0).astype(cache.ring_v.dtype),
        next_win=routed.astype(jnp.int32),
    )
    return cache, ring_ok


def write_token(cache: TieredCache, pos: jax.Array, k: jax.Array, v: jax.Array) -> TieredCache:
    """A decode step's token k, v [B, Hkv, D] (post-RoPE, at positions pos [B]) into the sink or the ring;
    ``length = pos + 1``."""
    caps = cache.caps
    in_sink = pos < caps.sink
    ring_slot = jnp.mod(pos - caps.sink, caps.ring)
    return cache.replace(
        sink_k=write_slot(cache.sink_k, k, pos, in_sink),
        sink_v=write_slot(cache.sink_v, v, pos, in_sink),
        ring_k=write_slot(cache.ring_k, k, ring_slot, ~in_sink),
        ring_v=write_slot(cache.ring_v, v, ring_slot, ~in_sink),
        length=pos + 1,
    )
