"""KVzip's context reconstruction: the column maxima and the attention of queries that follow earlier keys
against float64, the whole pass against a float64 reference on a tiny model (dense attention, each row
alone, no padding), the method's prompt pass inside it against that pass run on its own, the kvzip pool's
kept set against the scores, and the kvzip methods end to end with a context compressed before its
question."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import record_qkv

from models.attention import column_max, flash_causal_attention
from qevict_jax.core.kv import CacheRequest
from qevict_jax.eval.testing import ByteTokenizer, tiny_model
from qevict_jax.methods.registry import bind_tokenizer, make_method
from qevict_jax.rankings.prompt import TokenPrior
from qevict_jax.rankings.reconstruction import (
    REPEAT_INSTRUCTION,
    Reconstruction,
    reconstruction_scores,
    repeat_prompt,
)
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.prefill import prefill_logits
from qevict_jax.runtime.sampling import SamplerConfig

PROMPT = (3, 4, 5, 6)


def np_column_max(q, k, q_pos, k_pos, rows):
    """float64: max over the G heads of each KV head and the queries in rows [B, T] -> [B, Hkv, T]."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    best = np.zeros((b, hkv, t))
    for bi in range(b):
        for hi in range(h):
            s = q[bi, :, hi] @ k[bi, :, hi // g].T / np.sqrt(d)
            ok = (k_pos[bi][None] <= q_pos[bi][:, None]) & (k_pos[bi][None] >= 0)
            s = np.where(ok, s, -np.inf)
            p = np.where(ok, np.exp(s - s.max(-1, keepdims=True)), 0.0)
            p /= p.sum(-1, keepdims=True)
            best[bi, hi // g] = np.maximum(best[bi, hi // g], (p * rows[bi][:, None]).max(0))
    return best


@pytest.mark.parametrize(("t", "chunk", "start"), [(37, 8, 16), (64, 16, 32), (20, 64, 0), (45, 8, 0)])
def test_column_max_matches_float64(t, chunk, start):
    """Queries from ``start`` on, keys before them (all keys when start is 0), lse over all keys."""
    rs = np.random.RandomState(t)
    b, h, hkv, d = 2, 4, 2, 8
    q, k, v = rs.randn(b, t, h, d) * 1.5, rs.randn(b, t, hkv, d) * 1.5, rs.randn(b, t, hkv, d)
    total = np.array([t, t - 5])
    pos = np.broadcast_to(np.arange(t), (b, t))
    k_pos = np.where(pos < total[:, None], pos, -1)
    rows = (pos >= max(start, t // 2)) & (pos < total[:, None])
    f = lambda a: jnp.asarray(a, jnp.float32)
    blocks = dict(sliding_window=None, chunk=chunk)
    _, lse = flash_causal_attention(
        f(q[:, start:]), f(k), f(v), q_pos=jnp.asarray(pos[:, start:]), k_pos=jnp.asarray(k_pos), **blocks
    )
    keys = start or t
    got = column_max(
        f(q[:, start:]), f(k[:, :keys]), lse=lse, q_rows=jnp.asarray(rows[:, start:]),
        q_pos=jnp.asarray(pos[:, start:]), k_pos=jnp.asarray(k_pos[:, :keys]), **blocks,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), np_column_max(q, k, pos, k_pos, rows)[..., :keys], atol=2e-6)


@pytest.mark.parametrize(("t", "chunk", "start"), [(40, 8, 16), (70, 16, 48), (33, 32, 32)])
def test_flash_attention_of_the_last_queries_matches_float64(t, chunk, start):
    """q is the last t - start tokens of k, v: out and lse as dense float64 attention of those rows."""
    rs = np.random.RandomState(start)
    b, h, hkv, d = 2, 4, 2, 8
    q, k, v = rs.randn(b, t, h, d), rs.randn(b, t, hkv, d), rs.randn(b, t, hkv, d)
    pos = np.broadcast_to(np.arange(t), (b, t))
    k_pos = np.where(pos < np.array([[t], [t - 9]]), pos, -1)
    out, lse = flash_causal_attention(
        jnp.asarray(q[:, start:], jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
        q_pos=jnp.asarray(pos[:, start:]), k_pos=jnp.asarray(k_pos), sliding_window=None, chunk=chunk,
    )  # fmt: skip
    g = h // hkv
    logits = np.einsum("bqkgd,bskd->bkgqs", q[:, start:].reshape(b, t - start, hkv, g, d), k) / d**0.5
    ok = (k_pos[:, None, None, None, :] <= pos[:, None, None, start:, None]) & (
        k_pos[:, None, None, None] >= 0
    )
    logits = np.where(ok, logits, -np.inf)
    m = logits.max(-1, keepdims=True)
    p = np.exp(logits - m)
    want_lse = m[..., 0] + np.log(p.sum(-1))
    want = np.einsum("bkgqs,bskd->bqkgd", p / p.sum(-1, keepdims=True), v).reshape(b, t - start, h, d)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5)
    with pytest.raises(ValueError, match="multiple of the chunk"):
        flash_causal_attention(
            jnp.asarray(q[:, start + 1 :]), jnp.asarray(k), jnp.asarray(v), q_pos=jnp.asarray(pos[:, start + 1 :]),
            k_pos=jnp.asarray(k_pos), sliding_window=None, chunk=chunk,
        )  # fmt: skip


def reference_scores(model, row: list[int], n_sink: int) -> np.ndarray:
    """float64 KVzip scores [L, Hkv, len(row)] of one row: [row | PROMPT | row[n_sink:]] through dense
    attention, then each prompt key's largest probability from a query past the row, per KV head."""
    q, k, _ = record_qkv(model, [*row, *PROMPT, *row[n_sink:]])
    t = q.shape[1]
    n = len(row)
    rows = (np.arange(t) >= n)[None]
    p = np.arange(t)[None]
    out = [np_column_max(q[i][None], k[i][None], p, p, rows)[0, :, :n] for i in range(model.cfg.num_layers)]
    return np.stack(out)


def test_reconstruction_scores_match_float64_reference():
    _, model = tiny_model(seed=1)
    rs = np.random.RandomState(0)
    rows = [list(rs.randint(2, 200, size=n)) for n in (70, 53)]
    tokens = np.zeros((2, 80), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    recon = Reconstruction(prompt=PROMPT, n_sink=4, chunk=16)
    got = np.asarray(
        reconstruction_scores(model, jnp.asarray(tokens), jnp.asarray([70, 53], jnp.int32), recon)
    )
    assert got.shape == (2, 2, 2, 80)  # [L, B, Hkv, P]
    for i, r in enumerate(rows):
        np.testing.assert_allclose(got[:, i, :, : len(r)], reference_scores(model, r, 4), atol=2e-5)
        assert not got[:, i, :, len(r) :].any()


@pytest.mark.parametrize("name", ["kvzip", "qevict-kvzip"])
def test_prompt_pass_inside_the_reconstruction_is_the_prompts_own(name):
    """The pass that reconstructs the prompt also compresses it: logits and cache equal the method's own
    prompt pass over the prompt alone, given the scores of the reconstruction run without a method."""
    cfg, model = tiny_model(seed=3)
    rs = np.random.RandomState(2)
    lengths = jnp.asarray([740, 650], jnp.int32)
    tokens = jnp.asarray(rs.randint(2, 200, size=(2, 768)) * (np.arange(768) < np.asarray(lengths)[:, None]))
    method = dataclasses.replace(make_method(name, 0.3), repeat_prompt=PROMPT)
    run = functools.partial(
        prefill_logits, model, tokens, lengths, method, max_new_tokens=4, budget_tokens=744
    )
    logits, cache = jax.jit(lambda: run(kv_dtype=jnp.float32))()

    def apart():
        scores = reconstruction_scores(model, tokens, lengths, method.reconstruction)
        request = CacheRequest(model_cfg=cfg, batch=2, prompt_capacity=768, max_new_tokens=4, dtype=jnp.float32,
                               budget_tokens=744)  # fmt: skip
        positions = jnp.broadcast_to(jnp.arange(768, dtype=jnp.int32), (2, 768))
        return model(tokens, positions, method.init_cache(request, lengths), attend=method.prefill_attend,
                     logit_index=lengths - 1, weights=TokenPrior(scores=scores), stacked_cache=method.stacked_cache)  # fmt: skip

    want_logits, want_cache = jax.jit(apart)()
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-4)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(want_cache), strict=True):
        if jnp.issubdtype(got.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_layout_places_the_reconstruction_on_a_block_boundary():
    recon = Reconstruction(prompt=(7, 8), n_sink=2, chunk=4)
    tokens = jnp.asarray([[10, 11, 12, 13, 14, 0], [20, 21, 22, 0, 0, 0]], jnp.int32)
    out, positions, k_pos = recon.layout(tokens, jnp.asarray([5, 3], jnp.int32))
    assert recon.blocks(6) == (4, 8)
    np.testing.assert_array_equal(
        np.asarray(out),
        [
            [10, 11, 12, 13, 14, 0, 0, 0, 7, 8, 12, 13, 14, 0, 0, 0],
            [20, 21, 22, 0, 0, 0, 0, 0, 7, 8, 22] + [0] * 5,
        ],
    )
    np.testing.assert_array_equal(
        np.asarray(k_pos),
        [
            [0, 1, 2, 3, 4, -1, -1, -1, 5, 6, 7, 8, 9, -1, -1, -1],
            [0, 1, 2, -1, -1, -1, -1, -1, 3, 4, 5] + [-1] * 5,
        ],
    )
    np.testing.assert_array_equal(np.asarray(positions)[:, :6], np.broadcast_to(np.arange(6), (2, 6)))


def test_repeat_prompt_is_instruction_then_turn_change():
    tok = ByteTokenizer()
    assert repeat_prompt(tok) == tuple(tok.encode(REPEAT_INSTRUCTION + "<|assistant|>", add_bos=False))


def test_kvzip_pool_keeps_each_layers_top_scores():
    """The pool holds, per layer, the top Hkv * C scores over every head (no safeguard), sinks apart."""
    cfg, model = tiny_model(seed=2)
    rs = np.random.RandomState(1)
    n = 200
    tokens = jnp.asarray(rs.randint(2, 200, size=(1, n)), jnp.int32)
    lengths = jnp.asarray([n], jnp.int32)
    method = dataclasses.replace(make_method("kvzip", 0.3), repeat_prompt=PROMPT)
    _, cache = jax.jit(
        lambda t, ln: prefill_logits(
            model, t, ln, method, max_new_tokens=4, budget_tokens=n + 4, kv_dtype=jnp.float32
        )
    )(tokens, lengths)
    scores = np.asarray(reconstruction_scores(model, tokens, lengths, method.reconstruction))[
        :, 0
    ]  # [L, Hkv, n]
    slots = cache.pool_pos.shape[-1]
    for layer in range(cfg.num_layers):
        pos, head = np.asarray(cache.pool_pos[layer, 0]), np.asarray(cache.pool_head[layer, 0])
        kept = {(int(h), int(p)) for p, h in zip(pos, head, strict=True) if p >= 0}
        assert len(kept) == slots
        eligible = scores[layer][:, 4:]  # past the 4 sinks; no recent region
        order = np.argsort(-eligible.reshape(-1), kind="stable")[:slots]
        want = {(int(i // (n - 4)), int(i % (n - 4)) + 4) for i in order}
        cutoff = np.sort(eligible.reshape(-1))[::-1][slots - 1]
        # equal to the reference's top set, up to ties at the cut
        assert {x for x in kept ^ want if abs(scores[layer][x[0], x[1]] - cutoff) > 1e-6} == set()


@pytest.mark.parametrize("name", ["kvzip", "qevict-kvzip", "r2-kvzip"])
def test_kvzip_methods_compress_a_context_before_its_question(name):
    _, model = tiny_model()
    rs = np.random.RandomState(0)
    prompts = [list(rs.randint(2, 200, size=n)) for n in (900, 800)]
    method = bind_tokenizer(make_method(name, 0.3), ByteTokenizer())
    result = generate(model, prompts, SamplerConfig(4), method, question_starts=[850, 760])
    assert result.compressed and result.memory_ratio < 0.35
    assert all(len(t) == 4 for t in result.tokens)


def test_kvzip_without_its_repeat_prompt_is_a_clear_error():
    _, model = tiny_model()
    with pytest.raises(ValueError, match="repeat prompt"):
        generate(model, [[i % 250 + 2 for i in range(900)]], SamplerConfig(2), make_method("kvzip", 0.3))
