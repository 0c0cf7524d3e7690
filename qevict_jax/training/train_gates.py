"""Training of the learned retention gates (``qevict_jax.rankings.gates``) with the base model frozen.

The student is the base model whose attention logits of key i at query t get ``(t - i) log beta_i`` added
(per KV head, shared by the query heads of its group): attention weighted by ``beta_i^(t-i)``. The loss of a
batch of token sequences [B, T] is::

    kl_weight  * KL(frozen model || student)          mean over positions of the next-token distributions
  + ce_weight  * next-token cross-entropy of the student
  + cap_weight * mean_{layer, row, head, t} relu(sum_{i <= t} beta_i^(t-i) - M) / M

The capacity term pushes the retained mass (the sum of the retention weights a query sees, ``t + 1`` when
every beta is 1) under the memory size M; dividing by M makes it a relative overflow, comparable across M.
Only the gate parameters are differentiated and optimized (the base state is wrapped in
``stop_gradient`` and is not in the optimizer state): optax AdamW, linear warm-up then cosine decay, global
norm clipping. Batches are drawn from a token array with a generator seeded by (seed, step), so a resumed
run sees the same batches as an uninterrupted one; checkpoints (orbax, ``gates.checkpoint_manager``) hold
the gates, the optimizer state and the step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from models.attention import attention_mask, dense_attention
from models.model import LayerContext, Transformer
from qevict_jax.eval.needle import prose_paragraphs
from qevict_jax.rankings.gates import (
    CONFIG_FILE,
    GateConfig,
    GateParams,
    checkpoint_manager,
    init_gates,
    log_beta,
    read_config,
    retention_bias,
    write_config,
)

HISTORY_FILE = "history.json"
CURVE_FILE = "loss_curve.png"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Static training settings (hashable: a static argument of the jitted step).

    steps: total optimizer steps; batch, seq_len: sequences [B, T] per step; memory: M, the retained mass
    the capacity term allows; lr: peak learning rate (linear warm-up over ``warmup`` steps, cosine decay to
    ``lr / 10`` at ``steps``); clip: global gradient-norm clip; weight_decay: AdamW's.
    """

    steps: int = 100
    batch: int = 2
    seq_len: int = 512
    memory: float = 128.0
    lr: float = 2e-3
    warmup: int = 10
    clip: float = 1.0
    weight_decay: float = 0.01
    kl_weight: float = 1.0
    ce_weight: float = 1.0
    cap_weight: float = 1.0
    seed: int = 0
    save_every: int = 25


def make_optimizer(tcfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with linear warm-up and cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tcfg.lr, max(1, tcfg.warmup), max(tcfg.steps, tcfg.warmup + 1), end_value=tcfg.lr / 10
    )
    return optax.chain(
        optax.clip_by_global_norm(tcfg.clip), optax.adamw(schedule, weight_decay=tcfg.weight_decay)
    )


def gated_attend(gates: GateParams, memory: float) -> Callable:
    """The decoder ``AttendFn`` of the student: causal attention with the retention bias of the layer's
    gate. Its "cache" is one layer's [B, 2] statistics: (capacity overflow, mean retained mass)."""

    def attend(q, k, v, layer_stats, ctx: LayerContext):
        lb = log_beta(gates, ctx.layer, ctx.hidden)  # [B, T, Hkv]
        bias = retention_bias(lb, ctx.positions, ctx.positions)  # [B, Hkv, 1, T, T]
        sw = ctx.cfg.sliding_window
        out, _ = dense_attention(
            q, k, v, q_pos=ctx.positions, k_pos=ctx.positions, sliding_window=sw, logit_bias=bias
        )
        mask = attention_mask(ctx.positions, ctx.positions, sw)[:, None]  # [B, 1, T, T]
        retained = jnp.sum(jnp.where(mask, jnp.exp(bias[:, :, 0]), 0.0), axis=-1)  # [B, Hkv, T]
        overflow = jnp.maximum(retained - memory, 0.0).mean(axis=(1, 2)) / memory
        return out, jnp.stack([overflow, retained.mean(axis=(1, 2))], axis=-1).astype(layer_stats.dtype)

    return attend


