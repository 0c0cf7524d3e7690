"""Tiered decode attention: exactness against Full-KV, against a float64 numpy KIVI reference, the ledger
reference partial, and tier masses."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_quant import np_pack, np_quantize
from tiny import roomy_method

from models.config import ModelConfig
from models.model import LayerContext, Transformer
from pallas_kernels.formats import ChannelKeys
from pallas_kernels.quant import QuantizedWindows
from pallas_kernels.reference import ledger_partial
from pallas_kernels.tiers import Partial, QuantTier, dense_partial, merge_tiers
from qevict_jax.core.cache import init_cache
from qevict_jax.core.config import CacheConfig, Capacities, ring_capacity
from qevict_jax.core.kv import CacheRequest
from qevict_jax.core.q_keys import q_key
from qevict_jax.engines.window import decode_layer, prefill_layer, tier_attention
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.registry import cache_stats, make_method
from qevict_jax.rankings.scoring import Ranking

MODEL = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)
INV_FREQ = np.asarray(MODEL.inv_freq())


def np_rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE in float64: x [..., T, D] at pos [..., T]."""
    ang = pos[..., None].astype(np.float64) * INV_FREQ
    cos, sin = np.cos(ang), np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def np_softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, bias: np.ndarray | float = 0.0):
    """q [Hkv, G, D], k, v [Hkv, N, D] -> (out [Hkv, G, D], probs [Hkv, G, N]) in float64; ``bias`` [N]
    is added to the scaled logits."""
    s = np.einsum("kgd,knd->kgn", q, k) / np.sqrt(q.shape[-1]) + bias
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("kgn,knd->kgd", p, v), p


# ------------------------------------------------------------------------------ model level vs Full-KV


def run_model(model, method, tokens, lengths, prompt_cap, steps, budget_tokens):
    b = tokens.shape[0]
    cache = method.init_cache(CacheRequest(model_cfg=MODEL, batch=lengths.shape[0], prompt_capacity=prompt_cap, max_new_tokens=steps, dtype=jnp.float32, budget_tokens=budget_tokens), lengths)
    pos = jnp.broadcast_to(jnp.arange(prompt_cap), (b, prompt_cap))
    logits, cache = model(
        tokens[:, :prompt_cap], pos, cache, attend=method.prefill_attend, logit_index=lengths - 1,
        stacked_cache=method.stacked_cache,
    )  # fmt: skip
    inv_freq = jnp.asarray(MODEL.inv_freq(), jnp.float32)

    def decode_step(c, t, p):
        logits, c = model(t[:, None], p[:, None], c, attend=method.decode_attend, stacked_cache=method.stacked_cache)
        return logits, method.decode_route(c, inv_freq)

    step = jax.jit(decode_step)
    outs = [logits]
    for i in range(steps):
        lg, cache = step(cache, tokens[jnp.arange(b), lengths + i], lengths + i)
        outs.append(lg[:, 0])
    return np.stack([np.asarray(o) for o in outs]), cache


def test_everything_in_f_matches_full_kv():
    model = Transformer(MODEL, rngs=nnx.Rngs(0))
    p_cap, steps = 48, 14
    lengths = jnp.asarray([48, 37], jnp.int32)
    tokens = jax.random.randint(jax.random.key(1), (2, p_cap + steps), 0, MODEL.vocab_size)
    ref, _ = run_model(model, FullKV(), tokens, lengths, p_cap, steps, 0)
    # q_frac 0.5 (the default's 0.85 would leave F room for only part of the roomy budget): every window in F
    method = roomy_method("qevict", MODEL, 37 + steps, recent=8, omega=4, q_frac=0.5)
    out, cache = run_model(model, method, tokens, lengths, p_cap, steps, 37 + steps)
    stats = cache_stats(cache)
    assert stats["routing_events"] == [3, 3] and stats["evictions"] == [0, 0]
    assert (np.asarray(cache.f_win) >= 0).sum() > 0  # windows really live in F
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ layer level references

S, W, R = 2, 4, 4
CAPS_Q = Capacities(
    sink=S, window=W, recent=R, ring=ring_capacity(R, W, 8), nf=0, nq=8, nl=8, nw_max=16, bits=2, omega=8
)
CAPS_F = Capacities(
    sink=S, window=W, recent=R, ring=ring_capacity(R, W, 8), nf=8, nq=0, nl=0, nw_max=16, bits=2, omega=8
)
T = 32
LENGTHS = np.array([32, 27], np.int32)


