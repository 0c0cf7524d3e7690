"""Teacher-forced scoring: a method's next-token log-probabilities along given targets (fidelity)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.model import Transformer
from qevict_jax.core.kv import DEFAULT_KV_DTYPE, KVMethod, cache_nbytes, full_kv_bytes
from qevict_jax.runtime.compiled import EXECUTABLES
from qevict_jax.runtime.decode import teacher_forced_jit
from qevict_jax.runtime.prefill import check_prompts, method_weights, pad_prompts, tokens_for_budget
from qevict_jax.runtime.results import TeacherForcedResult
from qevict_jax.runtime.sampling import SamplerConfig


def teacher_forced(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    targets: np.ndarray,
    method: KVMethod,
    budget_rounding: str = "bucket",
    kv_dtype: Any = DEFAULT_KV_DTYPE,
) -> TeacherForcedResult:
    """Log-probabilities of the next token at every position of ``targets`` [B, T] after each prompt.

    The method's cache is built from the prompt and then updated by every target token, exactly as in
    decoding, so its next-token distributions can be compared with Full-KV's (fidelity).
    """
    targets = np.asarray(targets, np.int32)
    if targets.ndim != 2 or targets.shape[0] != len(prompts):
        raise ValueError(f"targets must be [B={len(prompts)}, T], got shape {targets.shape}")
    check_prompts(prompts, model.cfg, SamplerConfig(max_new_tokens=targets.shape[1]))
    tokens, lengths = pad_prompts(prompts)
    budget_tokens = tokens_for_budget(method, lengths, targets.shape[1], budget_rounding)
    graphdef, state = nnx.split(model)
    (logprobs, cache), _ = EXECUTABLES.run(
        teacher_forced_jit,
        dict(graphdef=graphdef, method=method, budget_tokens=budget_tokens, kv_dtype=kv_dtype),
        state=state,
        tokens=jnp.asarray(tokens),
        lengths=jnp.asarray(lengths),
        targets=jnp.asarray(targets),
        weights=method_weights(method, model.cfg, None),
    )
    final_tokens = int(lengths.sum()) + len(prompts) * (targets.shape[1] - 1)
    return TeacherForcedResult(
        logprobs=np.asarray(logprobs),
        cache_bytes=cache_nbytes(cache),
        full_kv_bytes=full_kv_bytes(model.cfg, final_tokens, kv_dtype),
    )
