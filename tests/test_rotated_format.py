"""The rotated ledger formats (``pallas_kernels.formats.RotatedTokens``, and ``ChannelKeys`` with rotated values):
an orthogonal rotation, exact packing, grids that bound the error, attention over their codes (jnp reference,
CPU kernel, Pallas kernel in interpret mode) equal to float64 attention over the dequantized, un-rotated K/V,
their bytes, and a method that uses them reproducing Full-KV when everything fits."""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import roomy_method, tiny_llama

from models.model import Transformer
from pallas_kernels import cpu_ledger
from pallas_kernels.formats import (
    QUANT_NAMES,
    ChannelKeys,
    RotatedTokens,
    channel_rotation,
    quant_format,
    rope_windows,
)
from pallas_kernels.ledger_attention import ledger_attention
from pallas_kernels.quant import pack_tokens, unpack_tokens
from pallas_kernels.reference import ledger_partial
from pallas_kernels.splitk import Launch
from pallas_kernels.tiers import QuantTier
from qevict_jax.core.cache import abstract_cache
from qevict_jax.core.config import CacheConfig, Capacities, ring_capacity
from qevict_jax.core.q_keys import q_key
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.registry import cache_stats
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.sampling import SamplerConfig

FORMATS = [RotatedTokens(4, 3), RotatedTokens(4, 4), RotatedTokens(4, 2), RotatedTokens(2, 2)]
CENTERED = [
    RotatedTokens(4, 3, center_keys=True),
    RotatedTokens(3, 3, center_keys=True),
    RotatedTokens(3, 4, center_keys=True),  # the same bytes as crot-k4v3, the bits moved to the values
]
# per-channel keys with rotated per-token values, and today's format as the control
CHANNEL_FORMATS = [ChannelKeys(2, 3, rotate_values=True), ChannelKeys(2, 4, rotate_values=True), ChannelKeys(2)]


@pytest.mark.parametrize("d", [64, 128, 48])
def test_the_rotation_is_orthogonal(d):
    r = channel_rotation(d).astype(np.float64)
    chex.assert_shape(r, (d, d))
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-6)
    if d & (d - 1) == 0:  # a signed Hadamard matrix: every entry +-1/sqrt(d)
        np.testing.assert_allclose(np.abs(r), 1 / np.sqrt(d))


@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4]),
    rows=st.integers(1, 5),
    d=st.sampled_from([8, 16, 64]),
    seed=st.integers(0, 99),
)
def test_token_codes_pack_and_unpack_exactly(bits, rows, d, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, (rows, d)).astype(np.uint8)
    packed = pack_tokens(jnp.asarray(codes), bits)
    chex.assert_shape(packed, (rows, d * bits // 8))
    np.testing.assert_array_equal(np.asarray(unpack_tokens(packed, bits)), codes)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_token_is_within_half_a_step_of_its_grid(fmt):
    """In the rotated basis every element is within scale / 2 of its dequantized value (f16 grids rounded
    outward), and decoding rotates back: decode(encode(x)) = rotated(codes) R^T."""
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.standard_normal((2, 5, 8, 64)) * 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 5, 8, 64)), jnp.float32)
    codes = fmt.encode(k, v, jnp.zeros(5, jnp.int32), jnp.ones(32))
    r = channel_rotation(64).astype(np.float64)
    kr, vr = (np.asarray(x, np.float64) for x in fmt.rotated(codes))
    for x, xr, scale in ((k, kr, codes.k_scale), (v, vr, codes.v_scale)):
        err = np.abs(np.asarray(x, np.float64) @ r - xr)
        assert (err <= np.asarray(scale, np.float64)[..., None] / 2 * (1 + 1e-5) + 1e-6).all()
    kd, vd = fmt.decode(codes, jnp.zeros(5, jnp.int32), jnp.ones(32))
    chex.assert_trees_all_close((kd, vd), (kr @ r.T, vr @ r.T), atol=1e-4)


