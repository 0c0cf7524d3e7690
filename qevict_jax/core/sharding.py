"""Sharded generation on a device mesh with JAX's own SPMD partitioning (``jax.sharding``).

A mesh has two axes: ``"data"`` splits the batch, ``"model"`` splits the KV heads (and with them every tier
buffer of the cache, and the attention heads) and the MLP's intermediate dimension. ``generate(...,
mesh=mesh)`` places the parameters and the inputs with ``NamedSharding`` and the jitted prefill, append and
decode loop constrain the cache pytree to ``cache_shardings`` (``jax.lax.with_sharding_constraint``); XLA
partitions the rest and inserts the collectives. Without a mesh the constraints are the identity, so one
device runs the very same jitted code, and a 1 x 1 mesh gives bit-identical results.

Custom kernels (the CPU ledger kernel, an XLA FFI call; the Pallas kernels) have no partitioning rule: left
to XLA, their inputs (the tier buffers and the ledger) would be gathered onto every device. The jitted
decode loop and append therefore run inside ``mesh_context(mesh)``, the ambient abstract mesh, and the
decode attention maps its per-tier partials over the shards with ``on_shards`` (``jax.shard_map``: each
device attends over its own rows and KV heads); the combine of the partials runs after, in plain jnp that
XLA partitions (a head-mean reduces over "model"). Nothing of the cache moves, only activations.

Parameter layout (``models.model.param_shapes``: linear weights are [in, out], stacked on [L]):

- ``wq`` [L, Dm, H*D], ``wk`` / ``wv`` [L, Dm, Hkv*D], ``bq`` / ``bk`` / ``bv`` [L, H*D | Hkv*D]: output
  columns over "model" (whole heads per device: H and Hkv are divisible by the model-axis size, and the
  query heads of a KV head sit on the same device as that head, GQA groups being contiguous).
- ``wo`` [L, H*D, Dm]: input rows over "model" (XLA all-reduces the partial products).
- ``w_gate`` / ``w_up`` [L, Dm, F]: columns over "model"; ``w_down`` [L, F, Dm]: rows over "model".
- ``embed`` [V, Dm], ``lm_head`` [Dm, V], every norm: replicated.

Cache layout: every cache leaf is stacked on [L] and has the batch on axis 1 (over "data"); a leaf with a
KV-head axis has it on axis 2 (over "model"). Which leaf has one is written down per field in
``CACHE_LAYOUTS``, from the documented layouts of ``FullCache``, ``SinkRingCache``, ``TieredCache``,
``Ledger`` / ``QuantizedWindows`` and ``PoolCache``; a field missing from the table is an error, not a guess.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from pallas_kernels.quant import QuantizedWindows
from qevict_jax.core.cache import Ledger, PoolCache, SinkRingCache, TieredCache
from qevict_jax.core.kv import FullCache

DATA, MODEL = "data", "model"

HEADS = "heads"  # [L, B, Hkv, ...]: batch over "data", KV heads over "model"
BATCH = "batch"  # [L, B, ...]: batch over "data", the rest replicated

_SINK_RING = {
    "sink_k": HEADS,  # [L, B, Hkv, S, D]
    "sink_v": HEADS,  # [L, B, Hkv, S, D]
    "ring_k": HEADS,  # [L, B, Hkv, RING, D]
    "ring_v": HEADS,  # [L, B, Hkv, RING, D]
    "length": BATCH,  # [L, B]
    "next_win": BATCH,  # [L, B]
    "steps": BATCH,  # [L, B]
    "routing_events": BATCH,  # [L, B]
    "evictions": BATCH,  # [L, B]
}

CACHE_LAYOUTS: dict[type, dict[str, str]] = {
    FullCache: {"k": HEADS, "v": HEADS, "length": BATCH},  # k, v [L, B, Hkv, C, D]; length [L, B]
    SinkRingCache: _SINK_RING,
    TieredCache: _SINK_RING
    | {
        "ring_score": BATCH,  # [L, B, RW]
        "f_k_words": HEADS,  # [L, B, Hkv, NF, W, D]
        "f_v_words": HEADS,  # [L, B, Hkv, NF, W, D]
        "f_win": BATCH,  # [L, B, NF]
        "f_score": BATCH,  # [L, B, NF]
        "ledger": "nested",  # Ledger
        "promotions": BATCH,  # [L, B]
        "demotions": BATCH,  # [L, B]
        "f_pending": HEADS,  # [L, B, Hkv, NF | 0]
        "q_pending": HEADS,  # [L, B, Hkv, NL | 0]
        "ring_pending": HEADS,  # [L, B, Hkv, RW | 0]
    },
    Ledger: {
        "codes": "nested",  # QuantizedWindows
        "win": BATCH,  # [L, B, NL]
        "active": BATCH,  # [L, B, NL]
        "score": BATCH,  # [L, B, NL]
        "norm_score": BATCH,  # [L, B, NL | 0]
    },
    QuantizedWindows: {
        "k_codes": HEADS,  # [L, B, Hkv, NL, D, W*bits/8]
        "k_scale": HEADS,  # [L, B, Hkv, NL, D]
        "k_zero": HEADS,  # [L, B, Hkv, NL, D]
        "v_codes": HEADS,  # [L, B, Hkv, NL, W, D*bits/8]
        "v_scale": HEADS,  # [L, B, Hkv, NL, W]
        "v_zero": HEADS,  # [L, B, Hkv, NL, W]
        "k_mean": HEADS,  # [L, B, Hkv, NL, D] (centered format only; else None)
    },
    PoolCache: _SINK_RING
    | {
        # the pool is flat over (KV head, slot) pairs, NP = Hkv * pool_per_head, with its owner in pool_head:
        # a slot's head is data, not an axis, so the pool is split over the batch only
        "pool_k": BATCH,  # [L, B, NP, D]
        "pool_v": BATCH,  # [L, B, NP, D]
        "pool_pos": BATCH,  # [L, B, NP]
        "pool_head": BATCH,  # [L, B, NP]
        "pool_score": BATCH,  # [L, B, NPS]
        "ring_head_score": HEADS,  # [L, B, Hkv, RS]
    },
}

_SPECS = {HEADS: P(None, DATA, MODEL), BATCH: P(None, DATA)}

ROWS = P(DATA)  # [B, ...] one layer's per-row array: rows over "data"
ROW_HEADS = P(DATA, MODEL)  # [B, Hkv, ...] one layer's per-head array: rows over "data", KV heads over "model"
REPLICATED = P()


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``data`` x ``model`` mesh with axes ("data", "model") over the first data * model of ``devices``
    (default ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
    if data * model > len(devices):
        raise ValueError(f"a {data} x {model} mesh needs {data * model} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[: data * model], dtype=object).reshape(data, model), (DATA, MODEL))


def axis_size(mesh: Mesh, axis: str) -> int:
    return int(mesh.shape[axis])


def param_specs(cfg: ModelConfig, mesh: Mesh | None = None) -> dict[str, Any]:
    """PartitionSpecs of every parameter, nested as ``models.model.param_shapes(cfg)`` (see the module doc).

    With ``mesh``, checks that the split dimensions divide evenly by its "model" axis: a ValueError names
    the axis and the dimension otherwise."""
    if mesh is not None:
        m = axis_size(mesh, MODEL)
        for what, n in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads)):
            if n % m:
                raise ValueError(f"{what}={n} is not divisible by the size {m} of the mesh axis {MODEL!r}")
        if cfg.intermediate_size % m:
            raise ValueError(
                f"intermediate_size={cfg.intermediate_size} is not divisible by the size {m} of the mesh "
                f"axis {MODEL!r}"
            )
    cols, rows, vec, rep = P(None, None, MODEL), P(None, MODEL, None), P(None, MODEL), P()
    layers = {
        "attn_norm": rep,
        "wq": cols,
        "wk": cols,
        "wv": cols,
        "wo": rows,
        "mlp_norm": rep,
        "w_gate": cols,
        "w_up": cols,
        "w_down": rows,
    }
    if cfg.attention_bias:
        layers |= {"bq": vec, "bk": vec, "bv": vec}
    if cfg.qk_norm:
        layers |= {"q_norm": rep, "k_norm": rep}
    specs: dict[str, Any] = {"embed": rep, "layers": layers, "final_norm": rep}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = rep
    return specs


def shard_state(state: nnx.State, cfg: ModelConfig, mesh: Mesh) -> nnx.State:
    """A copy of a model's parameter state (``nnx.split(model)[1]``) placed on ``mesh`` by ``param_specs``."""
    specs = param_specs(cfg, mesh)
    pure = nnx.to_pure_dict(state)
    placed = jax.tree.map(lambda a, s: put(a, NamedSharding(mesh, s)), pure, specs)
    out = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(out, placed)
    return out


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place ``model``'s parameters on ``mesh`` in place (``param_specs``) and return it."""
    _, state = nnx.split(model)
    nnx.update(model, shard_state(state, model.cfg, mesh))
    return model


