"""Learned retention gates (TRIM-KV, arXiv 2512.03324): the gate model, its scores and its checkpoints.

One gate per layer reads the layer's normed attention input ``h`` [B, T, Dm] (``LayerContext.hidden``)::

    log beta = log_sigmoid(SiLU(h W1 + b1) W2 + b2)       W1 [Dm, 512], W2 [512, Hkv], b2 initialized to 10

one retention ``beta_i`` in (0, 1) per token and KV head. Training (``qevict_jax.training.train_gates``) adds
``(t - i) log beta_i`` to the attention logits of key i at query t (attention weighted by ``beta_i^(t-i)``);
at inference a token's score at time t is ``(t - pos_i) log beta_i`` (the log of its retained weight):
higher = keep. Parameters are stacked on a leading layer axis, like the decoder's.

Checkpoints are orbax ``CheckpointManager`` folders (``checkpoint_manager``): one step folder per save with
the items ``gates`` (the parameters), ``opt_state`` and ``meta`` (step, data position), plus
``gate_config.json``. Inference reads only the latest step's ``gates`` (``load_gates``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from models.config import ModelConfig

GateParams = dict[str, jax.Array]
"""w1 [L, Dm, width], b1 [L, width], w2 [L, width, Hkv], b2 [L, Hkv] (float32)."""

CONFIG_FILE = "gate_config.json"


@dataclasses.dataclass(frozen=True)
class GateConfig:
    """Shape of the gates of one model: layers, the model's hidden size Dm, KV heads, the MLP width, and
    the initial output bias (10: every beta starts at sigmoid(10) = 0.99995, i.e. retain everything)."""

    num_layers: int
    hidden_size: int
    num_kv_heads: int
    width: int = 512
    bias_init: float = 10.0

    @classmethod
    def for_model(cls, cfg: ModelConfig, **kw: Any) -> GateConfig:
        return cls(cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, **kw)

    def check(self, cfg: ModelConfig) -> None:
        """ValueError unless these gates fit the model ``cfg``."""
        want = (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads)
        got = (self.num_layers, self.hidden_size, self.num_kv_heads)
        if want != got:
            raise ValueError(
                f"the gates were trained for (layers, hidden, kv heads) = {got}, the model has {want}"
            )


def init_gates(gcfg: GateConfig, key: jax.Array) -> GateParams:
    """Fresh gate parameters: W1 ~ N(0, 1/Dm), b1 = 0, W2 ~ N(0, 1e-4), b2 = ``bias_init``."""
    k1, k2 = jax.random.split(key)
    L, dm, w, hkv = gcfg.num_layers, gcfg.hidden_size, gcfg.width, gcfg.num_kv_heads
    return {
        "w1": jax.random.normal(k1, (L, dm, w), jnp.float32) * dm**-0.5,
        "b1": jnp.zeros((L, w), jnp.float32),
        "w2": jax.random.normal(k2, (L, w, hkv), jnp.float32) * 1e-2,
        "b2": jnp.full((L, hkv), gcfg.bias_init, jnp.float32),
    }


def log_beta(params: GateParams, layer: jax.Array | int, hidden: jax.Array) -> jax.Array:
    """log beta [B, T, Hkv] f32 of layer ``layer`` (int or traced [] int32) from hidden [B, T, Dm]."""
    p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), params)
    h = hidden.astype(jnp.float32)
    z = jax.nn.silu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jax.nn.log_sigmoid(z)


def retention_bias(lb: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """``(t - i) log beta_i`` [B, Hkv, 1, Tq, Tk] for keys at k_pos [B, Tk] with log beta lb [B, Tk, Hkv] and
    queries at q_pos [B, Tq] (ages below 0, i.e. future keys, count as 0; the causal mask removes them)."""
    age = jnp.maximum(q_pos[:, :, None] - k_pos[:, None, :], 0).astype(jnp.float32)  # [B, Tq, Tk]
    return (age[:, None] * lb.transpose(0, 2, 1)[:, :, None, :])[:, :, None]


# ---------------------------------------------------------------------------------------------- checkpoints


def checkpoint_manager(directory: str | Path, max_to_keep: int = 3) -> ocp.CheckpointManager:
    """The orbax manager of a gate checkpoint folder (items ``gates``, ``opt_state``, ``meta``)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options)


def write_config(directory: str | Path, gcfg: GateConfig, extra: dict[str, Any] | None = None) -> None:
    """``gate_config.json``: the gate shape plus ``extra`` (model name, training settings)."""
    path = Path(directory) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"gate": dataclasses.asdict(gcfg), **(extra or {})}, indent=1) + "\n")


def read_config(directory: str | Path) -> GateConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a gate checkpoint folder (no {CONFIG_FILE})")
    return GateConfig(**json.loads(path.read_text())["gate"])


def load_gates(directory: str | Path) -> tuple[GateConfig, GateParams, int]:
    """(config, parameters, step) of the latest checkpoint in a gate folder written by ``train_gates``."""
    gcfg = read_config(directory)
    abstract = jax.eval_shape(lambda: init_gates(gcfg, jax.random.key(0)))
    with checkpoint_manager(directory) as mgr:
        step = mgr.latest_step()
        if step is None:
            raise FileNotFoundError(f"{directory} holds no gate checkpoint step")
        restored = mgr.restore(step, args=ocp.args.Composite(gates=ocp.args.StandardRestore(abstract)))
    return gcfg, dict(restored["gates"]), int(step)


UNTRAINED = "untrained"
"""The ``gates`` value that asks for untrained gates (no checkpoint)."""


@functools.lru_cache(maxsize=8)
def gate_params(path: str, model_cfg: ModelConfig) -> GateParams:
    """The gate parameters a method uses (cached per path and model): the latest checkpoint in ``path``,
    or, for ``path == UNTRAINED``, untrained gates (seed 0: every token alike, so a ranking by age only; for
    smoke tests of the machinery). An empty path is an error: a gate method has no default gates.

    Read on the host, never while a program is traced: the gate methods hand them to the runtime
    (``weights``), which passes them into the compiled programs as arguments (``LayerContext.weights``).
    """
    if not path:
        raise ValueError(
            "the gate methods need the option gates=DIR (a folder written by `qevict train-gates`), or "
            f"gates={UNTRAINED} for untrained gates that rank by age only"
        )
    if path == UNTRAINED:
        params = init_gates(GateConfig.for_model(model_cfg), jax.random.key(0))
    else:
        gcfg, params, _ = load_gates(path)
        gcfg.check(model_cfg)
    return {k: np.asarray(v, np.float32) for k, v in params.items()}
