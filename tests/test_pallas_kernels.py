"""Pallas decode-attention kernels (interpret mode on CPU) against the jnp references and float64 numpy.

Inputs are fresh random draws (codes are random bytes, not the output of the quantizer), outputs are
NaN-poisoned (``poison=True``; interpret mode also starts outputs as NaN) and compared element by element.
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.attention import NEG_INF
from pallas_kernels import cpu_ledger, dispatch
from pallas_kernels.formats import ChannelKeys, RotatedTokens
from pallas_kernels.fused_attention import dense_slot_attention, fused_partials
from pallas_kernels.ledger_attention import ledger_attention, window_cos_sin
from pallas_kernels.quant import QuantizedWindows, unpack
from pallas_kernels.reference import ledger_partial
from pallas_kernels.splitk import Launch, plan_splits, unpack_last
from pallas_kernels.tiers import DenseTier, QuantTier, merge_tiers, slot_partial, tier_partials

SINK = 5
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


# ----------------------------------------------------------------------------------------------------------
# random inputs


def _inv_freq(d: int) -> np.ndarray:
    return (1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32)


def _ledger_inputs(rng, b, hkv, g, d, nl, w, bits, q_dtype, masked_row):
    """Random ledger arguments (as a dict of numpy arrays) in the layout of docs/design.md §5."""
    per, levels = 8 // bits, (1 << bits) - 1
    valid = rng.random((b, nl)) < 0.7
    valid[0, 0] = True
    if masked_row:
        valid[b - 1] = False
    starts = SINK + w * rng.permutation(4 * nl)[:nl]
    return dict(
        q=(1.5 * rng.standard_normal((b, hkv, g, d))).astype(q_dtype),
        kc=rng.integers(0, 256, (b, hkv, nl, d, w // per), dtype=np.uint8),
        ks=rng.uniform(0.1, 1.5, (b, hkv, nl, d)).astype(np.float16) / levels,  # ranges as for INT2
        kz=rng.normal(-0.5, 0.5, (b, hkv, nl, d)).astype(np.float16),
        vc=rng.integers(0, 256, (b, hkv, nl, w, d // per), dtype=np.uint8),
        vs=rng.uniform(0.1, 1.5, (b, hkv, nl, w)).astype(np.float16) / levels,
        vz=rng.normal(-0.5, 0.5, (b, hkv, nl, w)).astype(np.float16),
        slot_start=np.broadcast_to(starts, (b, nl)).astype(np.int32).copy(),
        slot_valid=valid,
        inv_freq=_inv_freq(d),
    )


def _to_jnp(args: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in args.items()}


CODE_NAMES = ("kc", "ks", "kz", "vc", "vs", "vz")


def _ledger(args: dict) -> dict:
    """The ledger kernels' keyword arguments from the flat arrays: q, tier (``QuantTier``), inv_freq."""
    codes = QuantizedWindows(*(args[n] for n in CODE_NAMES))
    return dict(
        q=args["q"], tier=QuantTier(codes, args["slot_start"], args["slot_valid"]), inv_freq=args["inv_freq"]
    )


def _tiers(args: dict) -> dict:
    """``fused_partials``' keyword arguments from the flat arrays (ring_pos -1 = empty)."""
    led = _ledger(args)
    return dict(
        q=args["q"],
        sink=DenseTier(args["sink_k"], args["sink_v"], args["sink_valid"]),
        f=DenseTier(args["f_k"], args["f_v"], args["f_valid"]),
        ledger=led["tier"],
        ring=DenseTier(args["ring_k"], args["ring_v"], args["ring_pos"] >= 0),
        inv_freq=args["inv_freq"],
    )


# ----------------------------------------------------------------------------------------------------------
# float64 numpy: an independent implementation of the specification


