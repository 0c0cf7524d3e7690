"""Full-KV generation: cached decoding equals the uncached forward; batches equal single rows; one compile."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import decisive_model, roomy_method

from models.config import ModelConfig
from models.model import Transformer
from qevict_jax.core.kv import CacheRequest
from qevict_jax.methods.full import FullKV
from qevict_jax.runtime import generate as gen
from qevict_jax.runtime.compiled import ExecutableCache, bucket_floor, bucket_length
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig, sample
from qevict_jax.runtime.teacher_forced import teacher_forced

TINY = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return decisive_model(TINY)


def greedy_uncached(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence without a cache for every new token."""
    seq = list(prompt)
    for _ in range(n):
        tok = jnp.asarray([seq])
        logits, _ = model(tok, jnp.arange(len(seq))[None])
        seq.append(int(jnp.argmax(logits[0, -1])))
    return seq[len(prompt) :]


def test_cached_decoding_equals_uncached_forward(model):
    prompt = list(np.random.RandomState(0).randint(0, TINY.vocab_size, 37))
    res = generate(model, [prompt], SamplerConfig(max_new_tokens=12), FullKV(), kv_dtype=jnp.float32)
    assert res.tokens[0] == greedy_uncached(model, prompt, 12)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a result is built once, never changed after
        res.note = "changed"


def test_cached_logits_equal_uncached_logits_every_step(model):
    """Decode-step logits of the Full-KV cache equal the uncached forward's logits at every position."""
    rs = np.random.RandomState(1)
    seq = rs.randint(0, TINY.vocab_size, 40)
    ref, _ = model(jnp.asarray(seq)[None], jnp.arange(40)[None])
    method = FullKV()
    p = 25
    cache = method.init_cache(CacheRequest(model_cfg=TINY, batch=1, prompt_capacity=64, max_new_tokens=20, dtype=jnp.float32), jnp.asarray([p]))
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :p] = seq[:p]
    logits, cache = model(
        jnp.asarray(tokens),
        jnp.arange(64)[None],
        cache,
        attend=method.prefill_attend,
        logit_index=jnp.asarray([p - 1]),
        stacked_cache=True,
    )
    np.testing.assert_allclose(logits[0], ref[0, p - 1], atol=1e-5)
    for i in range(p, 40):
        logits, cache = model(
            jnp.asarray([[seq[i]]]), jnp.asarray([[i]]), cache, attend=method.decode_attend, stacked_cache=True
        )
        np.testing.assert_allclose(logits[0, 0], ref[0, i], atol=1e-5)


def test_mixed_length_batch_equals_single_rows(model):
    rs = np.random.RandomState(2)
    prompts = [list(rs.randint(0, TINY.vocab_size, n)) for n in (5, 70, 33)]
    sampler = SamplerConfig(max_new_tokens=10)
    batch = generate(model, prompts, sampler, FullKV())
    for i, p in enumerate(prompts):
        assert batch.tokens[i] == generate(model, [p], sampler, FullKV()).tokens[0]


def test_eos_stops_each_row():
    """A row stops at its first EOS (kept), the others go on; EOS chosen from an unconstrained run."""
    m = Transformer(TINY, rngs=nnx.Rngs(5))
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    free = generate(m, prompts, SamplerConfig(max_new_tokens=8), FullKV())
    eos = free.tokens[0][3]
    res = generate(m, prompts, SamplerConfig(max_new_tokens=8, eos_ids=(eos,)), FullKV())
    first = free.tokens[0].index(eos)
    assert res.tokens[0] == free.tokens[0][: first + 1]
    row1 = free.tokens[1]
    expect1 = row1[: row1.index(eos) + 1] if eos in row1 else row1
    assert res.tokens[1] == expect1


def test_one_compilation_per_bucket(model):
    sampler = SamplerConfig(max_new_tokens=4)
    before = dict(gen.EXECUTABLES.compilations)
    rs = np.random.RandomState(3)
    # 65..128 share a bucket; 129 starts a new one
    for n in (70, 90, 128):
        generate(model, [list(rs.randint(0, TINY.vocab_size, n))], sampler, FullKV())
    mid = dict(gen.EXECUTABLES.compilations)
    assert mid.get("_prefill", 0) - before.get("_prefill", 0) <= 1
    assert mid.get("_decode", 0) - before.get("_decode", 0) <= 1
    generate(model, [list(rs.randint(0, TINY.vocab_size, 129))], sampler, FullKV())
    assert gen.EXECUTABLES.compilations["_prefill"] - mid.get("_prefill", 0) == 1


def test_executable_cache_keeps_the_most_recent_executables():
    cache = ExecutableCache(capacity=2)
    double = jax.jit(lambda x: 2 * x)
    compiles = []
    for n in (1, 2, 1, 3, 2, 1):  # shapes; capacity 2 drops the least recently used one
        out, seconds = cache.run(double, {}, jnp.ones(n))
        np.testing.assert_array_equal(out, 2 * np.ones(n))
        compiles.append(seconds > 0)
    assert compiles == [True, True, False, True, True, True]
    assert len(cache) == 2
    with pytest.raises(ValueError, match="capacity"):
        ExecutableCache(capacity=0)


