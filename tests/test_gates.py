"""Learned retention gates: the retention bias, training (gradients, loss, capacity), checkpoints."""

from __future__ import annotations

import dataclasses
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import decisive_model, roomy_method

from models.attention import chunked_attention, dense_attention
from models.config import ModelConfig
from qevict_jax.cli import build_parser
from qevict_jax.cli_train import run_train_gates
from qevict_jax.eval.testing import ByteTokenizer, tiny_model
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.gate_methods import GATE_METHODS
from qevict_jax.methods.registry import make_method
from qevict_jax.rankings import gates as gt
from qevict_jax.runtime import decode as decode_module
from qevict_jax.runtime import prefill as prefill_module
from qevict_jax.runtime.generate import SamplerConfig, generate
from qevict_jax.runtime.teacher_forced import teacher_forced
from qevict_jax.training import train_gates as tg

CFG = ModelConfig(
    family="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim=8, max_position_embeddings=2048,
)  # fmt: skip
TCFG = tg.TrainConfig(steps=30, batch=2, seq_len=32, memory=8.0, lr=1e-2, warmup=3, save_every=10)


@pytest.fixture(scope="module")
def tiny():
    model = decisive_model(CFG)
    ids = np.random.RandomState(0).randint(0, CFG.vocab_size, 4000).astype(np.int32)
    return model, ids


def test_retention_bias_weights_attention_by_beta_power_age():
    rs = np.random.RandomState(1)
    b, t, h, hkv, d = 1, 7, 4, 2, 8
    q = jnp.asarray(rs.randn(b, t, h, d), jnp.float32)
    k = jnp.asarray(rs.randn(b, t, hkv, d), jnp.float32)
    v = jnp.asarray(rs.randn(b, t, hkv, d), jnp.float32)
    lb = jnp.asarray(-rs.rand(b, t, hkv), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    _, plain = dense_attention(q, k, v, q_pos=pos, k_pos=pos)
    _, gated = dense_attention(q, k, v, q_pos=pos, k_pos=pos, logit_bias=gt.retention_bias(lb, pos, pos))
    beta = np.exp(np.asarray(lb))[0].T  # [Hkv, T]
    age = np.maximum(np.arange(t)[:, None] - np.arange(t)[None], 0)
    w = np.asarray(plain)[0] * (beta[:, None, None, :] ** age[None, None])  # [Hkv, G, T, T]
    np.testing.assert_allclose(np.asarray(gated)[0], w / w.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_untrained_gates_leave_the_model_unchanged(tiny):
    model, ids = tiny
    tokens = jnp.asarray(tg.batch_for_step(ids, 0, TCFG))
    graphdef, state = nnx.split(model)
    gates = tg.initial_state(model, TCFG).gates
    m = tg.evaluate(graphdef, dataclasses.replace(TCFG, memory=1e9), state, gates, tokens)
    assert float(m["kl"]) < 1e-4 and float(m["capacity"]) == 0.0
    assert abs(float(m["retained"]) - (TCFG.seq_len + 1) / 2) < 0.01  # sum of ~1 over t + 1 keys, mean over t


def test_gradients_reach_only_the_gates(tiny):
    model, ids = tiny
    graphdef, base = nnx.split(model)
    tokens = jnp.asarray(tg.batch_for_step(ids, 0, TCFG))
    teacher = tg.teacher_logprobs(graphdef, base, tokens)
    gates = tg.initial_state(model, TCFG).gates

    def loss(both):
        return tg.gate_loss(both[0], graphdef, both[1], tokens, teacher, TCFG)[0]

    g_gates, g_base = jax.grad(loss)((gates, base))
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g_base))
    assert float(jnp.abs(g_gates["b2"]).max()) > 0 and float(jnp.abs(g_gates["w1"]).max()) > 0
    # the optimizer state holds moments of the gate parameters only
    opt_state = tg.make_optimizer(TCFG).init(gates)
    gate_shapes = {a.shape for a in jax.tree.leaves(gates)}
    assert {a.shape for a in jax.tree.leaves(opt_state) if a.ndim} == gate_shapes
    assert (
        sum(a.size for a in jax.tree.leaves(opt_state)) < 2 * sum(a.size for a in jax.tree.leaves(gates)) + 8
    )


def _run(model, ids, tcfg, out):
    return tg.train(model, ids, tcfg, out, progress=False)