def _np_unpack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Element i of a group sits in byte i // (8 // bits) at bit shift (i % (8 // bits)) * bits."""
    per = 8 // bits
    out = np.zeros((*codes.shape[:-1], codes.shape[-1] * per), np.int64)
    for i in range(out.shape[-1]):
        out[..., i] = (codes[..., i // per].astype(np.int64) >> ((i % per) * bits)) & ((1 << bits) - 1)
    return out


def _np_rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [..., T, D] at pos [..., T]; the angle is rounded to f32 as the models do."""
    angle = (pos.astype(np.float32)[..., None] * inv_freq.astype(np.float32)).astype(np.float64)
    cos, sin = np.cos(angle), np.sin(angle)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_ledger_kv(a: dict, w: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Dequantized, re-rotated keys and values [B, Hkv, NL, W, D] float64 (invalid slots zeroed)."""
    k = (
        _np_unpack(a["kc"], bits) * a["ks"].astype(np.float64)[..., None]
        + a["kz"].astype(np.float64)[..., None]
    )
    k = np.swapaxes(k, -1, -2)  # [B, Hkv, NL, W, D]
    v = (
        _np_unpack(a["vc"], bits) * a["vs"].astype(np.float64)[..., None]
        + a["vz"].astype(np.float64)[..., None]
    )
    pos = a["slot_start"][:, None, :, None] + np.arange(w)  # [B, 1, NL, W]
    k = _np_rope(k, np.broadcast_to(pos, k.shape[:-1]), a["inv_freq"])
    keep = a["slot_valid"][:, None, :, None, None]
    return np.where(keep, k, 0.0), np.where(keep, v, 0.0)


def _np_partial(q, k, v, valid):
    """Partial (out, m, l, slot_mass) of q [B, Hkv, G, D] over k, v [B, Hkv, N, W, D], valid [B, N]."""
    d = q.shape[-1]
    s = np.einsum("bkgd,bkntd->bkgnt", q.astype(np.float64), k) / np.sqrt(d)
    mask = np.broadcast_to(valid[:, None, None, :, None], s.shape)
    m = np.where(mask, s, -np.inf).max(axis=(-1, -2))
    m = np.where(np.isfinite(m), m, NEG_INF)
    p = np.exp(np.where(mask, s - m[..., None, None], -np.inf))
    return np.einsum("bkgnt,bkntd->bkgd", p, v), m, p.sum((-1, -2)), p.sum(-1)


# ----------------------------------------------------------------------------------------------------------
# comparison


def _assert_close(got, want, rtol: float, what: str) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{what}: non-finite elements (unwritten or NaN)"
    err = np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def _assert_partial(got, want, rtol: float, valid: np.ndarray) -> None:
    """Compare (out, m, l, slot_mass); m of rows without a valid slot must be exactly NEG_INF."""
    out, m, den, mass = (np.asarray(x) for x in got)
    _assert_close(out, want[0], rtol, "out")
    _assert_close(den, want[2], rtol, "l")
    _assert_close(mass, want[3], rtol, "slot_mass")
    live = valid.any(axis=1)
    assert np.isfinite(m).all()
    assert (m[~live] == np.float32(NEG_INF)).all()
    _assert_close(m[live], np.asarray(want[1])[live], rtol, "m")
    assert (out[~live] == 0).all() and (den[~live] == 0).all() and (mass[~live] == 0).all()
    assert (mass.transpose(0, 3, 1, 2)[~valid] == 0).all(), "invalid slots must have zero mass"


# ----------------------------------------------------------------------------------------------------------
# pure helpers


@pytest.mark.parametrize("bits", [2, 4])
def test_unpack_last_matches_quant_unpack(bits):
    codes = np.random.default_rng(bits).integers(0, 256, (3, 5, 4), dtype=np.uint8)
    got = np.asarray(unpack_last(jnp.asarray(codes), bits))
    np.testing.assert_array_equal(got, np.asarray(unpack(jnp.asarray(codes), bits)))
    np.testing.assert_array_equal(got, _np_unpack(codes, bits))


def test_rope_cos_sin_matches_f32_angles_up_to_128k():
    theta = _inv_freq(128)
    start = np.array([0, 5, 1021, 65533, 131064], np.int32)
    cos, sin = (np.asarray(x, np.float64) for x in window_cos_sin(jnp.asarray(start), jnp.asarray(theta), 8))
    pos = start[:, None, None] + np.arange(8)[None, None, :]
    angle = (pos.astype(np.float32) * theta[None, :, None]).astype(np.float64)
    assert np.abs(cos - np.cos(angle)).max() < 2e-6
    assert np.abs(sin - np.sin(angle)).max() < 2e-6


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    rows=st.integers(1, 64),
    block=st.integers(1, 64),
    num_splits=st.one_of(st.none(), st.integers(1, 50)),
)
def test_plan_splits_covers_every_slot_without_empty_programs(n, rows, block, num_splits):
    plan = plan_splits(n, rows, block, num_splits)
    assert plan.block & (plan.block - 1) == 0 and plan.block <= max(block, 1)
    assert plan.padded >= n > (plan.splits - 1) * plan.per_program
    assert plan.splits <= -(-n // plan.block)


def test_dispatch_flags():
    assert dispatch.use_pallas(True) and not dispatch.use_pallas(False)
    assert dispatch.use_pallas(None) == (jax.default_backend() == "gpu")
    assert dispatch.default_interpret() == (jax.default_backend() != "gpu")
    assert dispatch.resolve_interpret(True) and not dispatch.resolve_interpret(False)
    params = dispatch.triton_params(4, 2)
    assert params.num_warps == 4 and params.num_stages == 2


# ----------------------------------------------------------------------------------------------------------
# ledger (Q tier)

# head_dim, G, W, bits, NL, block_slots, num_splits, q dtype, last row fully masked
LEDGER_CASES = [
    (64, 1, 8, 2, 13, 4, 2, jnp.float32, True),
    (128, 3, 32, 2, 7, 2, None, jnp.float32, False),
    (64, 4, 8, 4, 37, 8, 2, jnp.bfloat16, True),
    (128, 8, 8, 2, 21, 4, 3, jnp.bfloat16, False),
    (64, 3, 32, 4, 5, 4, None, jnp.float32, True),
]


@pytest.mark.parametrize("d,g,w,bits,nl,block,splits,dtype,masked", LEDGER_CASES)
def test_ledger_attention_matches_reference_and_float64(d, g, w, bits, nl, block, splits, dtype, masked):
    rng = np.random.default_rng(nl * d + g)
    a = _ledger_inputs(rng, 2, 2, g, d, nl, w, bits, np.float32, masked)
    args = _to_jnp(a)
    args["q"] = args["q"].astype(dtype)
    got = ledger_attention(
        **_ledger(args),
        window=w,
        fmt=ChannelKeys(bits),
        launch=Launch(interpret=True, block_slots=block, num_splits=splits, poison=True),
    )
    want = ledger_partial(**_ledger(args), window=w, fmt=ChannelKeys(bits))
    _assert_partial(got, [np.asarray(x) for x in want], TOL[dtype], a["slot_valid"])
    k, v = _np_ledger_kv(a, w, bits)
    q64 = np.asarray(args["q"].astype(jnp.float32), np.float64)
    _assert_partial(got, _np_partial(q64, k, v, a["slot_valid"]), TOL[dtype], a["slot_valid"])


@pytest.mark.parametrize(
    "d,g,w,bits,nl,dtype,masked,rtol64",
    [(*case[:5], *case[7:], TOL[case[7]]) for case in LEDGER_CASES]
    # the 8K-token shape of SmolLM2 at β = 0.2: positions to 16K, where float32 RoPE angles (which the
    # reference shares) are ~7e-5 from float64
    + [(64, 3, 8, 2, 487, jnp.float32, True, 2e-4)],
)
def test_cpu_ledger_kernel_matches_reference_and_float64(d, g, w, bits, nl, dtype, masked, rtol64):
    """The CPU FFI kernel (codes read directly, slots split over threads) on the cases of the Pallas kernel,
    three rows, plus the 8K-token shape of SmolLM2 at β = 0.2 (487 slots of 8 tokens)."""
    assert cpu_ledger.available(), cpu_ledger.unavailable_reason()
    rng = np.random.default_rng(nl * d + g + 1)
    a = _ledger_inputs(rng, 3, 2, g, d, nl, w, bits, np.float32, masked)
    args = _to_jnp(a)
    args["q"] = args["q"].astype(dtype)
    got = jax.jit(functools.partial(cpu_ledger.ledger_attention_cpu, window=w, fmt=ChannelKeys(bits)))(**_ledger(args))
    want = ledger_partial(**_ledger(args), window=w, fmt=ChannelKeys(bits))
    _assert_partial(got, [np.asarray(x) for x in want], TOL[dtype], a["slot_valid"])
    k, v = _np_ledger_kv(a, w, bits)
    q64 = np.asarray(args["q"].astype(jnp.float32), np.float64)
    _assert_partial(got, _np_partial(q64, k, v, a["slot_valid"]), rtol64, a["slot_valid"])


def test_loading_the_cpu_kernel_keeps_subnormal_floats():
    """Linking with -ffast-math would switch the whole process to flush-to-zero."""
    assert cpu_ledger.available(), cpu_ledger.unavailable_reason()
    assert (np.array([1e-38], np.float32) / np.float32(1e3))[0] != 0


def test_cpu_kernel_is_what_tier_attention_runs_on_the_cpu(monkeypatch):
    assert dispatch.use_cpu_kernel() == (jax.default_backend() == "cpu")
    monkeypatch.setenv("QEVICT_CPU_KERNEL", "0")
    assert not dispatch.use_cpu_kernel()


def test_ledger_attention_never_reads_invalid_slots():
    """NaN grids in invalid (dormant / free) slots must not leak into the result."""
    d, g, w, bits, nl = 64, 4, 8, 2, 11
    a = _ledger_inputs(np.random.default_rng(7), 2, 2, g, d, nl, w, bits, np.float32, masked_row=True)
    bad = ~a["slot_valid"][:, None, :]
    for name in ("ks", "kz", "vs", "vz"):
        a[name] = np.where(bad[..., None], np.float16(np.nan), a[name])
    got = ledger_attention(
        **_ledger(_to_jnp(a)),
        window=w,
        fmt=ChannelKeys(bits),
        launch=Launch(interpret=True, block_slots=2, num_splits=2),
    )
    k, v = _np_ledger_kv(a, w, bits)
    _assert_partial(got, _np_partial(a["q"], k, v, a["slot_valid"]), 1e-5, a["slot_valid"])


# ----------------------------------------------------------------------------------------------------------
# full-precision tiers


@pytest.mark.parametrize(
    "d,g,w,n,dtype",
    [(64, 4, 1, 37, jnp.float32), (128, 3, 8, 5, jnp.bfloat16), (64, 8, 8, 9, jnp.float32)],
)
def test_dense_slot_attention_matches_reference_and_float64(d, g, w, n, dtype):
    rng = np.random.default_rng(d + n)
    b, hkv = 2, 2
    q = jnp.asarray(2.0 * rng.standard_normal((b, hkv, g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, hkv, n, w, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, hkv, n, w, d)), dtype)
    valid = rng.random((b, n)) < 0.6
    valid[0, 0], valid[1] = True, False
    tier = DenseTier(k, v, jnp.asarray(valid))
    got = dense_slot_attention(q, tier, launch=Launch(interpret=True, block_slots=4, poison=True))
    want = [np.asarray(x) for x in slot_partial(q, tier)]
    _assert_partial(got, want, TOL[dtype], valid)
    as64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
    _assert_partial(got, _np_partial(as64(q), as64(k), as64(v), valid), TOL[dtype], valid)


# ----------------------------------------------------------------------------------------------------------
# all tiers


def _fused_inputs(rng, b, hkv, g, d, w, bits, nf, nl, nr, dtype):
    a = _ledger_inputs(rng, b, hkv, g, d, nl, w, bits, np.float32, masked_row=False)
    normal = lambda *s: rng.standard_normal(s).astype(np.float32)
    a.update(
        sink_k=normal(b, hkv, SINK, d),
        sink_v=normal(b, hkv, SINK, d),
        sink_valid=np.ones((b, SINK), bool),
        f_k=normal(b, hkv, nf, w, d),
        f_v=normal(b, hkv, nf, w, d),
        f_valid=rng.random((b, nf)) < 0.6,
        ring_k=normal(b, hkv, nr, d),
        ring_v=normal(b, hkv, nr, d),
        ring_pos=np.where(rng.random((b, nr)) < 0.8, 4000 + np.arange(nr), -1).astype(np.int32),
    )
    # the last row has nothing valid in any tier
    for name in ("sink_valid", "f_valid", "slot_valid"):
        a[name][b - 1] = False
    a["ring_pos"][b - 1] = -1
    args = _to_jnp(a)
    for name in ("q", "sink_k", "sink_v", "f_k", "f_v", "ring_k", "ring_v"):
        args[name] = args[name].astype(dtype)
    return a, args


def _np_fused(args: dict, a: dict, w: int, bits: int):
    """float64 attention over all tiers: (out [B, Hkv, G, D], masses per sink, F, Q, ring)."""
    as64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
    q = as64(args["q"])
    lk, lv = _np_ledger_kv(a, w, bits)
    tiers = [
        (as64(args["sink_k"])[:, :, :, None], as64(args["sink_v"])[:, :, :, None], a["sink_valid"]),
        (as64(args["f_k"]), as64(args["f_v"]), a["f_valid"]),
        (lk, lv, a["slot_valid"]),
        (as64(args["ring_k"])[:, :, :, None], as64(args["ring_v"])[:, :, :, None], a["ring_pos"] >= 0),
    ]
    parts = [_np_partial(q, k, v, valid) for k, v, valid in tiers]
    big_m = np.max([p[1] for p in parts], axis=0)
    scale = [np.exp(p[1] - big_m) for p in parts]
    total = sum(s * p[2] for s, p in zip(scale, parts, strict=True))
    inv = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)
    out = sum(s[..., None] * p[0] for s, p in zip(scale, parts, strict=True)) * inv[..., None]
    masses = [(p[3] * (s * inv)[..., None]).mean(axis=(1, 2)) for s, p in zip(scale, parts, strict=True)]
    return out, masses


@pytest.mark.parametrize(
    "d,g,w,bits,nf,nl,nr,dtype",
    [(64, 4, 8, 2, 3, 13, 20, jnp.float32), (128, 3, 8, 4, 2, 6, 9, jnp.bfloat16)],
)
def test_fused_attention_matches_reference_and_float64(d, g, w, bits, nf, nl, nr, dtype):
    a, args = _fused_inputs(np.random.default_rng(d * g), 2, 2, g, d, w, bits, nf, nl, nr, dtype)
    launch = Launch(interpret=True, block_slots=4, num_splits=2, poison=True)
    got = merge_tiers(fused_partials(launch=launch)(**_tiers(args), window=w, fmt=ChannelKeys(bits)))
    reference = tier_partials(
        **_tiers(args), window=w, fmt=ChannelKeys(bits), ledger_attention=ledger_partial
    )
    want = merge_tiers(reference)
    np_out, np_masses = _np_fused(args, a, w, bits)
    tol = TOL[dtype]
    names = ("sink_mass", "f_mass", "q_mass", "ring_mass")
    _assert_close(got.out, want.out, tol, "out")
    _assert_close(got.out, np_out, tol, "out vs float64")
    for i, name in enumerate(names):
        _assert_close(getattr(got, name), getattr(want, name), tol, name)
        _assert_close(getattr(got, name), np_masses[i], tol, f"{name} vs float64")
    total = sum(np.asarray(getattr(got, name)).sum(-1) for name in names)
    np.testing.assert_allclose(total, [1.0, 0.0], atol=1e-5)  # last row: nothing valid -> all zero
    assert (np.asarray(got.out)[-1] == 0).all()


# ----------------------------------------------------------------------------------------------------------
# GPU lowering, checked from the CPU


def _abstract(args: dict) -> dict:
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), args)


