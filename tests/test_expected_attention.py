"""Expected attention (kvpress ``ExpectedAttentionPress``): the scores against a float64 reference of the
published formula written from scratch (pre-RoPE queries, dense rotation matrices averaged over the future
positions), the pool's kept set against Ada-KV's selection over those scores on a tiny model, the window
ranking's window scores, and the methods end to end with a context compressed before its question."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import decisive_model, record_qkv, tiny_llama

from qevict_jax.eval.testing import tiny_model
from qevict_jax.methods.registry import make_method
from qevict_jax.rankings.expected_attention import expected_attention_scores
from qevict_jax.rankings.scoring import PromptPass, make_ranking
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.prefill import prefill_logits
from qevict_jax.runtime.sampling import SamplerConfig


def inv_freq(d: int, theta: float = 10000.0) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


def rotation(pos: float, freq: np.ndarray) -> np.ndarray:
    """The dense RoPE matrix [D, D] at ``pos`` (rotate-half layout: channel i pairs with i + D/2)."""
    c, s = np.cos(pos * freq), np.sin(pos * freq)
    return np.block([[np.diag(c), -np.diag(s)], [np.diag(s), np.diag(c)]])


def rope(x: np.ndarray, positions: np.ndarray, freq: np.ndarray) -> np.ndarray:
    """x [T, heads, D] rotated at positions [T] by the dense matrices."""
    return np.stack([x[i] @ rotation(p, freq).T for i, p in enumerate(positions)])


def np_expected_attention(
    q_pre, k, v, start: int, freq, *, n_future=512, n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0.0
) -> np.ndarray:
    """float64, one unpadded row: q_pre [T, H, D] pre-RoPE queries, k, v [T, Hkv, D] (k post-RoPE), the row
    starting at absolute position ``start`` -> [Hkv, T], straight from arXiv 2510.00636 / kvpress 0.5.5."""
    t, h, d = q_pre.shape
    hkv = k.shape[1]
    g = h // hkv
    qs = q_pre[n_sink:]
    mu = qs.mean(0)  # [H, D]
    cov = np.einsum("thi,thj->hij", qs - mu, qs - mu) / qs.shape[0]
    r = np.mean([rotation(p, freq) for p in range(start + t, start + t + n_future)], axis=0)
    mu = mu @ r.T
    cov = r @ cov @ r.T
    out = np.zeros((hkv, t))
    for kv in range(hkv):
        keys = k[n_sink:, kv]  # [N, D]
        probs = []
        for hi in range(kv * g, (kv + 1) * g):
            logit = keys @ mu[hi] / np.sqrt(d)
            if use_covariance:
                logit = logit + np.einsum("nd,de,ne->n", keys, cov[hi], keys) / d / 2
            p = np.exp(logit - logit.max())
            probs.append(p / p.sum())
        score = np.mean(probs, axis=0)
        if use_vnorm:
            score = (score + epsilon) * np.linalg.norm(v[n_sink:, kv], axis=-1)
        out[kv, n_sink:] = score
    out[:, :n_sink] = out.max() + 1.0
    return out


CASES = [  # (B, T, H, Hkv, D, lengths, start)
    (2, 37, 4, 2, 8, (37, 29), 0),
    (1, 64, 6, 2, 16, (64,), 0),
    (3, 20, 2, 2, 4, (20, 9, 12), 100),  # a prompt that does not start the sequence
    (2, 48, 8, 1, 8, (40, 48), 0),  # one KV head for 8 query heads
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "options",
    [{}, {"epsilon": 0.01, "n_future_positions": 64}, {"use_covariance": False}, {"use_vnorm": False, "n_sink": 2}],
)
def test_scores_match_float64_reference(case, options):
    b, t, h, hkv, d, lengths, start = case
    rs = np.random.RandomState(t + h)
    freq = inv_freq(d)
    # queries with a mean away from zero, so that the mean term matters as much as the covariance term
    q_pre = rs.randn(b, t, h, d) + 1.5 * rs.randn(1, 1, h, d)
    k, v = rs.randn(b, t, hkv, d) * 1.5, rs.randn(b, t, hkv, d) * rs.uniform(0.5, 2, (b, t, hkv, 1))
    pos = np.arange(start, start + t)
    q = np.stack([rope(q_pre[i], pos, freq) for i in range(b)])
    f = lambda a: jnp.asarray(a, jnp.float32)
    got = expected_attention_scores(
        f(q), f(k), f(v), positions=jnp.asarray(pos, jnp.int32)[None], lengths=jnp.asarray(lengths, jnp.int32),
        inv_freq=f(freq), **options,
    )  # fmt: skip
    got = np.asarray(got)
    assert got.shape == (b, hkv, t)
    ref_options = {("n_future" if key == "n_future_positions" else key): x for key, x in options.items()}
    for i, n in enumerate(lengths):
        want = np_expected_attention(q_pre[i, :n], k[i, :n], v[i, :n], start, freq, **ref_options)
        np.testing.assert_allclose(got[i, :, :n], want, rtol=2e-4, atol=1e-7)
        assert not got[i, :, n:].any()


def test_window_scores_are_the_best_token_of_any_head():
    """The window engine's score of a window: the largest score over its tokens and every KV head."""
    b, t, h, hkv, d = 2, 45, 4, 2, 8
    rs = np.random.RandomState(5)
    q, k, v = (jnp.asarray(rs.randn(b, t, n, d), jnp.float32) for n in (h, hkv, hkv))
    lengths = jnp.asarray([45, 30], jnp.int32)
    freq = jnp.asarray(inv_freq(d), jnp.float32)
    prompt = PromptPass(q, k, v, lengths, inv_freq=freq)
    got = np.asarray(make_ranking("expected-attention").prefill_window_scores(prompt, sink=5, window=8, num_windows=5))
    tok = np.asarray(
        expected_attention_scores(q, k, v, positions=prompt.positions, lengths=lengths, inv_freq=freq, epsilon=0.01)
    ).max(axis=1)  # [B, T]
    for i, n in enumerate((45, 30)):
        for w in range(5):
            span = tok[i, 5 + 8 * w : min(5 + 8 * (w + 1), n)]
            if span.size:
                assert got[i, w] == pytest.approx(span.max(), rel=1e-6)
            else:
                assert got[i, w] < -1e3  # a window past the prompt's end never competes