@pytest.mark.parametrize("fmt", CENTERED, ids=lambda f: f.name)
def test_centered_keys_store_their_pre_rope_mean_and_a_residual_within_half_a_step(fmt):
    """k_mean is each window's pre-RoPE channel mean in f16; the codes hold (k - RoPE_t(mean)) R within
    scale / 2 per element; decoding adds RoPE_t(mean) back, so a window whose keys are a constant vector
    before RoPE (a pure bias) is decoded exactly up to the f16 mean."""
    rng = np.random.default_rng(7)
    bias = rng.standard_normal(64) * 20  # a large per-channel offset, constant before RoPE
    inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, 64, 2) / 64), jnp.float32)
    starts = jnp.asarray([0, 8, 100, 3000, 9], jnp.int32)
    k_pre = jnp.asarray(bias + rng.standard_normal((2, 5, 8, 64)), jnp.float32)
    k = rope_windows(k_pre, starts, inv, +1)
    v = jnp.asarray(rng.standard_normal((2, 5, 8, 64)), jnp.float32)
    codes = fmt.encode(k, v, starts, inv)
    mean = np.asarray(k_pre, np.float64).mean(-2)
    np.testing.assert_allclose(np.asarray(codes.k_mean, np.float64), mean, rtol=1e-3, atol=1e-2)
    mean_t = np.asarray(fmt.mean_keys(codes.k_mean, starts, inv, 8), np.float64)
    r = channel_rotation(64).astype(np.float64)
    kr, _ = (np.asarray(x, np.float64) for x in fmt.rotated(codes))
    err = np.abs((np.asarray(k, np.float64) - mean_t) @ r - kr)
    assert (err <= np.asarray(codes.k_scale, np.float64)[..., None] / 2 * (1 + 1e-5) + 1e-5).all()
    kd, _ = fmt.decode(codes, starts, inv)
    chex.assert_trees_all_close(kd, kr @ r.T + mean_t, atol=1e-4)
    # the residual's grid spans the noise, not the bias: steps far below the rotated bias's range
    assert float(np.asarray(codes.k_scale, np.float64).max()) < 0.02 * np.ptp(bias @ r)


@pytest.mark.parametrize("fmt", CHANNEL_FORMATS, ids=lambda f: f.name)
def test_channel_keys_and_rotated_values_are_within_half_a_step_of_their_grids(fmt):
    """Keys: pre-RoPE, every channel within scale / 2 of its grid over the window; values: in the stored basis
    (times R when rotated) within scale / 2 of their token's grid; decoding re-applies RoPE and rotates the
    values back."""
    rng = np.random.default_rng(5)
    k = jnp.asarray(rng.standard_normal((2, 5, 8, 64)) * 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 5, 8, 64)), jnp.float32)
    starts = jnp.asarray(rng.integers(0, 300, 5), jnp.int32)
    inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, 64, 2) / 64), jnp.float32)
    codes = fmt.encode(k, v, starts, inv)
    r = channel_rotation(64).astype(np.float64) if fmt.rotate_values else np.eye(64)
    k_pre = np.asarray(rope_windows(k, starts, inv, -1), np.float64)
    k_hat, v_hat = (np.asarray(x, np.float64) for x in fmt.stored(codes))
    k_step = np.asarray(codes.k_scale, np.float64)[..., None, :]  # [.., N, 1, D]: one grid per channel
    assert (np.abs(k_pre - k_hat) <= k_step / 2 * (1 + 1e-5) + 1e-5).all()
    v_step = np.asarray(codes.v_scale, np.float64)[..., None]  # [..., N, W, 1]: one grid per token
    assert (np.abs(np.asarray(v, np.float64) @ r - v_hat) <= v_step / 2 * (1 + 1e-5) + 1e-6).all()
    kd, vd = fmt.decode(codes, starts, inv)
    chex.assert_trees_all_close(vd, v_hat @ r.T, atol=1e-5)
    chex.assert_trees_all_close(kd, rope_windows(jnp.asarray(k_hat, jnp.float32), starts, inv, +1), atol=1e-5)


def _attention64(q, k, v, valid):
    """Float64 attention partial of q [B, Hkv, G, D] over slots k, v [B, Hkv, N, W, D], valid [B, N]."""
    s = np.einsum("bkgd,bkntd->bkgnt", q / np.sqrt(q.shape[-1]), k)
    mask = valid[:, None, None, :, None]
    s = np.where(mask, s, -1e30)
    m = s.max((-1, -2))
    p = np.where(mask, np.exp(s - m[..., None, None]), 0.0)
    return np.einsum("bkgnt,bkntd->bkgd", p, v), p.sum((-1, -2)), p.sum(-1)


def _kernels():
    pallas = functools.partial(
        ledger_attention, launch=Launch(interpret=True, block_slots=2, num_splits=2, poison=True)
    )
    impls = {"reference": ledger_partial, "pallas": pallas}
    if cpu_ledger.available():
        impls["cpu"] = cpu_ledger.ledger_attention_cpu
    return impls