def test_short_training_lowers_the_loss(tiny, tmp_path):
    model, ids = tiny
    graphdef, base = nnx.split(model)
    held_out = jnp.asarray(tg.batch_for_step(ids, 10_000, TCFG))
    before = tg.evaluate(graphdef, TCFG, base, tg.initial_state(model, TCFG).gates, held_out)
    summary = _run(model, ids, TCFG, tmp_path / "g")
    _, trained, step = gt.load_gates(tmp_path / "g")
    after = tg.evaluate(graphdef, TCFG, base, trained, held_out)
    assert step == TCFG.steps and summary["steps_run"] == TCFG.steps
    assert float(after["loss"]) < float(before["loss"]) - 0.1 * float(before["capacity"])
    assert float(after["capacity"]) < 0.5 * float(before["capacity"])
    assert (tmp_path / "g" / tg.CURVE_FILE).stat().st_size > 0


def test_smaller_memory_lowers_the_retained_mass(tiny, tmp_path):
    model, ids = tiny
    graphdef, base = nnx.split(model)
    held_out = jnp.asarray(tg.batch_for_step(ids, 10_000, TCFG))
    mass = {}
    for m in (4.0, 16.0):
        tcfg = dataclasses.replace(TCFG, memory=m, steps=20)
        _run(model, ids, tcfg, tmp_path / f"m{m}")
        _, trained, _ = gt.load_gates(tmp_path / f"m{m}")
        mass[m] = float(tg.evaluate(graphdef, tcfg, base, trained, held_out)["retained"])
    assert mass[4.0] < mass[16.0] < (TCFG.seq_len + 1) / 2


