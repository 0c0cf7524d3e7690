"""Chunked prefill attention against a float64 numpy reference (outputs and exact column masses)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import chunked_attention


def reference(q, k, v, q_pos, k_pos, window, q_valid):
    """float64: out [B, Tq, H, D] and column mass [B, Hkv, G, Tk]."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    out = np.zeros((b, tq, h, d))
    mass = np.zeros((b, hkv, g, k.shape[1]))
    for bi in range(b):
        for hi in range(h):
            kh = hi // g
            s = q[bi, :, hi] @ k[bi, :, kh].T / np.sqrt(d)
            ok = (k_pos[bi][None] <= q_pos[bi][:, None]) & (k_pos[bi][None] >= 0)
            if window is not None:
                ok &= q_pos[bi][:, None] - k_pos[bi][None] < window
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p = np.where(ok, p, 0)
            p /= p.sum(-1, keepdims=True)
            out[bi, :, hi] = p @ v[bi, :, kh]
            mass[bi, kh, hi % g] = (p * q_valid[bi][:, None]).sum(0)
    return out, mass


@pytest.mark.parametrize("causal_blocks", [True, False])
@pytest.mark.parametrize(
    ("t", "chunk", "window"), [(37, 8, None), (64, 16, None), (50, 16, 7), (20, 64, None)]
)
def test_chunked_attention_matches_float64(causal_blocks, t, chunk, window):
    rs = np.random.RandomState(t + chunk)
    b, h, hkv, d = 2, 6, 2, 8
    q, k, v = (rs.randn(b, t, n, d) for n in (h, hkv, hkv))
    pos = np.broadcast_to(np.arange(t), (b, t)).copy()
    k_pos = pos.copy()
    k_pos[1, t - 5 :] = -1  # row 1: right padding
    q_valid = k_pos >= 0
    out, mass = chunked_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)),
        q_pos=jnp.asarray(pos),
        k_pos=jnp.asarray(k_pos),
        sliding_window=window,
        chunk=chunk,
        q_valid=jnp.asarray(q_valid),
        causal_blocks=causal_blocks,
    )
    ref_out, ref_mass = reference(q, k, v, pos, k_pos, window, q_valid)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(mass), ref_mass, atol=2e-4)