@pytest.mark.parametrize("fmt", FORMATS + CENTERED + CHANNEL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_attention_over_rotated_codes_equals_float64_attention_over_the_dequantized_kv(fmt, impl):
    """Every implementation of the Q tier's partial reads the rotated codes (query rotated once, output
    rotated back once) and gives float64 attention over the decoded, un-rotated K/V; invalid slots count 0."""
    kernels = _kernels()
    if impl not in kernels:
        pytest.skip(f"the CPU kernel is unavailable: {cpu_ledger.unavailable_reason()}")
    _check_against_float64(kernels[impl], fmt, d=64, w=8)


# head dims and windows beyond the model's (64, 8): the CPU kernel's other compiled shapes (128, 32), a window
# that is not a multiple of its vector width, and a head dim whose 2-bit plane ends in a partial block of bytes
@pytest.mark.parametrize("d,w", [(128, 32), (64, 12), (40, 8)])
@pytest.mark.parametrize("fmt", FORMATS + CENTERED, ids=lambda f: f.name)
def test_the_cpu_kernel_reads_rotated_codes_at_other_shapes(fmt, d, w):
    """The CPU kernel unpacks codes in vector lanes and permutes the query to match: at every shape its
    partial is float64 attention over the decoded K/V."""
    if not cpu_ledger.available():
        pytest.skip(f"the CPU kernel is unavailable: {cpu_ledger.unavailable_reason()}")
    _check_against_float64(cpu_ledger.ledger_attention_cpu, fmt, d=d, w=w)


def _check_against_float64(kernel, fmt, *, d: int, w: int) -> None:
    """The kernel's partial over random K/V encoded in fmt equals float64 attention over the decoded K/V."""
    rng = np.random.default_rng(11)
    b, hkv, g, nl = 2, 2, 3, 11
    k = jnp.asarray(rng.standard_normal((b, hkv, nl, w, d)) * 2, jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hkv, nl, w, d)), jnp.float32)
    starts = jnp.asarray(rng.integers(0, 400, (b, nl)), jnp.int32)
    valid = rng.random((b, nl)) > 0.3
    valid[1] = False  # a row with no valid slot
    inv = jnp.asarray(1.0 / 10000 ** (np.arange(0, d, 2) / d), jnp.float32)
    head_starts = starts[:, None]  # [B, 1, NL]: the same positions for every KV head of a row
    codes = fmt.encode(k, v, head_starts, inv)
    q = jnp.asarray(rng.standard_normal((b, hkv, g, d)), jnp.float32)
    got = jax.jit(functools.partial(kernel, window=w, fmt=fmt))(
        q, QuantTier(codes, starts, jnp.asarray(valid)), inv
    )
    kd, vd = (np.asarray(x, np.float64) for x in fmt.decode(codes, head_starts, inv))
    out, den, mass = _attention64(np.asarray(q, np.float64), kd, vd, valid)
    chex.assert_shape(got.out, (b, hkv, g, d))
    chex.assert_shape(got.mass, (b, hkv, g, nl))
    chex.assert_trees_all_close((got.out, got.l, got.mass), (out, den, mass), atol=5e-5, rtol=2e-5)


def test_a_rotated_q_window_costs_its_codes_and_grids():
    """Bytes of one ledger slot per KV head and layer (hand count, W = 8, D = 64): rot-k4v3 keys 8 x 32 B of
    codes + 8 x 4 B of f16 grids, values 8 x 24 + 32 = 512 B, against the channel format's 128 + 256 + 128 +
    32 = 544 B; the abstract cache (what the budget solver measures) agrees."""
    cfg = dataclasses.replace(tiny_llama(4096), head_dim=64)

    def slot_bytes(quant: str, q_rank: str = "score") -> int:
        def total(nl: int) -> int:
            caps = Capacities(
                sink=5,
                window=8,
                recent=64,
                ring=ring_capacity(64, 8, 8),
                nf=0,
                nq=nl,
                nl=nl,
                nw_max=64,
                bits=2,
                omega=8,
                quant=quant,
                q_rank=q_key(q_rank),
            )
            return sum(
                x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_cache(caps, cfg, 1, jnp.bfloat16))
            )

        return total(1) - total(0)

    heads = cfg.num_layers * cfg.num_kv_heads
    metadata = slot_bytes("channel") - heads * 544  # window id, score, active flag per layer
    assert metadata == cfg.num_layers * (4 + 4 + 1)
    assert slot_bytes("rot-k4v3") == heads * 512 + metadata
    assert slot_bytes("rot-k4v4") == heads * (2 * (256 + 32)) + metadata
    assert slot_bytes("rot-k4v2") == heads * (256 + 32 + 128 + 32) + metadata
    # channel keys (128 B of codes, 256 B of grids) with 3-bit rotated values (8 x 24 + 32 B)
    assert slot_bytes("kch2-rotv3") == heads * (128 + 256 + 192 + 32) + metadata
    # rot-k4v3 and each window's pre-RoPE key mean, 64 channels in f16
    assert slot_bytes("crot-k4v3") == heads * (512 + 128) + metadata
    # a Q tier ranked by key norm keeps one f32 key-norm score per entry and layer
    assert slot_bytes("crot-k4v3", "keynorm") == slot_bytes("crot-k4v3") + cfg.num_layers * 4


