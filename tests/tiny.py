"""Helpers shared by test modules: the tiny random Llama shape several tests run on (and a random model of
it), and loading a
``bench/`` script as a module (benchmarks are scripts, not part of the package)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.attention import dense_attention
from models.config import ModelConfig
from models.model import Transformer
from qevict_jax.core.kv import full_kv_bytes
from qevict_jax.methods.registry import make_method

ROOT = Path(__file__).resolve().parent.parent


def tiny_llama(max_positions: int) -> ModelConfig:
    """A 2-layer Llama (8 query heads, 4 KV heads, head_dim 8, hidden 64, vocabulary 97)."""
    return ModelConfig(
        family="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        max_position_embeddings=max_positions,
    )


def decisive_model(cfg: ModelConfig, seed: int = 3) -> Transformer:
    """A random model of ``cfg`` with its matrices scaled by 4 over the default init, so that greedy choices
    are not near-ties (token-equality tests then compare decisions, not float noise); the same weights on
    every process that builds it with this seed."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a: a * 4.0 if a.ndim >= 2 else a, state))
    return model


def load_bench(name: str) -> ModuleType:
    """The script ``bench/<name>.py`` as a module, with ``bench/`` on ``sys.path`` as when it runs as a script
    (it imports its sibling modules)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_repeat_prompt(method: Any, prompt: tuple[int, ...] = (3, 4, 5, 6)) -> Any:
    """``method`` with a fixed reconstruction prompt where it reconstructs (kvzip), for a model that has no
    tokenizer (``registry.bind_tokenizer`` gives a real one its own); any other method as it is."""
    if method.reconstruction is None:
        return method
    return dataclasses.replace(method, repeat_prompt=prompt)


def roomy_method(name: str, model_cfg: ModelConfig, tokens: int, **options: Any) -> Any:
    """Method ``name`` with room for every token of a ``tokens``-token sequence: a byte budget of four times
    its uncompressed float32 cache per row (β is a fraction in (0, 1], so room is given in bytes)."""
    if name == "full":
        return make_method(name, **options)
    budget_bytes = 4 * full_kv_bytes(model_cfg, tokens, jnp.float32)
    return with_repeat_prompt(make_method(name, budget_bytes=budget_bytes, **options))


class Recorded(struct.PyTreeNode):
    """Every layer's post-RoPE q [L, 1, T, H, D], k and v [L, 1, T, Hkv, D] of one row (``record_qkv``)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array


@dataclasses.dataclass(frozen=True)
class Recorder:
    """Dense attention of one unpadded row, recording every layer's q, k and v into its ``Recorded``."""

    stacked_cache: ClassVar[bool] = True

    def prefill_attend(self, q, k, v, rec: Recorded, ctx):
        out, _ = dense_attention(q, k, v, q_pos=ctx.positions, k_pos=ctx.positions, sliding_window=None)
        return out, rec.replace(q=rec.q.at[ctx.layer].set(q), k=rec.k.at[ctx.layer].set(k), v=rec.v.at[ctx.layer].set(v))


def record_qkv(model: Transformer, row: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One unpadded row of token ids [T] through ``model`` with dense attention at positions 0..T-1: every
    layer's post-RoPE q [L, T, H, D], k and v [L, T, Hkv, D], float64 (the references' inputs)."""
    cfg = model.cfg
    t = len(row)
    z = lambda h: jnp.zeros((cfg.num_layers, 1, t, h, cfg.head_dim))
    rec = Recorded(q=z(cfg.num_heads), k=z(cfg.num_kv_heads), v=z(cfg.num_kv_heads))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    _, rec = model(jnp.asarray(np.asarray(row))[None], pos, rec, attend=Recorder().prefill_attend, stacked_cache=True)
    return tuple(np.asarray(a[:, 0], np.float64) for a in (rec.q, rec.k, rec.v))
