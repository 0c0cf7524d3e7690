"""Every registered method end to end on SmolLM2-135M: jitted generation, one compilation per bucket, finite
cache, measured memory within the byte budget (KIVI: its expected keep-everything size)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import decisive_model, roomy_method, with_repeat_prompt

from qevict_jax.core.cache import TieredCache
from qevict_jax.core.kv import full_kv_bytes
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.qevict import VARIANTS
from qevict_jax.methods.registry import available_methods, default_method, make_method
from qevict_jax.rankings.gates import UNTRAINED
from qevict_jax.runtime import generate as gen
from qevict_jax.runtime.compiled import bucket_floor, bucket_length
from qevict_jax.runtime.generate import SamplerConfig, generate

BETA = 0.4
NEW = 8
PROMPT = 380  # a second prompt of 370 tokens falls in the same bucket


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    from models.checkpoint import load_model
    from models.tokenizer import Tokenizer
    from qevict_jax.eval.needle import prose_paragraphs

    _, model = load_model(smollm2_dir)
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode(" ".join(prose_paragraphs()[:40]))
    assert len(ids) > PROMPT + 10
    return model, ids


def test_registry_lists_every_baseline():
    names = available_methods()
    for name in (
        "full", "qevict", "qevict-restkv", "streamingllm", "h2o", "tova", "keynorm", "snapkv", "pyramidkv",
        "adakv", "criticalkv", "restkv", "kivi2", "kivi4",
    ):  # fmt: skip
        assert name in names
    assert len(set(names)) == len(names)
    import qevict_jax

    assert qevict_jax.available_methods() == names and qevict_jax.make_method is make_method


def kivi_expected_bytes(cfg, caps, batch: int, itemsize: int) -> int:
    """KIVI's cache: full-precision ring + every window's codes and f16 grids + per-slot metadata."""
    L, hkv, d, w, bits = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, caps.window, caps.bits
    ring = 2 * hkv * caps.ring * d * itemsize
    per_window = (
        hkv * (d * w * bits // 8 + 2 * d * 2 + w * d * bits // 8 + 2 * w * 2) + 4 + 1 + 4
    )  # win, act, score
    return L * batch * (ring + caps.nl * per_window)


@pytest.mark.slow
@pytest.mark.parametrize("name", available_methods())
def test_every_method_on_smollm2(smol, name):
    model, ids = smol
    cfg = model.cfg
    kw = {"recent": 32} if name in (*VARIANTS, "qevict-gates") else {}  # R = 128 does not fit at this β
    if "gates" in default_method(name).options:
        kw["gates"] = UNTRAINED  # no gate checkpoint ships with the package: untrained gates, said explicitly
    method = make_method(name) if name == "full" else with_repeat_prompt(make_method(name, BETA, **kw))
    sampler = SamplerConfig(max_new_tokens=NEW)
    assert bucket_length(PROMPT) == bucket_length(PROMPT - 10)
    res = generate(model, [ids[:PROMPT]], sampler, method)
    traces = dict(gen.EXECUTABLES.compilations)
    res2 = generate(model, [ids[7 : 7 + PROMPT - 10]], sampler, method)
    assert dict(gen.EXECUTABLES.compilations) == traces, "a same-bucket prompt compiled again"
    assert len(res.tokens[0]) == NEW and len(res2.tokens[0]) == NEW
    for leaf in jax.tree.leaves(res.cache):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.isfinite(np.asarray(leaf, np.float32)).all()
    dtype = gen.DEFAULT_KV_DTYPE  # the cache is stored in 16 bits whatever the compute dtype
    other = {jnp.dtype(t) for t in (jnp.float32, jnp.float16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_)}
    if name == "full":  # 16-bit words (kv.to_words) of a bfloat16 cache
        assert res.cache.dtype == jnp.dtype(dtype) and res.cache.keys().dtype == jnp.dtype(dtype)
    else:  # K/V in bf16; the window engine's F tier as 16-bit words of it (TieredCache.f_k_words)
        words = {jnp.dtype(jnp.uint16)} if isinstance(res.cache, TieredCache) else set()
        assert {leaf.dtype for leaf in jax.tree.leaves(res.cache)} - other == {jnp.dtype(dtype)} | words
        if words:
            assert res.cache.f_k.dtype == jnp.dtype(dtype) and res.cache.f_v.dtype == jnp.dtype(dtype)
    if getattr(method, "uses_budget", False):
        budget_tokens = bucket_floor(PROMPT) + NEW
        assert res.cache_bytes <= BETA * full_kv_bytes(cfg, budget_tokens, dtype)
        assert res.memory_ratio < 1.0  # compresses something
    elif name.startswith("kivi"):
        caps = res.cache.caps
        assert caps.nf == 0 and caps.nl == caps.nq  # nothing evicted, every window has a Q slot
        assert int(np.asarray(res.cache.evictions).sum()) == 0
        expected = kivi_expected_bytes(cfg, caps, 1, jnp.dtype(dtype).itemsize)
        counters = 4 * (7 + caps.ring_windows)  # per layer: 7 int32 counters, ring window scores
        assert res.cache_bytes - expected == counters * cfg.num_layers
    print(f"\n{name}: measured memory ratio {res.memory_ratio:.4f} ({res.cache_bytes} bytes)")


@pytest.mark.parametrize("name", [m for m in available_methods() if not m.startswith("kivi")])
def test_every_method_with_room_for_everything_equals_full_kv(name):
    """With a budget that holds the whole sequence, no method may change the model's predictions: the
    teacher-forced log-probabilities equal Full-KV's (KIVI quantizes regardless of budget: excluded)."""

    from models.config import ModelConfig
    from qevict_jax.runtime.teacher_forced import teacher_forced

    cfg = ModelConfig(
        family="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
        num_kv_heads=2, head_dim=8, max_position_embeddings=2048,
    )  # fmt: skip
    model = decisive_model(cfg)
    rs = np.random.RandomState(0)
    prompt = list(rs.randint(0, cfg.vocab_size, 300))
    targets = rs.randint(0, cfg.vocab_size, (1, 6))
    ref = teacher_forced(model, [prompt], targets, FullKV()).logprobs
    kw = {"gates": UNTRAINED} if "gates" in default_method(name).options else {}
    got = teacher_forced(model, [prompt], targets, roomy_method(name, cfg, len(prompt) + 6, **kw)).logprobs
    np.testing.assert_allclose(got, ref, atol=1e-4)