def test_every_format_name_builds_its_format_in_order():
    # written out by hand: the names (in the order the CLI and the errors list them) and what each one builds
    want = [
        ("channel", ChannelKeys(2)),
        ("crot-k4v3", RotatedTokens(4, 3, center_keys=True)),
        ("crot-k4v4", RotatedTokens(4, 4, center_keys=True)),
        ("crot-k3v4", RotatedTokens(3, 4, center_keys=True)),
        ("crot-k3v3", RotatedTokens(3, 3, center_keys=True)),
        ("kch2-rotv3", ChannelKeys(2, 3, rotate_values=True)),
        ("kch2-rotv4", ChannelKeys(2, 4, rotate_values=True)),
        ("kch2-rotv2", ChannelKeys(2, 2, rotate_values=True)),
        ("rot-k4v4", RotatedTokens(4, 4)),
        ("rot-k4v3", RotatedTokens(4, 3)),
        ("rot-k4v2", RotatedTokens(4, 2)),
        ("rot-k3v3", RotatedTokens(3, 3)),
        ("rot-k2v2", RotatedTokens(2, 2)),
    ]
    assert [(name, quant_format(name)) for name in QUANT_NAMES] == want
    # only "channel" takes the cache's width; a name with its widths keeps them
    assert quant_format("channel", 4) == ChannelKeys(4)
    assert quant_format("kch2-rotv3", 4) == ChannelKeys(2, 3, rotate_values=True)
    assert quant_format("rot-k4v3", 4) == RotatedTokens(4, 3)
    with pytest.raises(ValueError, match="bits must be one of"):
        quant_format("channel", 3)


def test_format_names_are_checked():
    assert quant_format("rot-k4v3") == RotatedTokens(4, 3) and quant_format("channel", 4) == ChannelKeys(4)
    assert quant_format("kch2-rotv3") == ChannelKeys(2, 3, rotate_values=True)
    assert all(quant_format(name).name == name for name in QUANT_NAMES)
    with pytest.raises(ValueError, match="unknown ledger format"):
        CacheConfig(quant="rot-k9v9")
    with pytest.raises(ValueError, match="unknown q_rank 'norm'; available: score, keynorm, blend"):
        CacheConfig(q_rank="norm")


@pytest.mark.parametrize(
    "quant, q_rank",
    [("rot-k4v3", "score"), ("rot-k4v2", "score"), ("kch2-rotv3", "score"), (None, None)],  # None: the default's
)
def test_qevict_in_the_rotated_format_with_room_for_everything_equals_full_kv(quant, q_rank):
    """Room for every window (none evicted; 20 F slots, the other windows in Q), routing events on the way:
    Full-KV's tokens exactly (the default qevict, crot-k4v3 ranked by the blend of attention and key norm,
    included)."""
    cfg = tiny_llama(2048)
    model = Transformer(cfg, rngs=nnx.Rngs(3))
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 300).tolist()
    sampler = SamplerConfig(max_new_tokens=12)
    options = {} if quant is None else {"quant": quant, "q_rank": q_rank}
    method = roomy_method("qevict", cfg, 300 + 12, **options)
    res = generate(model, [prompt], sampler, method, kv_dtype=jnp.float32)
    want = (quant, q_rank) if quant is not None else ("crot-k4v3", "blend")
    assert res.compressed and (res.cache.caps.quant, res.cache.caps.q_rank.name) == want
    assert cache_stats(res.cache)["evictions"] == [0]
    assert res.tokens == generate(model, [prompt], sampler, FullKV(), kv_dtype=jnp.float32).tokens