def test_checkpoint_resume_reproduces_the_next_step(tiny, tmp_path):
    model, ids = tiny
    tcfg = dataclasses.replace(TCFG, steps=3, save_every=2)
    _run(model, ids, tcfg, tmp_path / "straight")  # saves at steps 2 and 3
    _run(model, ids, dataclasses.replace(tcfg, steps=2), tmp_path / "resumed")  # stops at step 2
    summary = _run(model, ids, tcfg, tmp_path / "resumed")  # resumes from step 2, runs step 3
    assert summary["steps_run"] == 1 and summary["steps_total"] == 3
    _, a, _ = gt.load_gates(tmp_path / "straight")
    _, b, _ = gt.load_gates(tmp_path / "resumed")
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    # save -> restore is exact, optimizer state and step included
    like = tg.initial_state(model, tcfg)
    with gt.checkpoint_manager(tmp_path / "straight") as mgr:
        s2 = tg.restore_state(mgr, like, step=2)
        s3 = tg.restore_state(mgr, like)
    assert (s2.step, s3.step) == (2, 3)
    graphdef, base = nnx.split(model)
    tokens = jnp.asarray(tg.batch_for_step(ids, 2, tcfg))
    g3, o3, _ = tg.train_step(graphdef, tcfg, base, s2.gates, s2.opt_state, tokens)
    for x, y in zip(jax.tree.leaves((g3, o3)), jax.tree.leaves((s3.gates, s3.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_gates_of_another_model_are_refused(tiny, tmp_path):
    model, ids = tiny
    _run(model, ids, dataclasses.replace(TCFG, steps=1), tmp_path / "g")
    other = dataclasses.replace(CFG, num_kv_heads=3, num_heads=6)
    with pytest.raises(ValueError, match="trained for"):
        gt.gate_params(str(tmp_path / "g"), other)


# ---------------------------------------------------------------------------------------------- the methods

PROMPT = 300


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A gate folder trained briefly with a small M (varied retention) for the tiny model."""
    model, ids = tiny
    out = tmp_path_factory.mktemp("gates") / "g"
    _run(model, ids, dataclasses.replace(TCFG, memory=4.0, steps=15), out)
    return str(out)


def hidden_states(model, tokens: np.ndarray) -> np.ndarray:
    """Every layer's normed attention input [L, B, T, Dm] of a plain causal pass over tokens [B, T]."""
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

    def attend(q, k, v, cache, ctx):
        out, _ = chunked_attention(
            q, k, v, q_pos=ctx.positions, k_pos=ctx.positions, sliding_window=ctx.cfg.sliding_window
        )
        return out, ctx.hidden

    zeros = jnp.zeros((model.cfg.num_layers, b, t, model.cfg.hidden_size), jnp.float32)
    return np.asarray(model(jnp.asarray(tokens), pos, zeros, attend)[1])


def all_log_beta(model, path: str, tokens: list[int]) -> np.ndarray:
    """log beta [L, T, Hkv] of every layer's tokens."""
    hs = hidden_states(model, np.asarray([tokens]))
    params = gt.gate_params(path, model.cfg)
    return np.stack([np.asarray(gt.log_beta(params, layer, hs[layer]))[0] for layer in range(len(hs))])


def test_gate_pool_keeps_each_heads_top_retention_tokens(tiny, trained):
    model, ids = tiny
    prompt = [int(i) for i in ids[:PROMPT]]
    lb = all_log_beta(model, trained, prompt)
    for name in ("gates", "gates-global"):
        res = generate(
            model, [prompt], SamplerConfig(max_new_tokens=1), make_method(name, 0.3, gates=trained)
        )
        caps, cache = res.cache.caps, res.cache
        score = (PROMPT - np.arange(PROMPT))[None, :, None] * lb  # [L, T, Hkv]
        eligible = np.arange(PROMPT) < PROMPT - caps.recent
        hkv = CFG.num_kv_heads
        for layer in range(CFG.num_layers):
            pos = np.asarray(cache.pool_pos[layer, 0])
            head = np.asarray(cache.pool_head[layer, 0])
            s = np.where(eligible[:, None], score[layer], -np.inf)
            if name == "gates":
                for h in range(hkv):
                    want = set(np.argsort(-s[:, h])[: caps.pool_per_head])
                    assert set(pos[(head == h) & (pos >= 0)]) == want
            else:  # one ranking over the layer's heads
                flat = np.argsort(-s.T.reshape(-1))[: hkv * caps.pool_per_head]
                want = {(int(f // PROMPT), int(f % PROMPT)) for f in flat}
                assert {(int(h), int(p)) for h, p in zip(head, pos, strict=True) if p >= 0} == want
        if name == "gates-global":  # the heads' shares differ: the allocation is global
            counts = np.bincount(np.asarray(cache.pool_head[0, 0])[np.asarray(cache.pool_pos[0, 0]) >= 0])
            assert counts.min() != counts.max()


def window_keys(lb: np.ndarray, sink: int, window: int, n: int) -> np.ndarray:
    """Key of each window (max over its tokens of the head-mean log beta): lb [L, T, Hkv] -> [L, NW]."""
    m = lb.mean(-1)[:, sink : sink + n * window]
    return m.reshape(m.shape[0], n, window).max(-1)


def test_qevict_gates_ranks_prompt_windows_by_retention(tiny, trained):
    model, ids = tiny
    prompt = [int(i) for i in ids[:PROMPT]]
    method = make_method("qevict-gates", 0.4, gates=trained, recent=16)
    res = generate(model, [prompt], SamplerConfig(max_new_tokens=1), method)
    cache, caps = res.cache, res.cache.caps
    s, w = caps.sink, caps.window
    routed = (PROMPT - s - caps.recent) // w
    keys = window_keys(all_log_beta(model, trained, prompt), s, w, routed)
    age = PROMPT - (s + np.arange(routed) * w + (w - 1) / 2)
    assert 0 < caps.nf < routed
    for layer in range(CFG.num_layers):
        order = np.argsort(-(age * keys[layer]), kind="stable")
        fp = np.asarray(cache.f_win[layer, 0])
        assert set(fp[fp >= 0]) == set(order[: caps.nf])
        np.testing.assert_allclose(
            np.asarray(cache.f_score[layer, 0])[fp >= 0], keys[layer][fp[fp >= 0]], rtol=1e-4
        )
        led, act = np.asarray(cache.ledger.win[layer, 0]), np.asarray(cache.ledger.active[layer, 0])
        assert set(led[act]) == set(order[caps.nf : caps.nf + caps.nq])


def test_qevict_gates_keys_survive_decoding_and_routing(tiny, trained):
    """After decode steps with routing events, every resident window's stored key is still the max head-mean
    log beta of its tokens: every window of layer 0 (whose input, the embedding, a full pass reproduces) and
    the prompt's windows of every layer (decoded tokens' deeper inputs depend on the compressed cache)."""
    model, ids = tiny
    prompt = [int(i) for i in ids[:PROMPT]]
    method = make_method("qevict-gates", 0.4, gates=trained, recent=16, omega=4)
    res = generate(model, [prompt], SamplerConfig(max_new_tokens=40), method)
    cache, caps = res.cache, res.cache.caps
    n = int(cache.length[0, 0])
    seq = (prompt + [int(t) for t in res.tokens[0]])[:n]
    s, w = caps.sink, caps.window
    keys = window_keys(all_log_beta(model, trained, seq), s, w, (n - s) // w)
    assert int(cache.routing_events[0, 0]) >= 5 and int(np.asarray(cache.next_win[0, 0])) * w > PROMPT - s
    for layer in range(CFG.num_layers):
        for win, score in ((cache.f_win, cache.f_score), (cache.ledger.win, cache.ledger.score)):
            wl, sl = np.asarray(win[layer, 0]), np.asarray(score[layer, 0])
            ok = (wl >= 0) & ((layer == 0) | (s + (wl + 1) * w <= PROMPT))
            np.testing.assert_allclose(sl[ok], keys[layer][wl[ok]], rtol=1e-4, atol=1e-6)


def test_gate_methods_with_room_for_everything_equal_full_kv(tiny, trained):
    model, ids = tiny
    prompt = [int(i) for i in ids[:PROMPT]]
    targets = np.asarray(ids[PROMPT : PROMPT + 6])[None]
    ref = teacher_forced(model, [prompt], targets, FullKV()).logprobs
    for name in GATE_METHODS:
        got = teacher_forced(
            model, [prompt], targets, roomy_method(name, CFG, PROMPT + 6, gates=trained)
        ).logprobs
        np.testing.assert_allclose(got, ref, atol=1e-4)


def test_train_gates_cli_trains_resumes_and_plots(tmp_path):
    _, model = tiny_model(seed=0)
    text = tmp_path / "prose.txt"
    text.write_text(" ".join(f"word{i % 37} and more prose." for i in range(300)))
    argv = ["train-gates", "--text", str(text), "--memory", "8", "--seq-len", "32", "--batch", "1"]
    argv += ["--out", str(tmp_path / "g"), "--save-every", "2", "--warmup", "1"]
    first = run_train_gates(build_parser().parse_args([*argv, "--steps", "3"]), model, ByteTokenizer())
    again = run_train_gates(build_parser().parse_args([*argv, "--steps", "4"]), model, ByteTokenizer())
    assert (first["steps_run"], again["steps_run"], again["steps_total"]) == (3, 1, 4)
    assert again["tokens"] == 32
    assert gt.load_gates(tmp_path / "g")[2] == 4
    assert (tmp_path / "g" / tg.CURVE_FILE).is_file()
    assert [h["step"] for h in json.loads((tmp_path / "g" / tg.HISTORY_FILE).read_text())] == [1, 2, 3, 4]


def test_gates_ranking_without_gates_is_a_clear_error(tiny):
    model, ids = tiny
    method = make_method("qevict", 0.4, ranking="gates", recent=16)
    with pytest.raises(ValueError, match="qevict-gates"):
        generate(model, [[int(i) for i in ids[:PROMPT]]], SamplerConfig(max_new_tokens=1), method)
    with pytest.raises(ValueError, match="has no option 'gates'"):
        make_method("qevict", 0.2, gates="some/dir")


def test_a_gate_method_without_a_checkpoint_is_a_clear_error(tiny):
    """No default gates: a gate method run without ``gates=DIR`` (or an explicit ``gates=untrained``) stops
    with an error naming the option, before any generation."""
    model, ids = tiny
    prompt = [int(i) for i in ids[:PROMPT]]
    for name in ("gates", "qevict-gates"):
        with pytest.raises(ValueError, match="gates=DIR"):
            generate(model, [prompt], SamplerConfig(max_new_tokens=2), make_method(name, 0.4, recent=16))


def test_other_gate_parameters_reuse_the_traced_programs(tiny, trained):
    """The gate parameters are an argument of the prefill and the decode loop, not constants captured while
    they are traced: other parameters of the same shapes trace neither program again, and take effect."""
    model, ids = tiny
    method = make_method("qevict-gates", 0.4, gates=trained, recent=16, omega=2)
    sampler = SamplerConfig(max_new_tokens=4)
    tokens, lengths = prefill_module.pad_prompts([[int(i) for i in ids[:PROMPT]]])
    budget = prefill_module.tokens_for_budget(method, lengths, sampler.max_new_tokens, "bucket")
    graphdef, state = nnx.split(model)
    prefill = jax.jit(
        chex.assert_max_traces(prefill_module._prefill, n=1),
        static_argnames=("graphdef", "method", "sampler", "budget_tokens", "capacity_new", "kv_dtype"),
    )
    decode = jax.jit(
        chex.assert_max_traces(decode_module._decode, n=1), static_argnames=("graphdef", "method", "sampler")
    )
    other = make_method("qevict-gates", 0.4, gates=gt.UNTRAINED).weights(model.cfg)
    rows = dict(lengths=jnp.asarray(lengths), graphdef=graphdef, method=method, sampler=sampler)
    sizes = dict(budget_tokens=budget, capacity_new=sampler.max_new_tokens, kv_dtype=jnp.float32)
    caches = []
    for weights in (method.weights(model.cfg), other):
        weights = jax.tree.map(jnp.asarray, weights)
        key = jax.random.key(0)
        first, cache = prefill(
            state=state, tokens=jnp.asarray(tokens), rng=key, weights=weights, **rows, **sizes
        )
        rng = jax.random.key(1)
        *_, cache = decode(state=state, cache=cache, first=first, rng=rng, weights=weights, **rows)
        caches.append(cache)
    # the untrained gates keep every token alike (the same key in every window), the trained ones do not
    trained_keys, untrained_keys = (np.asarray(c.ledger.score) for c in caches)
    assert not np.array_equal(trained_keys, untrained_keys)
