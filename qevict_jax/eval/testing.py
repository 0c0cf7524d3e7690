"""Small stand-ins for fast tests of the evaluation: a byte-level tokenizer and a tiny random decoder.

Neither is a real model: sweeps run with them exercise the plumbing (prompts, caches, records, resume,
summaries), never the quality of a method.
"""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx

from models.config import ModelConfig
from models.model import Transformer

BOS, EOS, OFFSET = 0, 1, 2
VOCAB = 256 + OFFSET


class ByteTokenizer:
    """UTF-8 bytes as tokens (id = byte + 2; 0 = BOS, 1 = EOS) with a minimal chat template."""

    chat_template = "<|user|>{content}<|assistant|>"
    eos_token_ids = (EOS,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([BOS] if add_bos else []) + [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(self.chat_template.replace("<|assistant|>", "").format(**m) for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def tiny_model(seed: int = 0, max_positions: int = 4096):
    """A 2-layer random Llama-style decoder over the byte vocabulary (float32)."""
    cfg = ModelConfig(
        family="llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=max_positions,
        eos_token_ids=(EOS,),
    )
    return cfg, Transformer(cfg, rngs=nnx.Rngs(seed))
