"""Every baseline's kept set (or quantized values) against an independent float64 numpy reference of the
published rule, on random queries, keys and values; budgets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant import np_quantize

from models.attention import chunked_attention
from models.config import ModelConfig
from models.model import LayerContext
from pallas_kernels.formats import rope_windows
from qevict_jax.core.budget import pyramid_layer_caps
from qevict_jax.core.cache import ring_positions, ring_valid
from qevict_jax.core.kv import CacheRequest, full_kv_bytes
from qevict_jax.engines.window import prefill_layer
from qevict_jax.methods.registry import make_method
from qevict_jax.rankings.attention_scores import restkv_scores
from qevict_jax.rankings.scoring import PromptPass, Ranking, make_ranking
from qevict_jax.rankings.windows import window_sums

MODEL = ModelConfig(
    family="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
B, T, H, HKV, D, G = 2, 96, 4, 2, 8, 2
LENGTHS = np.array([96, 83])


def inputs(seed: int = 0):
    rs = np.random.RandomState(seed)
    q = rs.randn(B, T, H, D) * 1.5
    k = rs.randn(B, T, HKV, D) * 1.5
    v = rs.randn(B, T, HKV, D)
    wo = rs.randn(H * D, MODEL.hidden_size) * 0.3
    return q, k, v, wo


def run_prefill(method, q, k, v, wo, lengths=LENGTHS, layer=0, new=4, budget_tokens=None):
    """One layer's prefill through the method: returns (out, layer cache)."""
    lengths_j = jnp.asarray(lengths, jnp.int32)
    bt = budget_tokens or int(lengths.min()) + new
    cache = method.init_cache(CacheRequest(model_cfg=MODEL, batch=lengths_j.shape[0], prompt_capacity=T, max_new_tokens=new, dtype=jnp.float32, budget_tokens=bt), lengths_j)
    cache = jax.tree.map(lambda x: x[layer], cache)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx = LayerContext(
        positions=pos,
        layer=jnp.int32(layer),
        inv_freq=jnp.asarray(MODEL.inv_freq(), jnp.float32),
        cfg=MODEL,
        wo=jnp.asarray(wo, jnp.float32),
    )
    f = lambda a: jnp.asarray(a, jnp.float32)
    return method.prefill_attend(f(q), f(k), f(v), cache, ctx)


def kept_sets(cache) -> list[list[set[int]]]:
    """Per row, per KV head: the positions in the head pool."""
    pos, head = np.asarray(cache.pool_pos), np.asarray(cache.pool_head)
    return [[set(pos[b][(head[b] == h) & (pos[b] >= 0)].tolist()) for h in range(HKV)] for b in range(B)]


def np_softmax(x, axis=-1):
    x = x - x.max(axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis, keepdims=True)


def np_obs_rows(q, k, end, n_obs):
    """Observation rows of one row: q [T, H, D], k [T, Hkv, D] -> probs [H, n_obs, end] (causal)."""
    rows = []
    for i in range(n_obs):
        p = end - n_obs + i
        s = np.einsum("hd,thd->ht", q[p], np.repeat(k[: p + 1], G, axis=1)) / np.sqrt(D)
        pr = np.zeros((H, end))
        pr[:, : p + 1] = np_softmax(s)
        rows.append(pr)
    return np.stack(rows, axis=1)


def np_avgpool_zero(x, kernel):
    """F.avg_pool1d(kernel, padding=kernel // 2, stride 1, count_include_pad) over the last axis."""
    pad = kernel // 2
    xp = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)])
    return np.stack([xp[..., i : i + kernel].mean(-1) for i in range(x.shape[-1])], axis=-1)


def np_snapkv(q, k, end, n_obs=32, kernel=5):
    """SnapKV scores [Hkv, end - n_obs] of one row (GQA: mean over the group after pooling)."""
    rows = np_obs_rows(q, k, end, n_obs)[..., : end - n_obs]
    pooled = np_avgpool_zero(rows.mean(1), kernel)
    return pooled.reshape(HKV, G, -1).mean(1)


