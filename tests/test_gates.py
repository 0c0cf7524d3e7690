"""Learned retention gates: the retention bias, training (gradients, loss, capacity), checkpoints."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.attention import dense_attention
from models.config import ModelConfig
from models.model import Transformer
from qevict_jax import gates as gt
from qevict_jax import train_gates as tg

CFG = ModelConfig(
    family="llama", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
    num_kv_heads=2, head_dim=8, max_position_embeddings=2048,
)  # fmt: skip
TCFG = tg.TrainConfig(steps=30, batch=2, seq_len=32, memory=8.0, lr=1e-2, warmup=3, save_every=10)


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(CFG, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a: a * 4.0 if a.ndim >= 2 else a, state))
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
    _, plain = dense_attention(q, k, v, pos, pos)
    _, gated = dense_attention(q, k, v, pos, pos, logit_bias=gt.retention_bias(lb, pos, pos))
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
