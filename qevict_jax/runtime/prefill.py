"""The prompt side of generation: host-side preparation of the prompts (checks, padding to a length bucket,
the budget's token count, the question split), the jitted prompt pass that builds a method's cache
(``prefill_jit``; several methods' caches from one pass with ``fanout.Fanout``), and the jitted append of a chunk of
tokens to a compressed cache (``append_jit``: a question after the context, a new turn).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.model import Transformer
from qevict_jax.core.budget import BudgetTooSmallError
from qevict_jax.core.kv import CacheRequest, KVMethod, cache_nbytes, full_kv_bytes
from qevict_jax.core.sharding import Mesh, constrain_cache, mesh_context, place_replicated, place_rows
from qevict_jax.rankings.reconstruction import reconstructing_prefill
from qevict_jax.runtime.compiled import EXECUTABLES, bucket_floor, bucket_length
from qevict_jax.runtime.fanout import shared_reconstruction
from qevict_jax.runtime.sampling import SamplerConfig, sample

# ---------------------------------------------------------------------------------------------- host side


def check_prompts(
    prompts: Sequence[Sequence[int]], model_cfg, sampler: SamplerConfig, offsets: Sequence[int] | None = None
) -> None:
    """Raise a clear error for empty prompts or prompts that do not fit the model's context (``offsets``:
    tokens already in each row's cache, for a continued conversation)."""
    if not prompts:
        raise ValueError("no prompts given")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        before = offsets[i] if offsets is not None else 0
        total = before + len(p) + sampler.max_new_tokens
        if total > model_cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {before} + {len(p)} tokens + {sampler.max_new_tokens} new tokens = {total}, "
                f"more than the model's context capacity of {model_cfg.max_position_embeddings} tokens"
            )
        bad = [t for t in p if not 0 <= t < model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {model_cfg.vocab_size}): {bad[:5]}")