def np_topk_sets(scores, cap):
    """Per head: the positions of the top ``cap`` scores [Hkv, N] (stable, higher first)."""
    return [set(np.argsort(-s, kind="stable")[:cap].tolist()) for s in scores]


def assert_same_sets(got, want, scores=None):
    assert got == want, f"kept {sorted(got)}\nwant {sorted(want)}"


# ------------------------------------------------------------------------------------- prompt methods


def test_snapkv_matches_numpy():
    q, k, v, wo = inputs(0)
    method = make_method("snapkv", 0.5)
    _, cache = run_prefill(method, q, k, v, wo)
    cap = cache.caps.pool_per_head
    assert 0 < cap < LENGTHS.min() - 32  # the budget compresses
    got = kept_sets(cache)
    for b in range(B):
        want = np_topk_sets(np_snapkv(q[b], k[b], LENGTHS[b]), cap)
        for h in range(HKV):
            assert_same_sets(got[b][h], want[h])


def test_pyramid_budgets_match_the_published_rule():
    def ref(mean, layers, prefix, beta):  # kvpress PyramidKVPress.get_layer_budget, window excluded
        lo = mean / beta
        hi = mean * 2 - lo
        if hi >= prefix:
            hi = prefix
            lo = mean * 2 - hi
        steps = (hi - lo) / (layers - 1)
        return [round(hi - i * steps) for i in range(layers)]

    for mean, layers, prefix in [(100, 32, 4000), (40, 30, 60), (10, 4, 1000)]:
        assert list(pyramid_layer_caps(mean, layers, prefix, 20)) == ref(mean, layers, prefix, 20)
    caps = pyramid_layer_caps(100, 32, 4000, 20)
    assert caps[0] > caps[-1] and abs(np.mean(caps) - 100) < 1


def test_pyramidkv_layers_fill_their_budget_with_snapkv_top_k():
    q, k, v, wo = inputs(1)
    method = make_method("pyramidkv", 0.6)
    caps_seen = []
    for layer in (0, MODEL.num_layers - 1):
        _, cache = run_prefill(method, q, k, v, wo, layer=layer)
        lc = cache.caps.layer_caps
        assert len(lc) == MODEL.num_layers and max(lc) <= cache.caps.pool_per_head
        caps_seen.append(lc[layer])
        got = kept_sets(cache)
        for b in range(B):
            want = np_topk_sets(np_snapkv(q[b], k[b], LENGTHS[b]), lc[layer])
            for h in range(HKV):
                assert_same_sets(got[b][h], want[h])
    assert caps_seen[0] > caps_seen[1]  # more tokens in lower layers


