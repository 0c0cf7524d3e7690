"""KVzip's context reconstruction (Kim et al., arXiv 2505.23416; kvpress ``KVzipPress``): a question-agnostic
importance score for every KV pair of a prompt, computed before the method's prompt pass.

The model reads the prompt, then a short "repeat the previous context" prompt, then the prompt again
(teacher-forced). To reproduce the context it must attend to every fact in it, so the largest attention a
KV pair receives from any reconstruction query of its KV head's group says how much a later question could
need it, whatever the question. The scores ([L, B, Hkv, T]) reach the method's prompt pass as its traced
``weights`` (``prompt.TokenPrior``) and the ``kvzip`` ranking (``scoring.KVzipRanking``) reads them, in the
token pool and in the window engine alike.

One pass over [prompt | repeat prompt | prompt after its sinks] computes them (``reconstruction_scores``):
the first part is the same causal prefill as the prompt's own, the rest attends over all of it through
the flash blocks (``models.attention``), so memory stays a few [B, H, chunk, chunk] blocks at any length and
the program compiles once per prompt bucket. Differences from kvpress 0.5.5, by design: the whole prompt
after its ``n_sink`` sink tokens is reconstructed in one piece (kvpress splits the context after the chat
template's prefix into chunks of 2048 tokens, each with its own repeat prompt, and normalizes each chunk's
scores over the sinks, that chunk and its repeat); below 2048 tokens the two are the same computation when
the prompt's prefix is its sinks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import causal_column_max, flash_causal_attention
from models.model import LayerContext

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

    def layout(self, tokens: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens [B, P] right-padded, lengths [B] -> (the pass's tokens [B, 2P + n] right-padded: each row's
        prompt, the repeat prompt of n tokens, the prompt after its sinks; each row's length [B])."""
        b, p = tokens.shape
        n = len(self.prompt)
        sink = jnp.minimum(self.n_sink, lengths)[:, None]
        pos = jnp.arange(2 * p + n, dtype=jnp.int32)[None]
        length = lengths[:, None]
        in_repeat = (pos >= length) & (pos < length + n)
        source = jnp.where(pos < length, pos, pos - length - n + sink)  # the prompt position it copies
        copied = jnp.take_along_axis(tokens, jnp.clip(source, 0, p - 1), axis=1)
        instruction = jnp.asarray(self.prompt, tokens.dtype)[jnp.clip(pos - length, 0, n - 1)]
        total = 2 * lengths + n - sink[:, 0]
        out = jnp.where(in_repeat, instruction, copied)
        return jnp.where(pos < total[:, None], out, 0).astype(tokens.dtype), total


class ReconstructionScores(struct.PyTreeNode):
    """The pass's state: scores [L, B, Hkv, P] f32 (0 past a row's prompt), lengths [B] (the prompts'),
    total [B] (the pass's row lengths)."""

    scores: jax.Array
    lengths: jax.Array
    total: jax.Array


@dataclasses.dataclass(frozen=True)
class ReconstructionPass:
    """The attend fn of the reconstruction pass: causal attention over the whole row, and each prompt key's
    largest probability from a query past the prompt (the repeat) over its group, into its layer's scores."""

    chunk: int = 512
    stacked_cache: ClassVar[bool] = True  # the whole [L, ...] score buffer rides in the layer scan

    def prefill_attend(self, q, k, v, state: ReconstructionScores, ctx: LayerContext):
        """q [B, T, H, D], k, v [B, T, Hkv, D] post-RoPE -> (out [B, T, H, D], state with this layer's scores)."""
        positions = ctx.positions
        valid = positions < state.total[:, None]
        k_pos = jnp.where(valid, positions, -1)
        blocks = dict(q_pos=positions, k_pos=k_pos, sliding_window=ctx.cfg.sliding_window, chunk=self.chunk)
        out, lse = flash_causal_attention(q, k, v, **blocks)
        rows = valid & (positions >= state.lengths[:, None])
        best = causal_column_max(q, k, lse=lse, q_rows=rows, **blocks)  # [B, Hkv, T]
        p = state.scores.shape[-1]
        best = jnp.where(jnp.arange(p)[None, None] < state.lengths[:, None, None], best[..., :p], 0.0)
        return out, state.replace(scores=state.scores.at[ctx.layer].set(best))


def reconstruction_scores(model: Any, tokens: jax.Array, lengths: jax.Array, recon: Reconstruction) -> jax.Array:
    """KVzip scores [L, B, Hkv, P] f32 of prompts tokens [B, P] (right-padded, lengths [B]) under ``model``
    (a ``models.model.Transformer``), traced: 0 past each row's length; the sinks' are their own (a method
    keeps its sinks whatever they score)."""
    recon.check()
    cfg = model.cfg
    b, p = tokens.shape
    rec_tokens, total = recon.layout(tokens, lengths)
    positions = jnp.broadcast_to(jnp.arange(rec_tokens.shape[1], dtype=jnp.int32), rec_tokens.shape)
    state = ReconstructionScores(
        scores=jnp.zeros((cfg.num_layers, b, cfg.num_kv_heads, p), jnp.float32), lengths=lengths, total=total
    )
    attend = ReconstructionPass(chunk=recon.chunk).prefill_attend
    _, state = model(rec_tokens, positions, state, attend=attend, logit_index=lengths - 1)
    return state.scores


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
    return tuple(tokenizer.encode(REPEAT_INSTRUCTION, add_bos=False) + tokenizer.encode(suffix, add_bos=False))
