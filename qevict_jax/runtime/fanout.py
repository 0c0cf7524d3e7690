"""Several methods' caches from one prompt pass (``Fanout``): the method ``generate_shared`` prefills with;
the context reconstruction that pass runs with when a method's ranking needs it (``shared_reconstruction``)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any, ClassVar

import jax

from models.attention import prompt_attention
from models.config import ModelConfig
from models.model import attend_stacked, read_layer
from qevict_jax.core.kv import CacheRequest
from qevict_jax.rankings.reconstruction import Reconstruction


@dataclasses.dataclass(frozen=True)
class Fanout:
    """Several methods' caches built by one prompt pass.

    A method only decides what its cache keeps: the prompt pass's outputs (hence the first token) are the
    same for every method, so an evaluation of many methods on one prompt needs one prefill, not one per
    method. The layer scan hands the whole stacked caches over; each member gets what its ``stacked_cache``
    asks for (the stacked cache, or its layer's slice, written back). The cache is the tuple of the members'
    caches; ``budget_tokens`` is per member.
    """

    methods: tuple[Any, ...]
    name: str = "fanout"
    chunk: int = 512
    stacked_cache: ClassVar[bool] = True  # each member takes its layer's slice itself where it needs one
    reconstruction: ClassVar[None] = None  # its members' own (``shared_reconstruction``)

    def init_cache(self, request: CacheRequest, prompt_lengths: jax.Array) -> tuple[Any, ...]:
        """One cache per member, each sized for its own ``request.budget_tokens``."""
        return tuple(
            m.init_cache(dataclasses.replace(request, budget_tokens=bt), prompt_lengths)
            for m, bt in zip(self.methods, request.budget_tokens, strict=True)
        )

    def weights(self, model_cfg: ModelConfig) -> tuple[Any, ...]:
        """Every member's learned parameters (``KVMethod.weights``), in order."""
        return tuple(m.weights(model_cfg) for m in self.methods)

    def prefill_attend(self, q, k, v, caches, ctx):
        """The prompt attention once (``LayerContext.prompt_attention``), then every member's compression
        (each with its own ``weights``)."""
        lengths = read_layer(caches[0], ctx.layer).length
        att = prompt_attention(
            q,
            k,
            v,
            positions=ctx.positions,
            lengths=lengths,
            sliding_window=ctx.cfg.sliding_window,
            chunk=self.chunk,
        )
        ctx = dataclasses.replace(ctx, prompt_attention=att)
        weights = ctx.weights if ctx.weights is not None else (None,) * len(self.methods)
        pairs = [
            attend_stacked(
                m.prefill_attend, q, k, v, c, replace(ctx, weights=w), stacked_cache=m.stacked_cache
            )
            for m, c, w in zip(self.methods, caches, weights, strict=True)
        ]
        return pairs[0][0], tuple(c for _, c in pairs)


def shared_reconstruction(method: Any) -> tuple[Reconstruction | None, tuple[bool, ...] | None]:
    """(the context reconstruction the prompt pass of ``method`` runs with, None for none; which members of a
    ``Fanout`` read its scores, None for a single method): one reconstruction serves every member that asks
    for one (``KVMethod.reconstruction``: the kvzip ranking), so members must reconstruct alike."""
    members = method.methods if isinstance(method, Fanout) else (method,)
    wanted = [m.reconstruction for m in members if m.reconstruction is not None]
    if not wanted:
        return None, None
    if len({(r.prompt, r.n_sink) for r in wanted}) > 1:
        names = ", ".join(m.name for m in members if m.reconstruction is not None)
        raise ValueError(f"methods sharing one prefill must reconstruct the context alike: {names}")
    prior = tuple(m.reconstruction is not None for m in members) if isinstance(method, Fanout) else None
    return wanted[0], prior