def cache_specs(cache: Any) -> Any:
    """The PartitionSpec of every leaf of a stacked cache pytree (same structure; ``CACHE_LAYOUTS``).

    A tuple (a shared prefill's caches) maps over its members; None stays None."""
    if cache is None:
        return None
    if isinstance(cache, tuple):
        return tuple(cache_specs(c) for c in cache)
    layout = CACHE_LAYOUTS.get(type(cache))
    if layout is None:
        raise ValueError(
            f"no sharding layout for a cache of type {type(cache).__name__}; add it to CACHE_LAYOUTS"
        )
    specs = {}
    for f in dataclasses.fields(cache):
        if not f.metadata.get("pytree_node", True):
            continue
        if f.name not in layout:
            raise ValueError(f"{type(cache).__name__}.{f.name} has no sharding layout in CACHE_LAYOUTS")
        kind = layout[f.name]
        value = getattr(cache, f.name)
        if value is None:  # an optional field the cache does not have (no leaf, no spec)
            specs[f.name] = None
            continue
        specs[f.name] = cache_specs(value) if kind == "nested" else _SPECS[kind]
    return cache.replace(**specs)


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """The NamedSharding of every leaf of ``cache`` on ``mesh`` (``cache_specs``), after checking that the
    batch divides by the "data" axis and the KV heads by the "model" axis (ValueError naming the axis)."""
    data, model = axis_size(mesh, DATA), axis_size(mesh, MODEL)

    def one(x, spec: P) -> NamedSharding:
        if x.shape[1] % data:
            raise ValueError(
                f"batch {x.shape[1]} is not divisible by the size {data} of the mesh axis {DATA!r}"
            )
        if len(spec) > 2 and x.shape[2] % model:
            raise ValueError(
                f"{x.shape[2]} KV heads are not divisible by the size {model} of the mesh axis {MODEL!r}"
            )
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, cache, cache_specs(cache))


