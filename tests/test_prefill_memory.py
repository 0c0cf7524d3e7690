"""Prefill working memory, measured from XLA's buffer assignment of the compiled prefill (``memory_analysis()``,
as ``bench/throughput.py`` reports it) on a tiny random model, against bounds computed from shapes:

- the forward pass alone (no KV cache) holds x, q, k, v and the attention output of one layer for the whole
  prompt, plus temporaries that do not grow with the prompt: three [B, H, C, C] attention blocks, the MLP
  of C tokens and one layer's weights (C = the chunk, 512);
- a method's prefill holds at most one layer's full K/V of the prompt (compute dtype) plus its cache more.

The programs are compiled, not run. Also: chunking the layer's position-wise parts changes no logit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import load_bench, tiny_llama

from models.config import ModelConfig
from models.model import Transformer, param_shapes
from qevict_jax.methods.registry import make_method
from qevict_jax.runtime.generate import lower_prefill
from qevict_jax.runtime.sampling import SamplerConfig

throughput = load_bench("throughput")

TINY = tiny_llama(4096)
BATCH, NEW, CHUNK, F32 = 2, 8, 512, 4


@pytest.fixture(scope="module")
def model() -> Transformer:
    return Transformer(TINY, rngs=nnx.Rngs(0))


def param_bytes(model: Transformer) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(nnx.state(model, nnx.Param)))


def activation_bound(cfg: ModelConfig, batch: int, prompt: int) -> int:
    """Bytes (f32 compute) a layer of the cache-free prefill forward may hold, from shapes: x [B, P, Dm], q and
    the attention output [B, P, H*D], k and v [B, P, Hkv*D]; three [B, H, C, C] f32 attention blocks; the
    MLP's gate, up and product [B, C, F]; one layer's weights (sliced out of the stacked parameters)."""
    c = min(CHUNK, prompt)
    per_token = cfg.hidden_size + 2 * cfg.num_heads * cfg.head_dim + 2 * cfg.num_kv_heads * cfg.head_dim
    blocks = 3 * batch * cfg.num_heads * c * c
    mlp = 3 * batch * c * cfg.intermediate_size
    layer_weights = sum(int(np.prod(s[1:])) for s in param_shapes(cfg)["layers"].values())
    return F32 * (batch * prompt * per_token + blocks + mlp + layer_weights)


def one_layer_kv(cfg: ModelConfig, batch: int, prompt: int) -> int:
    """One layer's full K and V of the padded prompt batch in the compute dtype (f32)."""
    return F32 * batch * prompt * 2 * cfg.num_kv_heads * cfg.head_dim


def prefill_peak(model: Transformer, method, prompts: list[list[int]]) -> int:
    """``executable_peak`` of the prefill ``generate`` would run for these prompts (compiled, not run)."""
    lowered = lower_prefill(model, prompts, SamplerConfig(max_new_tokens=NEW), method)
    return throughput.executable_peak(lowered.compile(), param_bytes(model))


@pytest.mark.parametrize("prompt", [1088, 2048])
def test_activations_only_peak_is_bounded_by_shapes(model, prompt):
    """No [B, H, C, P] attention chunk or [B, P, F] MLP activation: the forward's peak grows with the prompt
    only by the per-token activations of one layer (1088 tokens: two full chunks and a tail of 64)."""
    act = throughput.activation_peak(model, BATCH, prompt, param_bytes(model))
    bound = activation_bound(TINY, BATCH, prompt)
    assert act <= bound, f"activations-only peak {act} > {bound} bytes from shapes"


@pytest.mark.parametrize("prompt", [1088, 2048])
def test_prefill_peak_is_activations_plus_one_layer_kv_plus_cache(model, prompt):
    """With the test above: prefill peak <= activation_bound + one layer's KV + cache, from shapes."""
    act = throughput.activation_peak(model, BATCH, prompt, param_bytes(model))
    prompts = throughput.prompts_for(TINY, prompt, BATCH, NEW)  # rows of prompt - 8 * row tokens
    lengths = [len(p) for p in prompts]
    layer_kv = one_layer_kv(TINY, BATCH, prompt)
    for name in ("full", "qevict", "snapkv"):
        method = make_method("full") if name == "full" else make_method(name, 0.2, recent=16)
        cache = throughput.planned_cache_bytes(method, TINY, lengths, NEW, jnp.bfloat16)
        peak = prefill_peak(model, method, prompts)
        assert peak >= cache  # the prefill returns its cache
        assert peak - act <= layer_kv + cache, (
            f"{name}: prefill peak {peak} - activations {act} > one layer's KV {layer_kv} + cache {cache}"
        )


def test_token_chunks_change_no_logit(model):
    """The position-wise parts run chunk by chunk (4 full chunks of 48 tokens and a tail of 8) and give the
    logits of the unchunked layer at every position."""
    rs = np.random.RandomState(0)
    tokens = jnp.asarray(rs.randint(0, TINY.vocab_size, (2, 200)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(200, dtype=jnp.int32), (2, 200))
    whole, _ = model(tokens, positions, token_chunk=4096)
    chunked, _ = model(tokens, positions, token_chunk=48)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-5)