def student_forward(
    model: Transformer, gates: GateParams, tokens: jax.Array, memory: float
) -> tuple[jax.Array, jax.Array]:
    """Student logits [B, T, V] of tokens [B, T] and per-layer statistics [L, B, 2] (overflow, mass)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    stats0 = jnp.zeros((model.cfg.num_layers, b, 2), jnp.float32)
    return model(tokens, positions, stats0, gated_attend(gates, memory))


def gate_loss(
    gates: GateParams,
    graphdef: Any,
    base_state: Any,
    tokens: jax.Array,
    teacher_logp: jax.Array,
    tcfg: TrainConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of a batch tokens [B, T] given the frozen model's log-probabilities [B, T, V]."""
    model = nnx.merge(graphdef, jax.lax.stop_gradient(base_state))
    logits, stats = student_forward(model, gates, tokens, tcfg.memory)
    logp = jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.mean(jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - logp), axis=-1))
    ce = -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1))
    cap = jnp.mean(stats[..., 0])
    loss = tcfg.kl_weight * kl + tcfg.ce_weight * ce + tcfg.cap_weight * cap
    return loss, {"loss": loss, "kl": kl, "ce": ce, "capacity": cap, "retained": jnp.mean(stats[..., 1])}


def teacher_logprobs(graphdef: Any, base_state: Any, tokens: jax.Array) -> jax.Array:
    """The frozen model's next-token log-probabilities [B, T, V] (plain causal attention)."""
    model = nnx.merge(graphdef, base_state)
    b, t = tokens.shape
    logits, _ = model(tokens, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
    return jax.lax.stop_gradient(jax.nn.log_softmax(logits, axis=-1))


@functools.partial(jax.jit, static_argnames=("graphdef", "tcfg"))
def train_step(
    graphdef: Any, tcfg: TrainConfig, base_state: Any, gates: GateParams, opt_state: Any, tokens: jax.Array
) -> tuple[GateParams, Any, dict[str, jax.Array]]:
    """One optimizer step on tokens [B, T]: (new gates, new optimizer state, metrics before the step)."""
    teacher = teacher_logprobs(graphdef, base_state, tokens)
    grad_fn = jax.value_and_grad(gate_loss, has_aux=True)
    (_, metrics), grads = grad_fn(gates, graphdef, base_state, tokens, teacher, tcfg)
    updates, opt_state = make_optimizer(tcfg).update(grads, opt_state, gates)
    return optax.apply_updates(gates, updates), opt_state, metrics


@functools.partial(jax.jit, static_argnames=("graphdef", "tcfg"))
def evaluate(graphdef: Any, tcfg: TrainConfig, base_state: Any, gates: GateParams, tokens: jax.Array):
    """Metrics of ``gate_loss`` on tokens [B, T] without a step."""
    teacher = teacher_logprobs(graphdef, base_state, tokens)
    return gate_loss(gates, graphdef, base_state, tokens, teacher, tcfg)[1]


# ---------------------------------------------------------------------------------------------- data


def load_text(source: str) -> str:
    """Training prose: ``"pydoc"`` = the Python reference manual shipped with CPython (``pydoc_data``,
    paragraphs joined), else the contents of the file ``source``."""
    if source == "pydoc":
        return "\n\n".join(prose_paragraphs())
    return Path(source).read_text()


def batch_for_step(ids: np.ndarray, step: int, tcfg: TrainConfig) -> np.ndarray:
    """Token batch [B, T] int32 of step ``step``: random spans of ``ids``, seeded by (seed, step)."""
    if len(ids) <= tcfg.seq_len:
        raise ValueError(
            f"the training text has {len(ids)} tokens, fewer than seq_len + 1 = {tcfg.seq_len + 1}"
        )
    rng = np.random.default_rng([tcfg.seed, step])
    starts = rng.integers(0, len(ids) - tcfg.seq_len, size=tcfg.batch)
    return np.stack([ids[s : s + tcfg.seq_len] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class TrainState:
    """Gates, optimizer state and the number of steps taken."""

    gates: GateParams
    opt_state: Any
    step: int


def initial_state(model: Transformer, tcfg: TrainConfig, gcfg: GateConfig | None = None) -> TrainState:
    gcfg = gcfg or GateConfig.for_model(model.cfg)
    gates = init_gates(gcfg, jax.random.key(tcfg.seed))
    return TrainState(gates, make_optimizer(tcfg).init(gates), 0)


def save_state(mgr: ocp.CheckpointManager, state: TrainState) -> None:
    mgr.save(
        state.step,
        args=ocp.args.Composite(
            gates=ocp.args.StandardSave(state.gates),
            opt_state=ocp.args.StandardSave(state.opt_state),
            meta=ocp.args.JsonSave({"step": state.step}),
        ),
    )


def restore_state(mgr: ocp.CheckpointManager, like: TrainState, step: int | None = None) -> TrainState:
    """The checkpoint at ``step`` (default: the latest) with the structure of ``like``."""
    step = mgr.latest_step() if step is None else step
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, (like.gates, like.opt_state))
    got = mgr.restore(
        step,
        args=ocp.args.Composite(
            gates=ocp.args.StandardRestore(abstract[0]),
            opt_state=ocp.args.StandardRestore(abstract[1]),
            meta=ocp.args.JsonRestore(),
        ),
    )
    return TrainState(dict(got["gates"]), got["opt_state"], int(got["meta"]["step"]))


def plot_history(history: list[dict[str, float]], path: str | Path) -> None:
    """Loss curve PNG: total loss, KL, cross-entropy and capacity term per step."""
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    steps = [h["step"] for h in history]
    for key in ("loss", "kl", "ce", "capacity"):
        ax.plot(steps, [h[key] for h in history], label=key)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.set_title("retention gate training")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")


def train(
    model: Transformer,
    ids: np.ndarray,
    tcfg: TrainConfig,
    out: str | Path,
    *,
    max_seconds: float | None = None,
    extra_config: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train (or resume, from the latest checkpoint in ``out``) the gates of ``model`` on token ids [N].

    Saves every ``save_every`` steps and at the end (``steps`` reached, or ``max_seconds`` of training
    spent), writes ``history.json`` (metrics per step) and ``loss_curve.png``. Returns a summary: steps
    run in this call, total steps, tokens seen in this call, seconds, first and last metrics.
    """
    out = Path(out)
    gcfg = GateConfig.for_model(model.cfg)
    if (out / CONFIG_FILE).is_file():
        if read_config(out) != gcfg:
            raise ValueError(f"{out} holds gates of another shape: {read_config(out)}")
    else:
        write_config(out, gcfg, {**(extra_config or {}), "train": dataclasses.asdict(tcfg)})
    graphdef, base_state = nnx.split(model)
    state = initial_state(model, tcfg, gcfg)
    history: list[dict[str, float]] = []
    with checkpoint_manager(out) as mgr:
        if mgr.latest_step() is not None:
            state = restore_state(mgr, state)
            if (out / HISTORY_FILE).is_file():
                history = [h for h in json.loads((out / HISTORY_FILE).read_text()) if h["step"] <= state.step]
        start = state.step
        t0 = time.perf_counter()
        bar = tqdm(total=tcfg.steps, initial=start, desc="train-gates", unit="step", disable=not progress)
        while state.step < tcfg.steps:
            tokens = jnp.asarray(batch_for_step(ids, state.step, tcfg))
            gates, opt_state, metrics = train_step(
                graphdef, tcfg, base_state, state.gates, state.opt_state, tokens
            )
            state = TrainState(gates, opt_state, state.step + 1)
            row = {"step": state.step, **{k: float(v) for k, v in metrics.items()}}
            history.append(row)
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.4f}", kl=f"{row['kl']:.4f}", cap=f"{row['capacity']:.3f}")
            out_of_time = max_seconds is not None and time.perf_counter() - t0 >= max_seconds
            if state.step % tcfg.save_every == 0 or state.step == tcfg.steps or out_of_time:
                save_state(mgr, state)
            if out_of_time:
                break
        bar.close()
        mgr.wait_until_finished()
    seconds = time.perf_counter() - t0
    (out / HISTORY_FILE).write_text(json.dumps(history) + "\n")
    if history:
        plot_history(history, out / CURVE_FILE)
    ran = state.step - start
    return {
        "steps_run": ran,
        "steps_total": state.step,
        "tokens": ran * tcfg.batch * tcfg.seq_len,
        "seconds": seconds,
        "first": history[0] if history else None,
        "last": history[-1] if history else None,
        "out": str(out),
    }