def layer_inputs(seed: int, t: int):
    rng = np.random.default_rng(seed)
    h, hkv, d = MODEL.num_heads, MODEL.num_kv_heads, MODEL.head_dim
    q = rng.standard_normal((2, t, h, d)).astype(np.float32)
    k = rng.standard_normal((2, t, hkv, d)).astype(np.float32) * np.linspace(0.5, 3, d).astype(np.float32)
    v = rng.standard_normal((2, t, hkv, d)).astype(np.float32)
    return q, k, v


@functools.cache
def jitted_layer(caps: Capacities):
    ranking = Ranking()
    inv = jnp.asarray(INV_FREQ, jnp.float32)

    def run(q, k, v, lengths, q1, k1, v1):
        cache = jax.tree.map(lambda x: x[0], init_cache(caps, MODEL, 2, jnp.float32, lengths))
        pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        ctx = LayerContext(positions=pos, layer=jnp.int32(0), inv_freq=inv, cfg=MODEL)
        _, cache = prefill_layer(q, k, v, cache, ctx, ranking=ranking, config=CacheConfig(prefill_chunk=16))
        ctx1 = LayerContext(positions=lengths[:, None], layer=jnp.int32(0), inv_freq=inv, cfg=MODEL)
        out, cache1 = decode_layer(q1, k1, v1, cache, ctx1, ranking=ranking)
        att = tier_attention(
            q1[:, 0].reshape(2, MODEL.num_kv_heads, -1, MODEL.head_dim), cache1, lengths, inv, None
        )
        return out, cache, cache1, att

    return jax.jit(run)


def np_kivi_keys(k_post: np.ndarray, start: int) -> np.ndarray:
    """Post-RoPE keys [Hkv, W, D] of one window -> KIVI dequantized (per channel, pre-RoPE), re-rotated."""
    pos = start + np.arange(W)
    pre = np_rope(k_post.astype(np.float64), -pos)
    c, s, z = np_quantize(np.swapaxes(pre, -1, -2).astype(np.float32), 2)
    deq = c * s.astype(np.float64)[..., None] + z.astype(np.float64)[..., None]
    return np_rope(np.swapaxes(deq, -1, -2), pos)


def np_kivi_values(v: np.ndarray) -> np.ndarray:
    c, s, z = np_quantize(v.astype(np.float32), 2)
    return c * s.astype(np.float64)[..., None] + z.astype(np.float64)[..., None]


