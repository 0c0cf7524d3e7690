"""QEvict generation with the Pallas kernels forced (interpret mode) equals generation with the jnp reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qevict_jax.methods.registry import make_method
from qevict_jax.runtime.generate import SamplerConfig, generate
from qevict_jax.runtime.teacher_forced import teacher_forced


@pytest.mark.slow
def test_smollm2_generation_with_forced_kernel_matches_reference(smollm2_dir):
    from models.checkpoint import load_model
    from models.tokenizer import Tokenizer
    from qevict_jax.eval.needle import prose_paragraphs

    _, model = load_model(smollm2_dir)
    tok = Tokenizer.from_dir(smollm2_dir)
    text = "\n".join(prose_paragraphs()[40:52]) + "\nSummarize the text above in one sentence."
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))[:700]
    # small recent region and Ω = 4 so that F, Q and routing are all exercised during the 12 steps
    opts = dict(recent=32, omega=4)
    ref_method = make_method("qevict", 0.3, pallas=False, **opts)
    ker_method = make_method("qevict", 0.3, pallas=True, **opts)
    sampler = SamplerConfig(max_new_tokens=12)
    f32 = jnp.float32  # the algorithms' parity, at the precision the jnp reference computes in
    ref = generate(model, [ids], sampler, ref_method, kv_dtype=f32)
    ker = generate(model, [ids], sampler, ker_method, kv_dtype=f32)
    assert ref.tokens == ker.tokens
    stats = ref.cache
    assert int(np.asarray(stats.ledger.active).sum()) > 0 and int(np.asarray(stats.f_win >= 0).sum()) > 0
    # the next-token distributions agree closely, not just the argmax
    targets = np.asarray([ref.tokens[0][:8]])
    lp_ref = teacher_forced(model, [ids], targets, ref_method, kv_dtype=f32).logprobs
    lp_ker = teacher_forced(model, [ids], targets, ker_method, kv_dtype=f32).logprobs
    np.testing.assert_allclose(lp_ker, lp_ref, atol=2e-3)