def test_a_pass_without_rope_frequencies_is_a_clear_error():
    x = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match="RoPE frequencies"):
        make_ranking("expected-attention").prefill_token_scores(PromptPass(x, x, x, jnp.asarray([8])), None)


def reference_scores(model, row: np.ndarray, epsilon: float) -> np.ndarray:
    """float64 expected-attention scores [L, Hkv, T] of one row of the model: its recorded post-RoPE
    queries rotated back by the dense matrices, then ``np_expected_attention``."""
    q, k, v = record_qkv(model, row)
    t = q.shape[1]
    freq = np.asarray(model.cfg.inv_freq(), np.float64)
    out = [
        np_expected_attention(rope(q[i], -np.arange(t), freq), k[i], v[i], 0, freq, epsilon=epsilon)
        for i in range(model.cfg.num_layers)
    ]
    return np.stack(out)


def adakv_kept(scores: np.ndarray, slots: int, safeguard: float) -> set[tuple[int, int]]:
    """Ada-KV's selection (kvpress ``AdaKVPress``) over scores [Hkv, N]: every head's top
    ``int(safeguard * slots / Hkv)`` first, then the best of the rest over all heads, ``slots`` in all."""
    hkv, n = scores.shape
    forced = scores.copy()
    n_safe = int(slots // hkv * safeguard)
    for h in range(hkv):
        forced[h, np.argsort(-scores[h], kind="stable")[:n_safe]] = np.inf
    order = np.argsort(-forced.reshape(-1), kind="stable")[:slots]
    return {(int(i // n), int(i % n)) for i in order}


def test_pool_keeps_adakv_selection_of_the_reference_scores():
    """The pool holds, per layer, Ada-KV's choice (safeguard 0.2) over the float64 reference's scores of
    the tokens past the 4 sinks (no recent region); the sinks are always kept."""
    cfg = tiny_llama(1024)
    model = decisive_model(cfg)  # peaked attention: the scores, not only the value norms, decide
    rs = np.random.RandomState(2)
    n = 240
    row = rs.randint(2, cfg.vocab_size, size=n)
    tokens, lengths = jnp.asarray(row[None], jnp.int32), jnp.asarray([n], jnp.int32)
    method = make_method("expected-attention", 0.3)
    _, cache = jax.jit(
        lambda t, ln: prefill_logits(model, t, ln, method, max_new_tokens=4, budget_tokens=n + 4, kv_dtype=jnp.float32)
    )(tokens, lengths)
    ref = reference_scores(model, row, epsilon=method.epsilon)  # [L, Hkv, n]
    slots = cache.pool_pos.shape[-1]
    assert slots < cfg.num_kv_heads * (n - 4)  # the budget evicts
    for layer in range(cfg.num_layers):
        pos, head = np.asarray(cache.pool_pos[layer, 0]), np.asarray(cache.pool_head[layer, 0])
        kept = {(int(h), int(p)) for p, h in zip(pos, head, strict=True) if p >= 0}
        assert len(kept) == slots
        eligible = ref[layer][:, 4:]
        want = {(h, p + 4) for h, p in adakv_kept(eligible, slots, 0.2)}
        # equal, up to near-ties at the global cut or at a head's safeguard cut
        cuts = [np.sort(eligible.reshape(-1))[::-1][slots - 1]]
        cuts += [np.sort(eligible[h])[::-1][int(slots // cfg.num_kv_heads * 0.2) - 1] for h in range(cfg.num_kv_heads)]
        sc = ref[layer]
        assert {x for x in kept ^ want if min(abs(sc[x] - c) for c in cuts) >= 1e-5 * abs(sc[x])} == set()
        assert len(kept ^ want) <= 4


@pytest.mark.parametrize("name", ["expected-attention", "qevict-ea", "r2-ea"])
def test_expected_attention_methods_compress_a_context_before_its_question(name):
    _, model = tiny_model()
    rs = np.random.RandomState(0)
    prompts = [list(rs.randint(2, 200, size=n)) for n in (900, 800)]
    method = make_method(name, 0.3)  # nothing to bind: the scores need no tokenizer
    result = generate(model, prompts, SamplerConfig(4), method, question_starts=[850, 760])
    assert result.compressed and result.memory_ratio < 0.35
    assert all(len(t) == 4 for t in result.tokens)