@pytest.mark.parametrize(
    ("seed", "q_logit_bias", "biased_mass"), [(0, 0.0, True), (1, 0.0, True), (2, 0.0, True), (0, -1.5, True), (1, -2.0, False)]
)
def test_everything_in_q_matches_numpy_kivi_reference(seed, q_logit_bias, biased_mass):
    """Decode attention over sinks, Q windows and the ring equals float64 softmax attention over the KIVI-
    dequantized keys and values, with ``q_logit_bias`` added to every Q key's logit; the Q slots' masses are
    that softmax's (or, ``biased_mass`` False, the unbiased softmax's) probabilities per window."""
    q, k, v = layer_inputs(seed, T)
    q1, k1, v1 = layer_inputs(seed + 100, 1)
    k1 = (
        np_rope(k1.astype(np.float64).swapaxes(1, 2), LENGTHS[:, None, None])
        .swapaxes(1, 2)
        .astype(np.float32)
    )
    caps = dataclasses.replace(CAPS_Q, q_logit_bias=q_logit_bias, q_biased_mass=biased_mass)
    out, cache, _, att = jitted_layer(caps)(q, k, v, jnp.asarray(LENGTHS), q1, k1, v1)
    assert int(np.asarray(cache.evictions).sum()) == 0
    for b, n in enumerate(LENGTHS):
        routed = max(0, (n - S - R) // W)
        assert int(cache.next_win[b]) == routed and int(cache.ledger.active[b].sum()) == routed
        keys, vals = (
            [k[b, :S].swapaxes(0, 1).astype(np.float64)],
            [v[b, :S].swapaxes(0, 1).astype(np.float64)],
        )
        for w in range(routed):
            sl = slice(S + w * W, S + (w + 1) * W)
            keys.append(np_kivi_keys(k[b, sl].swapaxes(0, 1), S + w * W))
            vals.append(np_kivi_values(v[b, sl].swapaxes(0, 1)))
        tail = slice(S + routed * W, n)
        keys += [k[b, tail].swapaxes(0, 1), k1[b].swapaxes(0, 1)]
        vals += [v[b, tail].swapaxes(0, 1), v1[b].swapaxes(0, 1)]
        qb = q1[b, 0].reshape(MODEL.num_kv_heads, -1, MODEL.head_dim).astype(np.float64)
        keys, vals = np.concatenate(keys, 1), np.concatenate(vals, 1)
        bias = np.zeros(keys.shape[1])
        bias[S : S + routed * W] = q_logit_bias
        want, probs = np_softmax_attend(qb, keys, vals, bias)
        if not biased_mass:
            _, probs = np_softmax_attend(qb, keys, vals)
        got = np.asarray(out[b, 0]).reshape(want.shape)
        # float32 pipeline vs float64: an f16 grid can land one ulp apart (f32 un-rotation and division)
        np.testing.assert_allclose(got, want, atol=5e-5, rtol=0)
        # tier masses: Q slots carry exactly the reference probability mass of their windows (head-mean)
        q_mass = probs[:, :, S : S + routed * W].reshape(*probs.shape[:2], routed, W).sum(-1).mean((0, 1))
        slots = np.asarray(cache.ledger.win[b])
        got_q = np.array([np.asarray(att.q_mass[b])[slots == w][0] for w in range(routed)])
        np.testing.assert_allclose(got_q, q_mass, atol=2e-5)


def test_q_logit_bias_reaches_the_capacities_and_is_checked():
    request = CacheRequest(model_cfg=MODEL, batch=1, prompt_capacity=1024, max_new_tokens=8, dtype=jnp.float32, budget_tokens=1032)
    caps = make_method("qevict", 0.3, q_logit_bias=-1.5, q_biased_mass=False).capacities(request)
    assert (caps.q_logit_bias, caps.q_biased_mass) == (-1.5, False)
    plain = make_method("qevict", 0.3).capacities(request)
    assert (plain.q_logit_bias, plain.q_biased_mass) == (0.0, True)
    assert dataclasses.replace(caps, q_logit_bias=0.0, q_biased_mass=True) == plain  # the bytes do not change
    named = make_method("qevict-discount", 0.3).capacities(request)  # the named method: a discount of 1
    assert (named.q_logit_bias, named.q_biased_mass) == (-1.0, False)
    assert dataclasses.replace(named, q_logit_bias=0.0, q_biased_mass=True) == plain
    with pytest.raises(ValueError, match=r"q_logit_bias must be in \[-1e4, 0\]"):
        make_method("qevict", 0.3, q_logit_bias=0.5)
    gated = make_method("qevict-discount", 0.3, q_bias_gate=0.0).capacities(request)
    assert gated.q_bias_gate == 0.0 and dataclasses.replace(gated, q_bias_gate=None) == named
    assert make_method("qevict-gated", 0.3).capacities(request) == gated  # the named method: gate 0
    with pytest.raises(ValueError, match="q_bias_gate=0.0 gates the Q tier's discount, but q_logit_bias is 0"):
        make_method("qevict", 0.3, q_bias_gate=0.0)
    with pytest.raises(ValueError, match="q_bias_gate must be >= 0"):
        make_method("qevict-discount", 0.3, q_bias_gate=-1.0)


@pytest.mark.parametrize(
    ("seed", "gate", "biased_mass"), [(0, 0.0, True), (1, 0.0, False), (2, 0.3, False), (3, None, False)]
)
def test_gated_discount_matches_float64_softmax(seed, gate, biased_mass):
    """``merge_tiers`` with ``q_bias_gate`` equals float64 softmax attention over sink | F | Q | ring where
    the Q keys' logits are lowered by the bias for exactly the heads whose best F logit leads their best Q
    logit by more than the gate (every head when the gate is None); the masses are per key of that softmax
    (or of the unbiased one) summed per tier, head-averaged."""
    rng = np.random.default_rng(seed)
    b, hkv, g, d, sizes, bias = 2, 2, 4, 16, (3, 5, 7, 4), -1.25
    q = rng.standard_normal((b, hkv, g, d))
    keys = [rng.standard_normal((b, hkv, n, d)) * 1.5 for n in sizes]
    vals = [rng.standard_normal((b, hkv, n, d)) for n in sizes]
    parts = []
    for k, v in zip(keys, vals, strict=True):
        p = dense_partial(jnp.asarray(q[..., None, :], jnp.float32), jnp.asarray(k, jnp.float32),
                          jnp.asarray(v, jnp.float32), jnp.ones((1, 1, 1, 1, k.shape[2]), bool))  # fmt: skip
        parts.append(Partial(p.out[..., 0, :], p.m[..., 0], p.l[..., 0], p.mass[..., 0, :]))
    got = merge_tiers(parts, q_logit_bias=bias, biased_mass=biased_mass, q_bias_gate=gate)

    logits = [np.einsum("bkgd,bknd->bkgn", q, k) / np.sqrt(d) for k in keys]
    lead = logits[1].max(-1) - logits[2].max(-1)  # [B, Hkv, G]
    gated = np.ones_like(lead, bool) if gate is None else lead > gate
    if gate is not None:  # the case splits the heads, so both branches are checked
        assert 0 < gated.sum() < gated.size
    edges = np.cumsum((0, *sizes))
    s_all = np.concatenate(logits, -1)

    def softmax(s):
        e = np.exp(s - s.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    biased = s_all.copy()
    biased[..., edges[2] : edges[3]] += np.where(gated, bias, 0.0)[..., None]
    probs = softmax(biased)
    want = np.einsum("bkgn,bknd->bkgd", probs, np.concatenate(vals, 2))
    np.testing.assert_allclose(np.asarray(got.out), want, atol=2e-5, rtol=0)
    mass_probs = probs if biased_mass else softmax(s_all)
    for i, tier_mass in enumerate((got.sink_mass, got.f_mass, got.q_mass, got.ring_mass)):
        want_mass = mass_probs[..., edges[i] : edges[i + 1]].mean((1, 2))  # [B, N_tier]
        np.testing.assert_allclose(np.asarray(tier_mass), want_mass, atol=2e-6)


@pytest.mark.parametrize("caps", [CAPS_Q, CAPS_F], ids=["all-q", "all-f"])
def test_tier_masses_sum_to_one(caps):
    q, k, v = layer_inputs(7, T)
    q1, k1, v1 = layer_inputs(8, 1)
    _, _, cache1, att = jitted_layer(caps)(q, k, v, jnp.asarray(LENGTHS), q1, k1, v1)
    masses = (att.sink_mass, att.f_mass, att.q_mass, att.ring_mass)
    total = sum(np.asarray(m).sum(-1) for m in masses)
    assert total.shape == (2,)
    np.testing.assert_allclose(total, 1.0, atol=1e-5)
    if caps is CAPS_F:  # everything kept exactly: per-window F mass equals the dense softmax mass
        for b, n in enumerate(LENGTHS):
            keys = np.concatenate([k[b, :n], k1[b]], 0).swapaxes(0, 1).astype(np.float64)
            vals = np.concatenate([v[b, :n], v1[b]], 0).swapaxes(0, 1).astype(np.float64)
            qb = q1[b, 0].reshape(MODEL.num_kv_heads, -1, MODEL.head_dim).astype(np.float64)
            _, probs = np_softmax_attend(qb, keys, vals)
            for slot, w in enumerate(np.asarray(cache1.f_win[b])):
                if w >= 0:
                    want = probs[:, :, S + w * W : S + (w + 1) * W].sum(-1).mean()
                    np.testing.assert_allclose(np.asarray(att.f_mass[b, slot]), want, atol=1e-6)


def test_ledger_reference_matches_float64():
    rng = np.random.default_rng(0)
    b, hkv, g, d, nl, w, bits = 2, 2, 3, 16, 5, 8, 2
    per = 8 // bits
    q = rng.standard_normal((b, hkv, g, d)).astype(np.float32)
    kcodes = rng.integers(0, 1 << bits, (b, hkv, nl, d, w)).astype(np.uint8)
    vcodes = rng.integers(0, 1 << bits, (b, hkv, nl, w, d)).astype(np.uint8)
    ks = rng.uniform(0.1, 1, (b, hkv, nl, d)).astype(np.float16)
    kz = rng.uniform(-2, 0, (b, hkv, nl, d)).astype(np.float16)
    vs = rng.uniform(0.1, 1, (b, hkv, nl, w)).astype(np.float16)
    vz = rng.uniform(-2, 0, (b, hkv, nl, w)).astype(np.float16)
    start = rng.integers(0, 500, (b, nl)).astype(np.int32)
    valid = np.array([[True, False, True, True, False], [False, False, False, False, False]])
    out, m, lsum, slot_mass = ledger_partial(
        q,
        QuantTier(
            QuantizedWindows(np_pack(kcodes, bits), ks, kz, np_pack(vcodes, bits), vs, vz), start, valid
        ),
        jnp.asarray(INV_FREQ, jnp.float32),
        window=w,
        fmt=ChannelKeys(bits),
    )
    assert np_pack(kcodes, bits).shape[-1] == w // per
    kpre = kcodes * ks.astype(np.float64)[..., None] + kz.astype(np.float64)[..., None]  # [B, Hkv, NL, D, W]
    kpost = np_rope(np.swapaxes(kpre, -1, -2), start[:, None, :, None] + np.arange(w))  # [B, Hkv, NL, W, D]
    vhat = vcodes * vs.astype(np.float64)[..., None] + vz.astype(np.float64)[..., None]
    s = np.einsum("bkgd,bkntd->bkgnt", q.astype(np.float64), kpost) / np.sqrt(d)
    mask = valid[:, None, None, :, None]
    m_ref = np.where(mask, s, -np.inf).max((-1, -2))
    row0 = np.s_[0]
    p = np.where(mask, np.exp(s - m_ref[..., None, None]), 0.0)
    np.testing.assert_allclose(np.asarray(m)[row0], m_ref[row0], atol=1e-5)
    np.testing.assert_allclose(np.asarray(lsum)[row0], p.sum((-1, -2))[row0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(slot_mass)[row0], p.sum(-1)[row0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(out)[row0], np.einsum("bkgnt,bkntd->bkgd", p, vhat)[row0], rtol=1e-5, atol=1e-5
    )
    # a row without a valid slot contributes nothing (and no NaN)
    assert np.all(np.asarray(lsum)[1] == 0) and np.all(np.asarray(out)[1] == 0)
    assert np.all(np.asarray(slot_mass)[1] == 0) and np.all(np.isfinite(np.asarray(m)))


@dataclasses.dataclass(frozen=True)
class GivenScores(Ranking):
    """A ranking whose prompt window scores are given (placement tests)."""

    scores: tuple[float, ...] = ()

    def prefill_window_scores(self, prompt, *, sink, window, num_windows):
        s = jnp.asarray(self.scores, jnp.float32)[:num_windows]
        return jnp.broadcast_to(s, (prompt.q.shape[0], num_windows))


def prefill_one_layer(caps: Capacities, ranking: Ranking, seed: int):
    """One layer's cache after the prefill of random inputs (rows of LENGTHS) placed by ``ranking``, and its
    keys k [2, T, Hkv, D]."""
    q, k, v = layer_inputs(seed, T)
    lengths = jnp.asarray(LENGTHS)
    cache = jax.tree.map(lambda x: x[0], init_cache(caps, MODEL, 2, jnp.float32, lengths))
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    ctx = LayerContext(
        positions=pos, layer=jnp.int32(0), inv_freq=jnp.asarray(INV_FREQ, jnp.float32), cfg=MODEL
    )
    _, cache = prefill_layer(q, k, v, cache, ctx, ranking=ranking, config=CacheConfig(prefill_chunk=16))
    return cache, k


@pytest.mark.parametrize(
    "spill, nf, want",
    [
        (0, 2, [{1, 3}, {1, 3}]),
        (1, 2, [{3, 4}, {3, 4}]),  # the window after the best is ranked with its score
        (2, 3, [{3, 4, 5}, {1, 3, 4}]),  # row 1 routes windows 0..4 only
    ],
)
def test_prefill_placement_ranks_the_next_windows_with_their_start(spill, nf, want):
    """Placement with ``spill`` windows: a window is ranked by the highest score of itself and the ``spill``
    windows before it (``windows.spilled_key``); the tiers take the top windows (F only here), and the
    scores they store stay each window's own."""
    caps = Capacities(
        sink=S, window=W, recent=R, ring=ring_capacity(R, W, 8), nf=nf, nq=0, nl=0, nw_max=16, bits=2, omega=8
    )
    given = (1.0, 5.0, 0.5, 9.0, 0.1, 0.2, 3.0, 0.0)
    ranking = GivenScores(scores=given, spill=spill)
    cache, _ = prefill_one_layer(caps, ranking, seed=3)
    for b in range(2):
        f_win = np.asarray(cache.f_win[b])
        held = f_win >= 0
        assert set(f_win[held].tolist()) == want[b]
        np.testing.assert_array_equal(np.asarray(cache.f_score[b])[held], np.asarray(given, np.float32)[f_win[held]])


def test_qevict_keynorm_places_the_lowest_key_norm_windows_in_f_then_q():
    """``qevict-keynorm`` (the question-agnostic configuration) at prefill: F holds the routed windows with the
    lowest head-mean key norm, Q the next ones, the rest is evicted (float64 numpy key norms as reference)."""
    method = make_method("qevict-keynorm", spill=0)
    assert method.ranking.name == "keynorm" and method.cache.q_frac == 0.5
    nf, nq = 2, 2
    caps = Capacities(
        sink=S, window=W, recent=R, ring=ring_capacity(R, W, 8), nf=nf, nq=nq, nl=nq, nw_max=16, bits=2, omega=8
    )
    cache, k = prefill_one_layer(caps, method.ranking, seed=7)
    norms = np.linalg.norm(np.asarray(k, np.float64), axis=-1)  # [B, T, Hkv]
    for b in range(2):
        routed = (int(LENGTHS[b]) - R - S) // W  # windows that left the recent region
        win_norm = [norms[b, S + w * W : S + (w + 1) * W].mean() for w in range(routed)]
        order = [int(w) for w in np.argsort(win_norm, kind="stable")]
        f_win = np.asarray(cache.f_win[b])
        active = np.asarray(cache.ledger.active[b])
        assert set(f_win[f_win >= 0].tolist()) == set(order[:nf])
        assert set(np.asarray(cache.ledger.win[b])[active].tolist()) == set(order[nf : nf + nq])


@pytest.mark.parametrize("q_rank", ["keynorm", "blend"])
def test_a_q_tier_ranked_by_key_norm_keeps_f_by_attention_and_q_by_key_norm(q_rank):
    """``q_rank`` at prefill: F holds the top windows by the ranking's score; among the rest, Q holds those
    with the lowest head-mean key norm ("keynorm") or those in the top of either order ("blend": the better
    of the two rank shares). Each ledger entry stores its window's key-norm score. Float64 numpy norms."""
    nf, nq = 1, 3
    caps = Capacities(
        sink=S, window=W, recent=R, ring=ring_capacity(R, W, 8), nf=nf, nq=nq, nl=nq, nw_max=16, bits=2, omega=8,
        q_rank=q_key(q_rank),
    )  # fmt: skip
    given = (1.0, 5.0, 0.5, 9.0, 0.1, 0.2, 3.0, 0.0)
    cache, k = prefill_one_layer(caps, GivenScores(scores=given), seed=11)
    norms = np.linalg.norm(np.asarray(k, np.float64), axis=-1)  # [B, T, Hkv]
    for b in range(2):
        routed = (int(LENGTHS[b]) - R - S) // W
        norm_score = np.asarray([-norms[b, S + w * W : S + (w + 1) * W].mean() for w in range(routed)])
        by_score = [int(w) for w in np.argsort(-np.asarray(given[:routed]), kind="stable")]
        rest = [w for w in range(routed) if w not in by_score[:nf]]
        norm_order = sorted(rest, key=lambda w: -norm_score[w])
        if q_rank == "keynorm":
            want_q = norm_order[:nq]
        else:
            shares = [{w: i / len(rest) for i, w in enumerate(o)} for o in ([w for w in by_score if w in rest], norm_order)]
            s_share, n_share = shares
            want_q = sorted(rest, key=lambda w: min(s_share[w], n_share[w]))[:nq]
        f_win = np.asarray(cache.f_win[b])
        active = np.asarray(cache.ledger.active[b])
        led_win = np.asarray(cache.ledger.win[b])
        assert set(f_win[f_win >= 0].tolist()) == set(by_score[:nf])
        assert set(led_win[active].tolist()) == set(want_q)
        np.testing.assert_allclose(
            np.asarray(cache.ledger.norm_score[b])[active], norm_score[led_win[active]], rtol=1e-5
        )