def test_executable_cache_keys_static_arguments_by_name():
    """Static arguments go by name (``static_argnames``), traced inputs by position or name: one executable per
    static value and input shape, whatever the order the names come in; positions are refused."""
    cache = ExecutableCache()
    scale = jax.jit(lambda k, x, y, *, offset: k * x + y + offset, static_argnames=("k", "offset"))
    compiles = []
    for k, offset, n in ((2, 1, 3), (2, 1, 3), (3, 1, 3), (2, 1, 4), (2, 0, 3)):
        static = {"offset": offset, "k": k} if n == 4 else {"k": k, "offset": offset}
        out, seconds = cache.run(scale, static, x=jnp.ones(n), y=jnp.ones(n))
        np.testing.assert_array_equal(out, (k + 1 + offset) * np.ones(n))
        compiles.append(seconds > 0)
    assert compiles == [True, False, True, True, True]
    out, seconds = cache.run(scale, {"offset": 1, "k": 2}, x=jnp.ones(3), y=jnp.ones(3))
    assert seconds == 0.0 and len(cache) == 4
    with pytest.raises(TypeError, match="by name"):
        cache.run(scale, {0: 2}, jnp.ones(3), jnp.ones(3))


def test_bucket_lengths():
    assert bucket_length(1) == 64
    assert bucket_length(64) == 64
    assert bucket_length(65) == 128
    assert bucket_length(4000) == 4096
    assert bucket_length(4097) == 4352
    for n in (1, 63, 65, 500, 1000, 4000, 8191):
        b = bucket_length(n)
        assert b >= n and (b - n) <= max(63, n // 8)
        lo = bucket_floor(n)
        assert bucket_length(lo) == b and (lo == 1 or bucket_length(lo - 1) < b)


def test_prompt_longer_than_capacity_is_a_clear_error(model):
    with pytest.raises(ValueError, match="context capacity of 512"):
        generate(model, [[1] * 500], SamplerConfig(max_new_tokens=20), FullKV())
    with pytest.raises(ValueError, match="outside"):
        generate(model, [[1, 2, 1000]], SamplerConfig(max_new_tokens=2), FullKV())


def test_top_p_sampling_keeps_the_nucleus():
    """With top_p, only tokens inside the nucleus are ever drawn; greedy picks the argmax."""
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    sampler = SamplerConfig(max_new_tokens=1, temperature=1.0, top_p=0.7)
    draws = {int(sample(logits, jax.random.key(i), sampler)[0]) for i in range(200)}
    assert draws == {0, 1}
    assert int(sample(logits, jax.random.key(0), SamplerConfig(max_new_tokens=1))[0]) == 0
    full = {int(sample(logits, jax.random.key(i), SamplerConfig(1, temperature=1.0))[0]) for i in range(400)}
    assert full == {0, 1, 2, 3}


def test_teacher_forced_logprobs_equal_uncached_forward(model):
    """Teacher-forced Full-KV log-probs equal log_softmax of the uncached forward over prompt + targets."""
    rs = np.random.RandomState(4)
    prompt = list(rs.randint(0, TINY.vocab_size, 30))
    targets = rs.randint(0, TINY.vocab_size, (1, 9))
    res = teacher_forced(model, [prompt], targets, FullKV(), kv_dtype=jnp.float32)
    seq = np.concatenate([prompt, targets[0]])
    ref, _ = model(jnp.asarray(seq)[None], jnp.arange(len(seq))[None])
    ref = jax.nn.log_softmax(ref[0, len(prompt) - 1 : -1], axis=-1)
    np.testing.assert_allclose(res.logprobs[0], ref, atol=2e-5)


@pytest.mark.parametrize("name", ["full", "qevict", "r2", "snapkv", "h2o", "streamingllm"])
def test_question_agnostic_generation_with_room_for_everything_equals_full_kv(name):
    """Question-agnostic mode (every method): the context is compressed, then the question appended; with a
    budget that keeps everything it generates exactly what question-aware Full-KV does."""
    from dataclasses import replace


    cfg = replace(TINY, max_position_embeddings=2048)
    m = Transformer(cfg, rngs=nnx.Rngs(3))
    rs = np.random.RandomState(7)
    prompt = list(rs.randint(0, cfg.vocab_size, 300))
    sampler = SamplerConfig(max_new_tokens=6)
    method = roomy_method(name, cfg, len(prompt) + 6)
    with pytest.raises(ValueError, match="outside"):
        generate(m, [prompt], sampler, method, question_starts=[300])
    res = generate(m, [prompt], sampler, method, question_starts=[280], kv_dtype=jnp.float32)
    assert res.tokens == generate(m, [prompt], sampler, FullKV(), kv_dtype=jnp.float32).tokens