def constrain_cache(cache: Any, mesh: Mesh | None) -> Any:
    """``cache`` constrained to ``cache_shardings`` under jit; the identity without a mesh."""
    if mesh is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))


def constrain_rows(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """An array with the batch on axis 0 ([B, ...]) constrained to split it over "data"; identity without."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA)))


def check_batch(batch: int, mesh: Mesh | None) -> None:
    """A clear error when ``batch`` rows do not divide over the mesh's "data" axis."""
    if mesh is not None and batch % axis_size(mesh, DATA):
        raise ValueError(
            f"batch {batch} is not divisible by the size {axis_size(mesh, DATA)} of the mesh axis {DATA!r}"
        )


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """``x`` (a host value or an array, the same full value on every process) as a global array placed by
    ``sharding``, whose mesh may span processes (``jax.distributed``).

    ``jax.device_put`` only takes a sharding of this process's devices from a host value, so on a mesh that
    spans processes each process builds its own shards from its copy (``jax.make_array_from_callback``); a
    random key travels as its key data. An array that already spans processes is resharded."""
    if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding), impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of an array as a numpy array on this process: gathered from every process when its
    shards live on several (``multihost_utils.process_allgather``, a collective: every process calls it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def place_rows(x: Any, mesh: Mesh | None) -> jax.Array:
    """A host array with the batch on axis 0 on the device(s): split over "data" on a mesh."""
    if mesh is None:
        return jnp.asarray(x)
    return put(x, NamedSharding(mesh, P(DATA)))


def place_replicated(x: Any, mesh: Mesh | None) -> jax.Array:
    """``x`` on the device(s): replicated over a mesh."""
    if mesh is None:
        return jnp.asarray(x) if not isinstance(x, jax.Array) else x
    return put(x, NamedSharding(mesh, P()))


def mesh_context(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """``mesh`` as the ambient abstract mesh (``jax.sharding.use_abstract_mesh``, usable under jit) that
    ``on_shards`` maps over; a no-op without a mesh."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def on_shards(
    fn: Callable, *, in_specs: Any, out_specs: Any, axes: tuple[str, ...] = (DATA, MODEL)
) -> Callable:
    """``fn`` per shard of the ambient mesh (``mesh_context``) by ``jax.shard_map`` with these specs (pytree
    prefixes of its arguments and results, e.g. ``ROW_HEADS`` for [B, Hkv, ...]); ``fn`` itself without an
    ambient ("data", "model") mesh or on one device, so one device runs the code it ran before.

    ``axes``: the mesh axes ``fn`` is mapped over (the others stay XLA's to partition inside it). ``fn`` must
    compute each output shard from its input shards alone along those axes (per row; per KV head too, e.g.
    attention partials). ``check_vma`` is off: the FFI and Pallas calls inside have no varying-axes rule.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or set(mesh.axis_names) != {DATA, MODEL} or mesh.size == 1:
        return fn
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes), check_vma=False
    )


def row_specs(cache: Any) -> Any:
    """The spec of every leaf of a stacked cache ([L, B, ...]) split over "data" only: its rows, for a
    function mapped over the rows (``on_shards(..., axes=(DATA,))``; the KV heads stay XLA's)."""
    return jax.tree.map(lambda _: P(None, DATA), cache)