def split_questions(
    prompts: Sequence[Sequence[int]], question_starts: Sequence[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """(contexts, questions): each prompt cut at its question start (checked: 0 < start < len)."""
    if len(question_starts) != len(prompts):
        raise ValueError(f"give one question start per prompt: {len(question_starts)} for {len(prompts)}")
    for i, (p, qs) in enumerate(zip(prompts, question_starts, strict=True)):
        if not 0 < qs < len(p):
            raise ValueError(
                f"prompt {i}: question start {qs} is outside (0, {len(p)}): no context or no question"
            )
    pairs = list(zip(prompts, question_starts, strict=True))
    return [list(p[:qs]) for p, qs in pairs], [list(p[qs:]) for p, qs in pairs]


def tokens_for_budget(
    method: KVMethod, lengths: np.ndarray, max_new_tokens: int, budget_rounding: str
) -> int:
    """Tokens per row a budgeted method sizes its cache for (0 for methods without a budget)."""
    if not method.uses_budget:
        return 0
    if budget_rounding not in ("bucket", "exact"):
        raise ValueError(f"budget_rounding must be 'bucket' or 'exact', got {budget_rounding!r}")
    shortest = int(lengths.min())
    base = bucket_floor(shortest) if budget_rounding == "bucket" else shortest
    return base + max_new_tokens


def planned_cache(
    method: KVMethod,
    *,
    model_cfg,
    lengths: np.ndarray,
    max_new_tokens: int,
    kv_dtype: Any,
    budget_rounding: str = "bucket",
) -> Any:
    """The cache ``generate`` builds for prompts of ``lengths`` [B] as a pytree of ``jax.ShapeDtypeStruct``
    (``jax.eval_shape`` of the method's constructor: nothing is allocated); raises what the sizing raises."""
    lengths = np.asarray(lengths, np.int32)
    request = CacheRequest(
        model_cfg=model_cfg,
        batch=len(lengths),
        prompt_capacity=bucket_length(int(lengths.max())),
        max_new_tokens=max_new_tokens,
        dtype=kv_dtype,
        budget_tokens=tokens_for_budget(method, lengths, max_new_tokens, budget_rounding),
    )
    return jax.eval_shape(lambda: method.init_cache(request, jnp.asarray(lengths)))


@dataclasses.dataclass(frozen=True)
class Fit:
    """What runs for a batch of prompts: ``method`` (the one asked for; the same method at the least β that
    holds its smallest cache; or Full-KV when compressing this batch could save nothing), whether the cache
    it builds is compressed, and ``note``: one line saying why the β changed (None when it did not)."""

    method: KVMethod
    compressed: bool
    note: str | None = None


def fit_method(
    method: KVMethod,
    *,
    model_cfg,
    lengths: np.ndarray,
    max_new_tokens: int,
    budget_rounding: str,
    kv_dtype: Any,
    least_beta: bool = True,
    growing: bool = False,
) -> Fit:
    """The method to run for prompts of ``lengths`` [B] (right-padded to their bucket), before any compute.

    A budgeted method keeps sinks and a recent region uncompressed and needs room for one unit of history
    beside them. When that smallest cache is at least as large as the uncompressed cache of the longest row
    (prompt + ``max_new_tokens``), compression has nothing to save, and when only a β above 1 could hold it,
    no budget can: in both cases everything is kept, by Full-KV (``compressed`` False).

    When the sequence is long enough to compress but β cannot hold that smallest cache, the method runs at the
    least β that can (``least_beta``, what ``generate`` does; ``note`` names both β), or, with ``least_beta``
    False (an evaluation, whose cells must run at the β they are labelled with), a ValueError says so in terms
    of the prompt, the budget and what to change. A fixed ``budget_bytes`` too small for the smallest cache is
    always that ValueError: a size given in bytes is not raised behind the caller's back.

    ``growing``: the sequence is a conversation that will grow; it is compressed only once the method's cache
    is smaller than the uncompressed sequence, so that a fixed ``budget_bytes`` larger than the conversation
    so far is reached before it is used (at a β below 1 the cache is always smaller, so this changes nothing).
    Sizing is checked on the abstract cache (``jax.eval_shape``), so any other sizing error surfaces here too.
    """
    lengths = np.asarray(lengths, np.int32)
    plan = functools.partial(
        planned_cache,
        model_cfg=model_cfg,
        lengths=lengths,
        max_new_tokens=max_new_tokens,
        budget_rounding=budget_rounding,
        kv_dtype=kv_dtype,
    )
    whole = full_kv_bytes(model_cfg, int(lengths.max()) + max_new_tokens, kv_dtype, len(lengths))
    try:
        planned = plan(method)
    except BudgetTooSmallError as err:
        if err.min_bytes >= whole or err.min_beta > 1:  # no beta in (0, 1] could compress it
            return Fit(method.uncompressed(), False)
        raised = method.at_budget(err.min_beta) if least_beta else None
        if raised is not None:
            plan(raised)  # the least β holds the smallest cache by construction: any error here is a bug
            n = int(lengths.min())
            prompt = f"a {n}-token prompt" if len(lengths) == 1 else f"prompts of {n} tokens and more"
            note = (
                f"{method.name} at β={method.budget:g} cannot hold its smallest cache ({err.holds}) for "
                f"{prompt} + {max_new_tokens} new tokens: compressed at β={err.min_beta:g}, the least that "
                "holds it"
            )
            return Fit(raised, True, note)
        raise ValueError(_too_small(method, err, int(lengths.min()), max_new_tokens, len(lengths))) from err
    if growing and method.compresses and cache_nbytes(planned) >= whole:
        return Fit(method.uncompressed(), False)
    return Fit(method, method.compresses)


def _too_small(method: KVMethod, err: BudgetTooSmallError, tokens: int, new: int, batch: int) -> str:
    """Why ``method``'s budget cannot compress prompts of ``tokens`` (+ ``new``) tokens; what to change."""
    shrink = ""
    if "recent" in method.options:
        shrink = " shrink the recent region (option recent, e.g. recent=32),"
    if method.at_budget(err.min_beta) is None:  # a size in bytes
        return (
            f"{method.name} with budget_bytes={err.budget_bytes // batch} cannot compress prompts of "
            f"{tokens} tokens (+ {new} new): its smallest cache ({err.holds}) needs "
            f"{-(-err.min_bytes // batch)} bytes per row; raise budget_bytes to at least that,{shrink} or "
            "use the method full"
        )
    return (
        f"{method.name} at β={method.budget:g} cannot compress prompts of {tokens} tokens "
        f"(+ {new} new): β={method.budget:g} of their uncompressed {err.full_bytes} bytes is "
        f"{err.budget_bytes} bytes, and its smallest cache ({err.holds}) needs {err.min_bytes}; raise the "
        f"budget to β >= {err.min_beta:.4f},{shrink} or use the method full"
    )


def pad_prompts(prompts: Sequence[Sequence[int]], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad prompts to ``width`` (default: their length bucket): (tokens [B, P] int32, lengths [B])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), width or bucket_length(int(lengths.max()))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def method_weights(method: KVMethod, model_cfg: ModelConfig, mesh: Mesh | None) -> Any:
    """The method's learned parameters (``KVMethod.weights``, None without any) on the device(s), replicated
    over a mesh: an argument of every program, so that other parameters of the same shapes reuse them."""
    return jax.tree.map(lambda a: place_replicated(a, mesh), method.weights(model_cfg))


# ---------------------------------------------------------------------------------------------- jitted


def prefill_logits(
    model: Transformer,
    tokens,
    lengths,
    method: KVMethod,
    *,
    max_new_tokens: int,
    budget_tokens: int,
    kv_dtype,
    mesh: Mesh | None = None,
    weights: Any = None,
):
    """tokens [B, P] right-padded, lengths [B] -> (logits at each row's last prompt token [B, V], cache).

    The cache is sized for ``max_new_tokens`` more tokens per row and stores K/V in ``kv_dtype``; on a
    ``mesh`` it is constrained to its sharding (``sharding.cache_shardings``) before and after the layer scan.
    ``weights``: the method's learned parameters (``KVMethod.weights``), traced.
    """
    b, p = tokens.shape
    request = CacheRequest(
        model_cfg=model.cfg,
        batch=b,
        prompt_capacity=p,
        max_new_tokens=max_new_tokens,
        dtype=kv_dtype,
        budget_tokens=budget_tokens,
    )
    cache = method.init_cache(request, lengths)
    cache = constrain_cache(cache, mesh)
    recon, prior = shared_reconstruction(method)
    if recon is not None:  # the prompt pass is also the context's reconstruction (the kvzip ranking)
        logits, _, cache = reconstructing_prefill(
            model, tokens, lengths, recon, method=method, cache=cache, prior=prior, weights=weights
        )
        return logits, constrain_cache(cache, mesh)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, cache = model(
        tokens,
        positions,
        cache,
        attend=method.prefill_attend,
        logit_index=lengths - 1,
        weights=weights,
        stacked_cache=method.stacked_cache,
    )
    return logits, constrain_cache(cache, mesh)


def _prefill(
    graphdef,
    state,
    tokens,
    lengths,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    budget_tokens: int,
    capacity_new: int,
    kv_dtype,
    mesh: Mesh | None = None,
    weights: Any = None,
):
    """tokens [B, P] right-padded, lengths [B] -> (first token [B], cache with room for ``capacity_new``);
    ``weights``: the method's learned parameters (``KVMethod.weights``)."""
    model: Transformer = nnx.merge(graphdef, state)
    logits, cache = prefill_logits(
        model,
        tokens,
        lengths,
        method,
        max_new_tokens=capacity_new,
        budget_tokens=budget_tokens,
        kv_dtype=kv_dtype,
        mesh=mesh,
        weights=weights,
    )
    return sample(logits, rng, sampler), cache


def _select_rows(active: jax.Array, new: Any, old: Any) -> Any:
    """Per batch row, ``new`` where active [B] else ``old`` (every cache leaf is [L, B, ...])."""

    def pick(n, o):
        return jnp.where(active.reshape((1, -1) + (1,) * (n.ndim - 2)), n, o)

    return jax.tree.map(pick, new, old)


def _append(
    graphdef,
    state,
    cache,
    tokens,
    start,
    count,
    rng,
    method: KVMethod,
    sampler: SamplerConfig,
    mesh: Mesh | None = None,
    weights: Any = None,
):
    """Append a chunk of tokens to a (compressed) cache, then run one routing event (docs/design.md §6).

    tokens [B, Q] right-padded: row b feeds its first ``count[b]`` (>= 1) tokens at positions ``start[b]``,
    ``start[b] + 1``, ... through the method's decode attention (each attends over the cache's tiers and
    adds its attention mass to the window scores, exactly as a decode step). Then ``method.route`` runs a
    routing event, so windows the new tokens need are promoted before decoding.
    ``weights``: the method's learned parameters (``KVMethod.weights``).
    Returns (next token [B] sampled from the logits at each row's last token, cache).
    """
    model: Transformer = nnx.merge(graphdef, state)
    b, q = tokens.shape
    inv_freq = jnp.asarray(model.cfg.inv_freq(), jnp.float32)

    def body(carry, xs):
        cache, last = carry
        token, i = xs
        active = i < count
        logits, new = model(
            token[:, None],
            (start + i)[:, None],
            cache,
            attend=method.decode_attend,
            weights=weights,
            stacked_cache=method.stacked_cache,
        )
        new = method.decode_route(new, inv_freq)
        new = jax.lax.cond(jnp.all(active), lambda: new, lambda: _select_rows(active, new, cache))
        return (constrain_cache(new, mesh), jnp.where(active[:, None], logits[:, 0], last)), None

    last0 = jnp.zeros((b, model.cfg.vocab_size), jnp.float32)
    with mesh_context(mesh):  # the decode attention and routing map over the mesh's shards (``on_shards``)
        (cache, last), _ = jax.lax.scan(body, (cache, last0), (tokens.T, jnp.arange(q, dtype=jnp.int32)))
        cache = constrain_cache(method.route(cache, inv_freq), mesh)
    return sample(last, rng, sampler), cache


prefill_jit = jax.jit(
    _prefill,
    static_argnames=("graphdef", "method", "sampler", "budget_tokens", "capacity_new", "kv_dtype", "mesh"),
)
append_jit = jax.jit(
    _append, static_argnames=("graphdef", "method", "sampler", "mesh"), donate_argnames=("cache",)
)


def prefill_call(
    *,
    model_cfg: ModelConfig,
    graphdef,
    state,
    tokens: np.ndarray,
    lengths: np.ndarray,
    seed: int,
    method: Any,
    sampler: SamplerConfig,
    budget_tokens: Any,
    capacity_new: int,
    kv_dtype: Any,
    mesh: Mesh | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(static arguments, traced inputs) of ``prefill_jit`` by name, for tokens [B, P] right-padded, lengths
    [B]: inputs placed on the mesh, the prefill's random key drawn from ``seed`` as ``generate`` draws it."""
    static = dict(
        graphdef=graphdef,
        method=method,
        sampler=sampler,
        budget_tokens=budget_tokens,
        capacity_new=capacity_new,
        kv_dtype=kv_dtype,
        mesh=mesh,
    )
    key = place_replicated(jax.random.split(jax.random.key(seed), 3)[0], mesh)
    inputs = dict(state=state, tokens=place_rows(tokens, mesh), lengths=place_rows(lengths, mesh), rng=key)
    return static, inputs | {"weights": method_weights(method, model_cfg, mesh)}


def run_prefill(**call: Any) -> tuple[jax.Array, Any, float, float]:
    """Run ``prefill_jit`` on ``prefill_call(**call)``'s arguments: (first token [B], cache, seconds of the
    prompt pass, seconds compiling), the first excluding the second."""
    t0 = time.perf_counter()
    static, inputs = prefill_call(**call)
    (first, cache), compile_s = EXECUTABLES.run(prefill_jit, static, **inputs)
    first.block_until_ready()
    return first, cache, time.perf_counter() - t0 - compile_s, compile_s