@pytest.mark.parametrize(
    "fmt",
    [ChannelKeys(2), ChannelKeys(2, 3, rotate_values=True), RotatedTokens(4, 3), RotatedTokens(4, 3, center_keys=True)],
    ids=lambda f: f.name,
)
def test_kernels_lower_to_triton_for_cuda(fmt):
    """Lower the kernels for CUDA on this CPU machine: every in-kernel op must have a Triton lowering."""
    from jax._src.lib import version as jaxlib_version

    if jaxlib_version > (0, 10, 2):
        pytest.skip("this jaxlib compiles Triton during lowering, which needs a GPU")
    _, args = _fused_inputs(np.random.default_rng(0), 2, 2, 4, 128, 8, 2, 3, 37, 9, jnp.bfloat16)
    launch = Launch(interpret=False, poison=True)

    def fn(**tiers):
        return merge_tiers(fused_partials(launch=launch)(**tiers, window=8, fmt=fmt))

    tiers = _tiers(args)
    shapes = fmt.field_shapes(8, 128)
    b, hkv, nl = tiers["ledger"].codes.k_codes.shape[:3]
    # codes in the format's layout (the inputs' own are the channel format's): bytes, grids and means f16
    fields = {
        f.name: jax.ShapeDtypeStruct(
            (b, hkv, nl, *getattr(shapes, f.name)), jnp.uint8 if "codes" in f.name else jnp.float16
        )
        for f in dataclasses.fields(shapes)
        if getattr(shapes, f.name) is not None
    }
    tiers["ledger"] = tiers["ledger"]._replace(codes=QuantizedWindows(**fields))
    text = jax.jit(fn).trace(**_abstract(tiers)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 4  # sink, F, Q, ring


# ----------------------------------------------------------------------------------------------------------
# the references, jitted and not


class ReferencesJittedAndNot(chex.TestCase):
    """The jnp references the kernels are held to are themselves right: jitted and un-jitted, the ledger
    and slot partials equal the float64 computation from the dequantized codes."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_ledger_and_slot_partials_match_float64(self):
        d, g, w, bits, nl = 64, 2, 8, 2, 9
        a = _ledger_inputs(np.random.default_rng(5), 2, 2, g, d, nl, w, bits, np.float32, masked_row=True)
        ledger = self.variant(functools.partial(ledger_partial, window=w, fmt=ChannelKeys(bits)))
        got = ledger(**_ledger(_to_jnp(a)))
        k, v = _np_ledger_kv(a, w, bits)
        want = _np_partial(a["q"], k, v, a["slot_valid"])
        chex.assert_shape(got.mass, (2, 2, g, nl))
        chex.assert_trees_all_close(
            tuple(np.asarray(x, np.float64) for x in got), tuple(want), rtol=2e-5, atol=1e-5
        )
        tier = DenseTier(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), jnp.asarray(a["slot_valid"]))
        dense = self.variant(slot_partial)(jnp.asarray(a["q"]), tier)
        chex.assert_trees_all_close(
            tuple(np.asarray(x, np.float64) for x in dense), tuple(want), rtol=2e-5, atol=1e-5
        )