def test_adakv_head_adaptive_allocation_matches_numpy():
    q, k, v, wo = inputs(2)
    method = make_method("adakv", 0.5)
    _, cache = run_prefill(method, q, k, v, wo)
    cap = cache.caps.pool_per_head
    got = kept_sets(cache)
    counts = []
    for b in range(B):
        s = np_snapkv(q[b], k[b], LENGTHS[b])  # [Hkv, N]
        n_safe = int(cap * 0.2)
        forced = s.copy()
        for h in range(HKV):
            forced[h, np.argsort(-s[h], kind="stable")[:n_safe]] = np.inf
        flat = np.argsort(-forced.reshape(-1), kind="stable")[: HKV * cap]
        n = s.shape[1]
        for h in range(HKV):
            want = {int(i % n) for i in flat if i // n == h}
            assert_same_sets(got[b][h], want)
            counts.append(len(want))
        assert sum(len(x) for x in got[b]) == HKV * cap  # the pool is exactly the layer's budget
    assert len(set(counts)) > 1  # budgets really differ between heads


def test_criticalkv_matches_numpy():
    q, k, v, wo = inputs(3)
    method = make_method("criticalkv", 0.5)
    _, cache = run_prefill(method, q, k, v, wo)
    cap = cache.caps.pool_per_head
    got = kept_sets(cache)
    w = wo.reshape(H, D, -1)
    for b in range(B):
        s = np_snapkv(q[b], k[b], LENGTHS[b])
        n = s.shape[1]
        l1 = np.stack([np.abs(v[b, :n, h // G] @ w[h]).sum(-1) for h in range(H)]).reshape(HKV, G, n).mean(1)
        s2 = (s + 1e-4) * l1
        for h in range(HKV):
            s2[h, np.argsort(-s[h], kind="stable")[: int(cap * 0.5)]] = np.inf
        want = np_topk_sets(s2, cap)
        for h in range(HKV):
            assert_same_sets(got[b][h], want[h])


def np_restkv(q, k, v, wo, end, cap, n_obs=32, alpha=0.3, min_kernel=5, scale=200.0):
    """ReST-KV scores of one row, transcribed from the reference ``RestKVCluster`` (after-mode, EMA, W_O,
    adaptive pooling), GQA mean over the group at the end. Returns [Hkv, end - n_obs]."""
    rows = np_obs_rows(q, k, end, n_obs)  # [H, n, end]
    pre = end - n_obs
    ema = rows[:, 0, :pre].copy()
    for i in range(1, n_obs):
        ema = alpha * rows[:, i, :pre] + (1 - alpha) * ema
    vv = np.repeat(v[:end], G, axis=1).transpose(1, 0, 2)  # [H, end, D]
    out = np.einsum("hl,hld->hd", ema, vv[:, :pre])
    w = wo.reshape(H, D, -1)
    proj_o = np.einsum("hd,hdc->hc", out, w)
    proj_v = np.einsum("hld,hdc->hlc", vv[:, :pre], w)
    score = ema / (1 - ema) * np.linalg.norm(proj_o[:, None] - proj_v, axis=-1)
    half = n_obs // 2
    kk = min(cap, end)
    first = np.argsort(rows[:, :half], axis=-1, kind="stable")[..., end - kk :]
    second = np.argsort(rows[:, half : 2 * half], axis=-1, kind="stable")[..., end - kk :]
    t_shift = (first - second).astype(np.float64).mean(axis=(1, 2))
    pooled = []
    for h in range(H):
        kernel = max(min_kernel, int(2 * (abs(t_shift[h]) // scale) + 1))
        shift = int(t_shift[h] // scale) if t_shift[h] > 0 else int(t_shift[h] // scale + 1)
        padded = np.pad(score[h], (kernel // 2 - shift, kernel // 2 + shift), mode="edge")
        pooled.append(np.array([padded[i : i + kernel].mean() for i in range(pre)]))
    return np.stack(pooled).reshape(HKV, G, pre).mean(1)


def test_restkv_matches_numpy():
    q, k, v, wo = inputs(4)
    method = make_method("restkv", 0.5)
    _, cache = run_prefill(method, q, k, v, wo)
    cap = cache.caps.pool_per_head
    got = kept_sets(cache)
    for b in range(B):
        want = np_topk_sets(np_restkv(q[b], k[b], v[b], wo, LENGTHS[b], cap), cap)
        for h in range(HKV):
            assert_same_sets(got[b][h], want[h])


def test_restkv_adaptive_pooling_with_large_shifts():
    """Large position shifts between the halves of the observation window widen and shift the kernel."""

    q, k, v, wo = inputs(5)
    end = jnp.asarray(LENGTHS, jnp.int32)
    f = lambda a: jnp.asarray(a, jnp.float32)
    for scale in (3.0, 10.0):
        got = np.asarray(restkv_scores(f(q), f(k), f(v), end, f(wo), n_obs=32, alpha=0.3, sliding_window=None, capacity=12, min_kernel=5, scale=scale))
        for b in range(B):
            want = np_restkv(q[b], k[b], v[b], wo, LENGTHS[b], 12, scale=scale)
            np.testing.assert_allclose(got[b, :, : want.shape[1]], want, rtol=2e-4, atol=1e-6)


def test_keynorm_matches_numpy():
    q, k, v, wo = inputs(6)
    method = make_method("keynorm", 0.5)
    _, cache = run_prefill(method, q, k, v, wo)
    cap = cache.caps.pool_per_head
    got = kept_sets(cache)
    for b in range(B):
        norms = np.linalg.norm(k[b, : LENGTHS[b]], axis=-1).T  # [Hkv, L]
        want = np_topk_sets(-norms, cap)
        for h in range(HKV):
            assert_same_sets(got[b][h], want[h])


# ------------------------------------------------------------------------------------- decode-time methods


def np_causal_mass(q, k, end):
    """Column sums [Hkv, end] (mean over the group) of causal attention of every query < end."""
    s = np.einsum("thd,shd->hts", q[:end], np.repeat(k[:end], G, axis=1)) / np.sqrt(D)
    s = np.where(np.tril(np.ones((end, end), bool)), s, -np.inf)
    return np_softmax(s).sum(1).reshape(HKV, G, end).mean(1)


def decode_steps(method, cache, q_new, k_new, v_new, lengths):
    """Feed decode tokens (q_new [B, N, H, D] ...) to one layer (each step followed by the method's routing,
    as the decode loop runs it after the layer scan); returns the cache after each step."""
    inv = jnp.asarray(MODEL.inv_freq(), jnp.float32)
    caches = []
    for i in range(q_new.shape[1]):
        pos = jnp.asarray(lengths + i, jnp.int32)[:, None]
        ctx = LayerContext(positions=pos, layer=jnp.int32(0), inv_freq=inv, cfg=MODEL, wo=None)
        f = lambda a, i=i: jnp.asarray(a[:, i : i + 1], jnp.float32)
        _, cache = method.decode_attend(f(q_new), f(k_new), f(v_new), cache, ctx)
        stacked = jax.tree.map(lambda x: x[None], cache)  # a one-layer stack
        cache = jax.tree.map(lambda x: x[0], method.decode_route(stacked, inv))
        caches.append(cache)
    return caches


def np_attend_row(q_tok, keys_by_head, k_all):
    """Probabilities per query head over each KV head's visible positions: list over H of dict pos -> p."""
    out = []
    for h in range(H):
        pos = sorted(keys_by_head[h // G])
        s = np.array([q_tok[h] @ k_all[p, h // G] for p in pos]) / np.sqrt(D)
        out.append(dict(zip(pos, np_softmax(s), strict=True)))
    return out


def test_h2o_cumulative_heavy_hitters_match_numpy():
    rs = np.random.RandomState(7)
    q, k, v, wo = inputs(7)
    steps = 6
    qn, kn, vn = rs.randn(B, steps, H, D) * 1.5, rs.randn(B, steps, HKV, D) * 1.5, rs.randn(B, steps, HKV, D)
    method = make_method("h2o", 0.5)
    _, cache = run_prefill(method, q, k, v, wo, new=steps)
    caps = cache.caps
    cap, r = caps.pool_per_head, caps.recent
    got0 = kept_sets(cache)
    caches = decode_steps(method, cache, qn, kn, vn, LENGTHS)
    for b in range(B):
        n = LENGTHS[b]
        score = np_causal_mass(q[b], k[b], n)  # [Hkv, n]
        pool = [set(np_topk_sets(score[:, : n - r], cap)[h]) for h in range(HKV)]
        assert got0[b] == pool
        scores = {h: dict(enumerate(score[h])) for h in range(HKV)}
        k_all = np.concatenate([k[b, :n], kn[b]])
        for i in range(steps):
            cur = n + i
            visible = [pool[h] | set(range(cur - r, cur + 1)) for h in range(HKV)]
            probs = np_attend_row(qn[b, i], visible, k_all)
            for h in range(HKV):
                scores[h][cur] = 0.0
                for p in visible[h]:
                    scores[h][p] += np.mean([probs[hh][p] for hh in range(h * G, (h + 1) * G)])
            cand = cur - r  # leaves the recent region
            for h in range(HKV):
                members = sorted(pool[h], key=lambda p: -scores[h][p])
                if len(members) < cap or scores[h][cand] > scores[h][members[-1]]:
                    pool[h] = (pool[h] | {cand}) - ({members[-1]} if len(members) >= cap else set())
            assert kept_sets(caches[i])[b] == pool, f"row {b} step {i}"


def test_tova_matches_numpy():
    rs = np.random.RandomState(8)
    q, k, v, wo = inputs(8)
    steps = 5
    qn, kn, vn = rs.randn(B, steps, H, D) * 1.5, rs.randn(B, steps, HKV, D) * 1.5, rs.randn(B, steps, HKV, D)
    method = make_method("tova", 0.5)
    _, cache = run_prefill(method, q, k, v, wo, new=steps)
    cap = cache.caps.pool_per_head
    assert cache.caps.recent == 0 and cache.caps.sink == 0
    caches = decode_steps(method, cache, qn, kn, vn, LENGTHS)
    for b in range(B):
        n = LENGTHS[b]
        last = np_obs_rows(q[b], k[b], n, 1)[:, 0]  # [H, n]
        kept = set(np.argsort(-last.mean(0), kind="stable")[:cap].tolist())
        assert kept_sets(cache)[b] == [kept] * HKV
        k_all = np.concatenate([k[b, :n], kn[b]])
        for i in range(steps):
            cur = n + i
            probs = np_attend_row(qn[b, i], [kept | {cur}] * HKV, k_all)
            mean = {p: np.mean([probs[h][p] for h in range(H)]) for p in kept | {cur}}
            kept = set(sorted(kept | {cur}, key=lambda p: -mean[p])[:cap])
            assert kept_sets(caches[i])[b] == [kept] * HKV, f"row {b} step {i}"


def test_streamingllm_keeps_sinks_and_the_recent_window():
    q, k, v, wo = inputs(9)
    method = make_method("streamingllm", 0.5)
    _, cache = run_prefill(method, q, k, v, wo)
    caps = cache.caps
    assert caps.nf == caps.nl == 0 and caps.recent > 0
    pos = np.asarray(ring_positions(cache.length, caps))
    ok = np.asarray(ring_valid(cache.length, cache.next_win, caps))
    for b in range(B):
        n = LENGTHS[b]
        assert set(pos[b][ok[b]].tolist()) == set(range(n - caps.recent, n))
        np.testing.assert_array_equal(
            np.asarray(cache.sink_k[b]), k[b, : caps.sink].transpose(1, 0, 2).astype(np.float32)
        )


# ------------------------------------------------------------------------------------- KIVI


@pytest.mark.parametrize("name,bits", [("kivi2", 2), ("kivi4", 4)])
def test_kivi_quantization_matches_numpy(name, bits):
    """After prefill + decode, every 32-token group out of the 128-token residual is in the Q tier,
    quantized per channel (keys, pre-RoPE) and per token (values) exactly as the numpy KIVI reference."""
    rs = np.random.RandomState(10)
    t = 300
    k = rs.randn(1, t, HKV, D).astype(np.float32)
    v = rs.randn(1, t, HKV, D).astype(np.float32)
    method = make_method(name)
    lengths = jnp.asarray([t], jnp.int32)
    cache = method.init_cache(CacheRequest(model_cfg=MODEL, batch=lengths.shape[0], prompt_capacity=t, max_new_tokens=8, dtype=jnp.float32, budget_tokens=0), lengths)
    cache = jax.tree.map(lambda x: x[0], cache)
    caps = cache.caps
    assert caps.nf == 0 and caps.window == 32 and caps.recent == 128 and caps.bits == bits
    inv = jnp.asarray(MODEL.inv_freq(), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    ctx = LayerContext(positions=pos, layer=jnp.int32(0), inv_freq=inv, cfg=MODEL)
    q = jnp.asarray(rs.randn(1, t, H, D), jnp.float32)
    _, cache = prefill_layer(q, jnp.asarray(k), jnp.asarray(v), cache, ctx, ranking=method.ranking, config=method.cache)
    win = np.asarray(cache.ledger.win[0])
    n_routed = (t - 128) // 32
    assert sorted(win[win >= 0].tolist()) == list(range(n_routed))  # nothing evicted
    assert int(cache.evictions[0]) == 0
    k_pre = np.asarray(
        rope_windows(
            jnp.asarray(k[0, : n_routed * 32]).reshape(n_routed, 32, HKV, D).transpose(2, 0, 1, 3),
            jnp.arange(n_routed) * 32,
            inv,
            -1,
        )
    )  # [Hkv, N, 32, D]
    row_codes = jax.tree.map(lambda x: x[0], cache.ledger.codes)
    for slot in np.nonzero(win >= 0)[0]:
        w = win[slot]
        kc, ks, kz = np_quantize(k_pre[:, w].swapaxes(-1, -2), bits)  # per channel over the group
        vc, vs, vz = np_quantize(v[0, w * 32 : (w + 1) * 32].transpose(1, 0, 2), bits)  # per token
        codes = row_codes.take(jnp.int32(slot))
        k_hat, v_hat = codes.dequantize(bits)
        np.testing.assert_array_equal(np.asarray(codes.k_scale), ks)
        np.testing.assert_array_equal(np.asarray(codes.v_zero), vz)
        want_k = (kc * ks.astype(np.float32)[..., None] + kz.astype(np.float32)[..., None]).swapaxes(-1, -2)
        want_v = vc * vs.astype(np.float32)[..., None] + vz.astype(np.float32)[..., None]
        np.testing.assert_allclose(np.asarray(k_hat), want_k, atol=1e-6)
        np.testing.assert_allclose(np.asarray(v_hat), want_v, atol=1e-6)


# ------------------------------------------------------------------------------------- qevict-restkv


def test_qevict_restkv_ranks_prompt_windows_by_restkv():
    q, k, v, wo = inputs(12)
    f = lambda a: jnp.asarray(a, jnp.float32)
    lengths = jnp.asarray(LENGTHS, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    valid = pos < lengths[:, None]
    _, mass = chunked_attention(f(q), f(k), f(v), q_pos=pos, k_pos=jnp.where(valid, pos, -1), q_valid=valid)
    nw = (T - 5) // 8
    got = np.asarray(
        make_ranking("restkv").prefill_window_scores(
            PromptPass(f(q), f(k), f(v), lengths, mass, wo=f(wo)), sink=5, window=8, num_windows=nw
        )
    )
    for b in range(B):
        n = LENGTHS[b]

        tok = np.asarray(restkv_scores(f(q), f(k), f(v), lengths, f(wo), n_obs=32, alpha=0.3, sliding_window=None, capacity=None))[b].mean(0)
        early = 5 + (np.arange(nw) + 1) * 8 <= n - 32
        rest_w = np.asarray(window_sums(jnp.asarray(tok)[None], 5, 8, nw))[0]
        ratio = got[b][early] / rest_w[early]
        np.testing.assert_allclose(ratio, ratio[0], rtol=1e-4)  # same order as ReST-KV, one scale per row
        obs = np.asarray(
            Ranking().prefill_window_scores(PromptPass(f(q), f(k), None, lengths, mass), sink=5, window=8, num_windows=nw)
        )
        np.testing.assert_allclose(got[b][early].sum(), obs[b][early].sum(), rtol=1e-4)  # obs-window units
        np.testing.assert_allclose(got[b][~early], obs[b][~early], rtol=1e-6)


# ------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize(
    "name", ["streamingllm", "h2o", "tova", "keynorm", "snapkv", "pyramidkv", "adakv", "criticalkv", "restkv"]
)
@pytest.mark.parametrize("beta", [0.1, 0.3])
def test_baseline_cache_fits_the_budget(name, beta):
    method = make_method(name, beta)
    p, new = 2000, 64
    for batch, dtype in [(1, jnp.float32), (2, jnp.bfloat16)]:
        cache = jax.eval_shape(
            lambda m=method, b=batch, dt=dtype: m.init_cache(
                CacheRequest(model_cfg=MODEL, batch=b, prompt_capacity=p, max_new_tokens=new, dtype=dt, budget_tokens=p + new),
                jnp.full((b,), p, jnp.int32),
            )
        )
        budget = beta * full_kv_bytes(MODEL, p + new, dtype, batch)
        nbytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))
        assert nbytes <= budget
        assert nbytes > 0.9 * budget  # the budget is used
