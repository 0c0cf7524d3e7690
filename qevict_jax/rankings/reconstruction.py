"""KVzip's context reconstruction (Kim et al., arXiv 2505.23416; kvpress ``KVzipPress``): a question-agnostic
importance score for every KV pair of a prompt, computed in the prompt's own pass.

The model reads the prompt, then a short "repeat the previous context" prompt, then the prompt again
(teacher-forced). To reproduce the context it must attend to every fact in it, so the largest attention a
KV pair receives from any reconstruction query of its KV head's group says how much a later question could
need it, whatever the question. The scores ([L, B, Hkv, T]) reach the method as its traced ``weights``
(``prompt.TokenPrior``) and the ``kvzip`` ranking (``KVzipRanking``, here) reads them, in the token pool
and in the window engine alike.

One pass over [prompt | repeat prompt | prompt after its sinks] (``Reconstruction.layout``) is both the
prompt's prefill and its reconstruction (``ReconstructionPass``): in each layer the method compresses the
prompt's keys as in its own prompt pass, given that layer's scores, and the reconstruction rows attend over
everything through the flash blocks (``models.attention``), so memory stays a few [B, H, chunk, chunk]
blocks at any length and the program compiles once per prompt bucket. The pass costs about a prefill of
twice the prompt, where the prompt's own is one. Differences from kvpress 0.5.5, by design: the whole
prompt after its ``n_sink`` sink tokens is reconstructed in one piece (kvpress splits the context after the
chat template's prefix into chunks of 2048 tokens, each with its own repeat prompt, and normalizes each
chunk's scores over the sinks, that chunk and its repeat); below 2048 tokens the two are the same
computation when the prompt's prefix is its sinks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import column_max, flash_causal_attention
from models.model import LayerContext, attend_stacked
from qevict_jax.rankings.prompt import PromptPass, TokenPrior
from qevict_jax.rankings.scoring import PriorRanking, register

REPEAT_INSTRUCTION = "\n\nRepeat the previous context exactly."
"""KVzip's reconstruction instruction (kvpress ``KVzipPress.prepare``, its first chunk)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Reconstruction:
    """How a prompt is reconstructed (static, hashable).

    prompt: token ids of the repeat instruction and the chat template's turn change (``repeat_prompt``);
    n_sink: the prompt's first tokens, not repeated (kvpress's 4, whatever a method's own sinks: methods that
    share a prompt pass share one reconstruction); chunk: query and key block of the pass's attention.
    """

    prompt: tuple[int, ...]
    n_sink: int = 4
    chunk: int = 512

    def __post_init__(self) -> None:
        if self.n_sink < 0 or self.chunk < 1:
            raise ValueError(f"n_sink must be >= 0 and chunk >= 1, got {self.n_sink}, {self.chunk}")

    def check(self) -> None:
        """A ValueError when the repeat prompt is unknown (a method built without its tokenizer)."""
        if not self.prompt:
            raise ValueError(
                "context reconstruction (the kvzip ranking) needs its repeat prompt's token ids: build the "
                "method through qevict_jax.load(...) or the CLI, or registry.bind_tokenizer(method, tokenizer)"
            )

    def blocks(self, p: int) -> tuple[int, int]:
        """(the pass's block size, the start S of its reconstruction rows) for prompts of width ``p``: S is
        ``p`` rounded up to the block, so that the reconstruction rows start on a block boundary."""
        chunk = min(self.chunk, p)
        return chunk, -(-p // chunk) * chunk

    def layout(self, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """tokens [B, P] right-padded, lengths [B] -> the pass's (tokens, positions, key positions), each
        [B, S + n + P]: the prompts as given (positions 0..P-1, as in their own prefill) and padding up to S
        (``blocks``), then from S each row's repeat prompt of n tokens and its prompt after its sinks at the
        positions that continue its prompt, then padding. Key positions are -1 on every padding token."""
        b, p = tokens.shape
        n = len(self.prompt)
        _, start = self.blocks(p)
        sink = jnp.minimum(self.n_sink, lengths)[:, None]
        length = lengths[:, None]
        i = jnp.arange(n + p, dtype=jnp.int32)[None]  # index in the reconstruction rows
        copied = jnp.take_along_axis(tokens, jnp.clip(i - n + sink, 0, p - 1), axis=1)
        instruction = jnp.asarray(self.prompt, tokens.dtype)[jnp.clip(i, 0, n - 1)]
        rows_valid = i < n + length - sink
        rows = jnp.where(i < n, instruction, jnp.where(rows_valid, copied, 0)).astype(tokens.dtype)
        rows_pos = length + i
        prompt_pos = jnp.broadcast_to(jnp.arange(start, dtype=jnp.int32), (b, start))
        pad = jnp.zeros((b, start - p), tokens.dtype)
        out = jnp.concatenate([tokens, pad, rows], axis=1)
        positions = jnp.concatenate([prompt_pos, jnp.where(rows_valid, rows_pos, 0)], axis=1)
        k_pos = jnp.concatenate(
            [jnp.where(prompt_pos < length, prompt_pos, -1), jnp.where(rows_valid, rows_pos, -1)], 1
        )
        return out, positions, k_pos


class ReconstructionState(struct.PyTreeNode):
    """The pass's state: scores [L, B, Hkv, P] f32 (0 past a row's prompt), key positions [B, S + n + P]
    (``Reconstruction.layout``'s), and the cache of the method whose prompt pass it is (None: scores only)."""

    scores: jax.Array
    k_pos: jax.Array
    cache: Any = None


@dataclasses.dataclass(frozen=True)
class ReconstructionPass:
    """The attend fn of the pass over ``Reconstruction.layout``'s rows (S: where the reconstruction starts).

    In each layer: the reconstruction rows attend causally over everything; each prompt key's largest
    probability from a reconstruction query of its group becomes this layer's scores; then the prompt rows
    are the ``method``'s own prompt pass (``prefill_attend``, given the scores as its ``TokenPrior``) or,
    without a method, plain causal attention. ``prior``: where the scores go in the method's ``weights``,
    None for all of them (one method), else a flag per member of a tuple of weights (a shared prefill's).
    """

    start: int
    chunk: int
    method: Any = None
    prior: tuple[bool, ...] | None = None
    stacked_cache: ClassVar[bool] = True  # the [L, ...] score buffer rides in the layer scan

    def prefill_attend(self, q, k, v, state: ReconstructionState, ctx: LayerContext):
        """q [B, W, H, D], k, v [B, W, Hkv, D] post-RoPE -> (out [B, W, H, D], state with this layer's scores
        and the method's compressed layer)."""
        s, p = self.start, state.scores.shape[-1]
        blocks = dict(sliding_window=ctx.cfg.sliding_window, chunk=self.chunk)
        q_pos, k_pos = ctx.positions[:, s:], state.k_pos
        rec, lse = flash_causal_attention(q[:, s:], k, v, q_pos=q_pos, k_pos=k_pos, **blocks)
        best = column_max(
            q[:, s:], k[:, :p], q_pos=q_pos, k_pos=k_pos[:, :p], lse=lse, q_rows=k_pos[:, s:] >= 0, **blocks
        )
        state = state.replace(scores=state.scores.at[ctx.layer].set(best))
        qp, kp, vp = q[:, :p], k[:, :p], v[:, :p]
        if self.method is None:
            out, _ = flash_causal_attention(
                qp, kp, vp, q_pos=ctx.positions[:, :p], k_pos=k_pos[:, :p], **blocks
            )
            cache = state.cache
        else:
            hidden = None if ctx.hidden is None else ctx.hidden[:, :p]
            weights = self._with_prior(ctx.weights, TokenPrior(scores=state.scores))
            inner = dataclasses.replace(ctx, positions=ctx.positions[:, :p], hidden=hidden, weights=weights)
            attend = self.method.prefill_attend
            out, cache = attend_stacked(
                attend, qp, kp, vp, state.cache, inner, stacked_cache=self.method.stacked_cache
            )
        pad = jnp.zeros((q.shape[0], s - p, *q.shape[2:]), out.dtype)
        return jnp.concatenate([out, pad, rec.astype(out.dtype)], axis=1), state.replace(cache=cache)

    def _with_prior(self, weights: Any, prior: TokenPrior) -> Any:
        if self.prior is None:
            return prior
        own = weights if weights is not None else (None,) * len(self.prior)
        return tuple(prior if flag else w for flag, w in zip(self.prior, own, strict=True))


def reconstructing_prefill(
    model: Any,
    tokens: jax.Array,
    lengths: jax.Array,
    recon: Reconstruction,
    *,
    method: Any = None,
    cache: Any = None,
    prior: tuple[bool, ...] | None = None,
    weights: Any = None,
) -> tuple[jax.Array, jax.Array, Any]:
    """The prompts tokens [B, P] (right-padded, lengths [B]) prefilled by ``method`` into its ``cache`` and
    reconstructed in the same pass under ``model`` (a ``models.model.Transformer``), traced.

    Returns (logits at each row's last prompt token [B, V], KVzip scores [L, B, Hkv, P] f32: 0 past each
    row's length, the sinks' their own, the method's cache). ``prior`` and ``weights``: as in
    ``ReconstructionPass``, the method's other learned parameters.
    """
    recon.check()
    cfg = model.cfg
    b, p = tokens.shape
    chunk, start = recon.blocks(p)
    rec_tokens, positions, k_pos = recon.layout(tokens, lengths)
    scores = jnp.zeros((cfg.num_layers, b, cfg.num_kv_heads, p), jnp.float32)
    state = ReconstructionState(scores=scores, k_pos=k_pos, cache=cache)
    attend = ReconstructionPass(start=start, chunk=chunk, method=method, prior=prior).prefill_attend
    logits, state = model(
        rec_tokens, positions, state, attend=attend, logit_index=lengths - 1, weights=weights, stacked_cache=True
    )
    return logits, state.scores, state.cache


def reconstruction_scores(
    model: Any, tokens: jax.Array, lengths: jax.Array, recon: Reconstruction
) -> jax.Array:
    """KVzip scores [L, B, Hkv, P] f32 of prompts tokens [B, P] (right-padded, lengths [B]) under ``model``,
    traced: 0 past each row's length; the sinks' are their own (a method keeps its sinks whatever they
    score)."""
    return reconstructing_prefill(model, tokens, lengths, recon)[1]


@register
@dataclasses.dataclass(frozen=True)
class KVzipRanking(PriorRanking):
    """KVzip (arXiv 2505.23416): a token's score is the largest attention any query of its KV head's group
    gives it while the model reconstructs the context (``ReconstructionPass``; ``PromptPass.prior``).
    Question-agnostic."""

    name: ClassVar[str] = "kvzip"
    reconstructs: ClassVar[bool] = True

    def token_prior(self, prompt: PromptPass) -> jax.Array:
        if prompt.prior is None:
            raise ValueError("the kvzip ranking reads the scores of the context reconstruction (TokenPrior)")
        return prompt.prior.astype(jnp.float32)


def repeat_prompt(tokenizer: Any) -> tuple[int, ...]:
    """Token ids of the repeat instruction followed by the chat template's end of a user turn and start of
    the assistant's (kvpress's suffix; a newline without a template), from a ``models.tokenizer.Tokenizer``."""
    suffix = "\n"
    if tokenizer.chat_template:
        marker = "\n" + "#" * 13
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "dummy context" + marker}], add_generation_prompt=True
        )
        suffix = text.split(marker, 1)[1]
    return tuple(
        tokenizer.encode(REPEAT_INSTRUCTION, add_bos=False) + tokenizer.encode(suffix, add_bos=False)
    )
