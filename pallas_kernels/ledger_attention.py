"""Decode attention over the packed INT2/INT4 ledger (the Q tier) as a Pallas kernel (docs/design.md §9).

``ledger_attention`` has the signature and outputs of ``pallas_kernels.reference.ledger_partial``.
It reads the packed codes and the f16 grids once, dequantizes in registers, re-rotates the keys at their
own positions in-kernel and never materializes a dequantized cache in device memory.

Kernel structure (flash-decoding split-K):

- grid ``(B, Hkv, splits)``; one program handles all G query heads of one KV head (GQA) over a contiguous
  range of ``chunks * block`` ledger slots, looping over ``chunks`` steps of ``block`` slots (``W`` tokens
  each) with an online softmax (running max, sum and output per query head, kept in registers);
- each program writes a partial ``(out [G, D], m [G], l [G])``, the per-slot sums ``exp(s - m_i)`` of
  every step and the running max ``m_i`` they are relative to; a small jnp combine (``combine_splits``)
  rescales all of them to the global max.

Triton lowering (what keeps every in-kernel array a power of two and avoids unsupported ops):

- no ``dot``: the G query heads are a static Python loop and logits are broadcast-multiply-reduce over D
  (decode attention is memory-bound; this avoids Triton's >= 16 dot dims, so G needs no padding). Block
  arrays have shapes ``[block, D/2, W]`` (keys), ``[block, W, D]`` (values), ``[block, W]`` (logits);
  block, W, D must be powers of two for the Triton lowering (interpret mode has no such limit);
- codes are unpacked with a broadcast shift ``(codes[..., None] >> [0, bits, ...]) & mask`` and a reshape
  that merges the last two axes, which reproduces the packing order (element i at byte i // (8 // bits),
  shift (i % (8 // bits)) * bits);
- the key halves ``[:D/2]`` and ``[D/2:]`` needed by the rotate-half RoPE are loaded as two ref slices,
  so no register-level slicing or concatenation is needed;
- all big loads are masked by slot validity (``pltriton.load(mask=...)``): invalid slots (dormant ledger
  entries, free slots, the ragged tail past NL) are never read and contribute exactly 0 even if their
  memory holds NaN; only the small ``slot_start`` / ``slot_valid`` arrays are padded in the wrapper.

RoPE in-kernel: the angle ``a = fl(fl(p) * theta)`` (exactly what ``models.attention.apply_rope`` computes)
is evaluated per token, but its cosine and sine come from the angle-addition formula
``a = base + off + eps`` with ``base = fl(start * theta)`` per slot, ``off = fl(t * theta)`` per in-window
offset and a tiny residual ``eps = (a - base) - off``. This needs ``D/2`` transcendentals per *slot*
(plus ``W * D/2`` per program) instead of ``D`` per token, and matches ``cos(a)`` / ``sin(a)`` to about
1e-6 (second-order in ``eps``, which is a few ulps of ``a``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from models.attention import NEG_INF
from pallas_kernels.dispatch import resolve_interpret, triton_params
from pallas_kernels.quant import ChannelKeys, QuantFormat, QuantizedWindows, RotatedTokens
from pallas_kernels.reference import Partial, QuantTier, empty_partial, rotated_partial

TARGET_PROGRAMS = 512  # programs per launch the split heuristic aims at (a few waves on ~132 SMs)
BLOCK_TOKENS = 32  # tokens per inner step by default (block slots = BLOCK_TOKENS // W)


# ----------------------------------------------------------------------------------------------------------
# split planning and the jnp combine


class SplitPlan(NamedTuple):
    """How the slot axis is cut: ``splits`` programs per (row, KV head), ``chunks`` steps of ``block``."""

    block: int
    chunks: int
    splits: int

    @property
    def per_program(self) -> int:
        return self.block * self.chunks

    @property
    def padded(self) -> int:
        return self.per_program * self.splits


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << (max(int(x), 1) - 1).bit_length()


def plan_splits(
    n: int, rows: int, block: int, num_splits: int | None = None, target_programs: int = TARGET_PROGRAMS
) -> SplitPlan:
    """Split ``n`` slots for ``rows`` = B * Hkv (row, KV head) pairs.

    ``block`` is rounded down to a power of two and capped at the next power of two of ``n``. Without
    ``num_splits``, enough splits are made to reach about ``target_programs`` programs in all.
    """
    block = min(_pow2_floor(block), _pow2_ceil(n))
    n_blocks = -(-n // block)
    if num_splits is None:
        num_splits = -(-target_programs // max(rows, 1))
    splits = max(1, min(int(num_splits), n_blocks))
    chunks = -(-n_blocks // splits)
    return SplitPlan(block, chunks, -(-n_blocks // chunks))


def default_block_slots(window: int) -> int:
    """Slots per inner step: about ``BLOCK_TOKENS`` tokens, a power of two."""
    return _pow2_floor(max(1, BLOCK_TOKENS // window))


def combine_splits(
    out_p: jax.Array, m_p: jax.Array, l_p: jax.Array, mass_p: jax.Array, cm_p: jax.Array, n: int
) -> Partial:
    """Merge per-program partials into one partial over all slots.

    out_p [B, Hkv, NS, G, D], m_p, l_p [B, Hkv, NS, G]; mass_p [B, Hkv, NS, G, C*BS] per-slot sums relative
    to the step maxima cm_p [B, Hkv, NS, G, C]. Returns (out [B, Hkv, G, D], m, l [B, Hkv, G],
    slot_mass [B, Hkv, G, n]) with every sum relative to the global max ``m``.
    """
    m = jnp.max(m_p, axis=2)  # [B, Hkv, G]
    w = jnp.exp(m_p - m[:, :, None])  # [B, Hkv, NS, G]
    out = jnp.sum(w[..., None] * out_p, axis=2)
    den = jnp.sum(w * l_p, axis=2)
    b, hkv, ns, g, per_program = mass_p.shape
    chunks = cm_p.shape[-1]
    step_w = jnp.exp(cm_p - m[:, :, None, :, None])[..., None]  # [B, Hkv, NS, G, C, 1]
    mass = mass_p.reshape(b, hkv, ns, g, chunks, per_program // chunks) * step_w
    mass = mass.transpose(0, 1, 3, 2, 4, 5).reshape(b, hkv, g, ns * per_program)[..., :n]
    return Partial(out, m, den, mass)


# ----------------------------------------------------------------------------------------------------------
# in-kernel helpers (shared with pallas_kernels.fused_attention)


def masked_load(ref, mask: jax.Array) -> jax.Array:
    """``ref[...]`` where ``mask`` (same shape), 0 elsewhere; masked-off elements are not read."""
    return pltriton.load(ref, mask=mask, other=0)


def unpack_last(codes: jax.Array, bits: int) -> jax.Array:
    """Unpack codes [..., M] uint8 into [..., M * 8 / bits] uint8.

    Element i comes from byte i // per at bit shift (i % per) * bits, per = 8 // bits.
    """
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.int32).astype(jnp.uint8) * jnp.uint8(bits)
    fields = jnp.right_shift(codes[..., None], shifts) & jnp.uint8((1 << bits) - 1)
    return fields.reshape(*codes.shape[:-1], codes.shape[-1] * per)


def rope_cos_sin(start: jax.Array, theta: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [BS, D/2, W] of the angles ``fl(fl(start + t) * theta)`` for t < W (see the module docstring).

    start: [BS] int32 first position of each slot; theta: [D/2] f32 inverse frequencies.
    """
    th = theta[None, :, None]  # [1, D/2, 1]
    t = jnp.arange(window, dtype=jnp.int32)[None, None, :]  # [1, 1, W]
    angle = (start[:, None, None] + t).astype(jnp.float32) * th  # [BS, D/2, W], as apply_rope
    base = start.astype(jnp.float32)[:, None, None] * th  # [BS, D/2, 1]
    off = t.astype(jnp.float32) * th  # [1, D/2, W]
    eps = (angle - base) - off  # few ulps of angle
    cb, sb = jnp.cos(base), jnp.sin(base)
    co, so = jnp.cos(off), jnp.sin(off)
    e2 = 1.0 - 0.5 * eps * eps  # cos(eps); sin(eps) ~ eps
    c_off = co * e2 - so * eps
    s_off = so * e2 + co * eps
    return cb * c_off - sb * s_off, sb * c_off + cb * s_off


class Running(NamedTuple):
    """Online-softmax state per query head g: running max, sum and unnormalized output [D]."""

    m: tuple[jax.Array, ...]
    den: tuple[jax.Array, ...]
    acc: tuple[jax.Array, ...]


def running_init(groups: int, d: int) -> Running:
    return Running(
        tuple(jnp.float32(NEG_INF) for _ in range(groups)),
        tuple(jnp.float32(0.0) for _ in range(groups)),
        tuple(jnp.zeros((d,), jnp.float32) for _ in range(groups)),
    )


def online_step(
    state: Running,
    logits: Sequence[jax.Array],
    valid: jax.Array,
    v: jax.Array,
    step: jax.Array,
    block: int,
    mass_ref,
    cm_ref,
) -> Running:
    """Fold one step of ``block`` slots into the running state of every query head.

    logits: per head g, [BS, W] scaled logits; valid [BS, W] bool; v [BS, W, D] f32. Writes the per-slot
    sums ``exp(s - m_new)`` to ``mass_ref[g, step*BS:(step+1)*BS]`` and ``m_new`` to ``cm_ref[g, step]``.
    """
    ms, dens, accs = [], [], []
    rows = pl.ds(step * block, block)
    for g, s in enumerate(logits):
        s = jnp.where(valid, s, NEG_INF)
        m_new = jnp.maximum(state.m[g], jnp.max(s))
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # [BS, W]
        alpha = jnp.exp(state.m[g] - m_new)
        slot = jnp.sum(p, axis=1)  # [BS]
        mass_ref[g, rows] = slot
        cm_ref[g, step] = m_new
        ms.append(m_new)
        dens.append(alpha * state.den[g] + jnp.sum(slot))
        accs.append(alpha * state.acc[g] + jnp.sum(p[:, :, None] * v, axis=(0, 1)))
    return Running(tuple(ms), tuple(dens), tuple(accs))


def write_running(state: Running, out_ref, m_ref, l_ref) -> None:
    for g in range(len(state.m)):
        out_ref[g, :] = state.acc[g]
        m_ref[g] = state.m[g]
        l_ref[g] = state.den[g]


def split_call(
    kernel: Callable[..., None],
    inputs: Sequence[jax.Array],
    in_specs: Sequence[pl.BlockSpec],
    q: jax.Array,
    plan: SplitPlan,
    *,
    interpret: bool,
    num_warps: int,
    num_stages: int,
    poison: bool,
    name: str,
) -> tuple[jax.Array, ...]:
    """Run a split-K decode kernel over grid (B, Hkv, splits); returns (out, m, l, mass, cm) partials.

    With ``poison`` the outputs start as NaN (aliased NaN buffers), so an element the kernel does not write
    shows up as NaN: a check for tests and the GPU bench.
    """
    b, hkv, g, d = q.shape
    ns, ch, nc = plan.splits, plan.per_program, plan.chunks
    f32 = jnp.float32
    out_shape = (
        jax.ShapeDtypeStruct((b, hkv, ns, g, d), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g, ch), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g, nc), f32),
    )
    out_specs = (
        pl.BlockSpec((None, None, None, g, d), lambda i, j, k: (i, j, k, 0, 0)),
        pl.BlockSpec((None, None, None, g), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, None, g), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, None, g, ch), lambda i, j, k: (i, j, k, 0, 0)),
        pl.BlockSpec((None, None, None, g, nc), lambda i, j, k: (i, j, k, 0, 0)),
    )
    inputs, in_specs, aliases, body = list(inputs), list(in_specs), {}, kernel
    if poison:
        n_in = len(inputs)
        inputs += [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape]
        in_specs += list(out_specs)
        aliases = {n_in + i: i for i in range(len(out_shape))}

        def body(*refs):
            kernel(*refs[:n_in], *refs[n_in + len(out_shape) :])

    return pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(b, hkv, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=None if interpret else triton_params(num_warps, num_stages),
        name=name,
    )(*inputs)


def pad_slots(x: jax.Array, n: int, value) -> jax.Array:
    """Pad x [B, N] along N to ``n`` with ``value``."""
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=value)


# ----------------------------------------------------------------------------------------------------------
# the ledger kernel


def _dequant_rows(codes_ref, scale_ref, zero_ref, valid: jax.Array, bits: int) -> jax.Array:
    """Dequantize slots whose grid runs along the last axis: codes [BS, R, N*bits/8], scale and zero [BS, R]
    (masked by valid [BS]) -> [BS, R, N] f32. Keys: R = channels C, N = the window's W tokens (per-channel
    grid); values: R = the W tokens, N = head_dim D (per-token grid)."""
    bs, r, nb = codes_ref.shape
    codes = masked_load(codes_ref, jnp.broadcast_to(valid[:, None, None], (bs, r, nb)))
    grid_mask = jnp.broadcast_to(valid[:, None], (bs, r))
    scale = masked_load(scale_ref, grid_mask).astype(jnp.float32)
    zero = masked_load(zero_ref, grid_mask).astype(jnp.float32)
    return unpack_last(codes, bits).astype(jnp.float32) * scale[:, :, None] + zero[:, :, None]


def _ledger_kernel(
    q_ref,  # [G, D]
    kc_ref,  # [CH, D, W*bits/8]
    ks_ref,  # [CH, D]
    kz_ref,
    vc_ref,  # [CH, W, D*bits/8]
    vs_ref,  # [CH, W]
    vz_ref,
    start_ref,  # [CH] int32
    valid_ref,  # [CH] int32
    freq_ref,  # [D/2] f32
    out_ref,  # [G, D]
    m_ref,  # [G]
    l_ref,  # [G]
    mass_ref,  # [G, CH]
    cm_ref,  # [G, C]
    *,
    window: int,
    bits: int,
    plan: SplitPlan,
):
    groups, d = q_ref.shape
    half, bs = d // 2, plan.block
    scale = d**-0.5
    theta = freq_ref[...].astype(jnp.float32)
    q1 = [q_ref[g, pl.ds(0, half)].astype(jnp.float32) * scale for g in range(groups)]
    q2 = [q_ref[g, pl.ds(half, half)].astype(jnp.float32) * scale for g in range(groups)]
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    def step(i, state: Running) -> Running:
        rows = pl.ds(i * bs, bs)
        valid = valid_ref[rows] != 0  # [BS]
        k1 = _dequant_rows(kc_ref.at[rows, lo], ks_ref.at[rows, lo], kz_ref.at[rows, lo], valid, bits)
        k2 = _dequant_rows(kc_ref.at[rows, hi], ks_ref.at[rows, hi], kz_ref.at[rows, hi], valid, bits)
        cos, sin = rope_cos_sin(start_ref[rows], theta, window)  # [BS, D/2, W]
        kr1 = k1 * cos - k2 * sin
        kr2 = k2 * cos + k1 * sin
        v = _dequant_rows(vc_ref.at[rows], vs_ref.at[rows], vz_ref.at[rows], valid, bits)  # [BS, W, D]
        logits = [
            jnp.sum(q1[g][None, :, None] * kr1 + q2[g][None, :, None] * kr2, axis=1) for g in range(groups)
        ]
        tok_valid = jnp.broadcast_to(valid[:, None], (bs, window))
        return online_step(state, logits, tok_valid, v, i, bs, mass_ref, cm_ref)

    state = jax.lax.fori_loop(0, plan.chunks, step, running_init(groups, d))
    write_running(state, out_ref, m_ref, l_ref)


def _dequant_tokens(codes_ref, scale_ref, zero_ref, valid: jax.Array, bits: int) -> jax.Array:
    """Dequantize per-token groups of ``pack_tokens`` codes [BS, W, D*bits/8] (3 bits: the 2-bit plane of
    D/4 bytes, then the 1-bit plane of D/8, loaded as two ref slices), scale and zero [BS, W] -> [BS, W, D]."""
    if bits != 3:
        return _dequant_rows(codes_ref, scale_ref, zero_ref, valid, bits)
    bs, w, nb = codes_ref.shape
    d = nb * 8 // 3
    low_ref, high_ref = codes_ref.at[:, :, pl.ds(0, d // 4)], codes_ref.at[:, :, pl.ds(d // 4, d // 8)]
    low = unpack_last(masked_load(low_ref, jnp.broadcast_to(valid[:, None, None], (bs, w, d // 4))), 2)
    high = unpack_last(masked_load(high_ref, jnp.broadcast_to(valid[:, None, None], (bs, w, d // 8))), 1)
    grid_mask = jnp.broadcast_to(valid[:, None], (bs, w))
    scale = masked_load(scale_ref, grid_mask).astype(jnp.float32)
    zero = masked_load(zero_ref, grid_mask).astype(jnp.float32)
    codes = (low | jnp.left_shift(high, jnp.uint8(2))).astype(jnp.float32)
    return codes * scale[:, :, None] + zero[:, :, None]


def _rotated_kernel(
    q_ref,  # [G, D] rotated query
    kc_ref,  # [CH, W, D*k_bits/8]
    ks_ref,  # [CH, W]
    kz_ref,
    vc_ref,  # [CH, W, D*v_bits/8]
    vs_ref,  # [CH, W]
    vz_ref,
    valid_ref,  # [CH] int32
    out_ref,  # [G, D]
    m_ref,  # [G]
    l_ref,  # [G]
    mass_ref,  # [G, CH]
    cm_ref,  # [G, C]
    *,
    window: int,
    fmt: RotatedTokens,
    plan: SplitPlan,
):
    groups, d = q_ref.shape
    bs = plan.block
    qs = [q_ref[g, :].astype(jnp.float32) * d**-0.5 for g in range(groups)]

    def step(i, state: Running) -> Running:
        rows = pl.ds(i * bs, bs)
        valid = valid_ref[rows] != 0  # [BS]
        k = _dequant_tokens(
            kc_ref.at[rows], ks_ref.at[rows], kz_ref.at[rows], valid, fmt.k_bits
        )  # [BS, W, D]
        v = _dequant_tokens(vc_ref.at[rows], vs_ref.at[rows], vz_ref.at[rows], valid, fmt.v_bits)
        logits = [jnp.sum(qs[g][None, None, :] * k, axis=-1) for g in range(groups)]  # [BS, W]
        tok_valid = jnp.broadcast_to(valid[:, None], (bs, window))
        return online_step(state, logits, tok_valid, v, i, bs, mass_ref, cm_ref)

    state = jax.lax.fori_loop(0, plan.chunks, step, running_init(groups, d))
    write_running(state, out_ref, m_ref, l_ref)


def _rotated_call(q_rot: jax.Array, tier: QuantTier, fmt: RotatedTokens, **opts) -> Partial:
    """``reference.RotatedAttention`` by ``_rotated_kernel`` (split-K over the slots, as the channel kernel)."""
    codes, _, slot_valid = tier
    b, hkv, g, d = q_rot.shape
    nl, w = codes.k_codes.shape[2], codes.k_codes.shape[3]
    block_slots, num_splits = opts.pop("block_slots"), opts.pop("num_splits")
    plan = plan_splits(nl, b * hkv, block_slots or default_block_slots(w), num_splits)
    ch = plan.per_program
    valid = pad_slots(slot_valid.astype(jnp.int32), plan.padded, 0)
    kb, vb = d * fmt.k_bits // 8, d * fmt.v_bits // 8
    in_specs = [
        pl.BlockSpec((None, None, g, d), lambda i, j, k: (i, j, 0, 0)),
        pl.BlockSpec((None, None, ch, w, kb), lambda i, j, k: (i, j, k, 0, 0)),
        pl.BlockSpec((None, None, ch, w), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, ch, w), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, ch, w, vb), lambda i, j, k: (i, j, k, 0, 0)),
        pl.BlockSpec((None, None, ch, w), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, ch, w), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, ch), lambda i, j, k: (i, k)),
    ]
    inputs = (q_rot, *jax.tree.leaves(codes), valid)
    kernel = functools.partial(_rotated_kernel, window=w, fmt=fmt, plan=plan)
    parts = split_call(kernel, inputs, in_specs, q_rot, plan, name="rotated_ledger_attention", **opts)
    return combine_splits(*parts, nl)


def _check_ledger_shapes(
    q, codes: QuantizedWindows, slot_start, slot_valid, inv_freq, window, fmt: QuantFormat
) -> None:
    b, hkv, _, d = q.shape
    nl = codes.k_codes.shape[2]
    trailing = fmt.field_shapes(window, d)
    expect = {
        f.name: (getattr(codes, f.name), (b, hkv, nl, *getattr(trailing, f.name)))
        for f in dataclasses.fields(codes)
    }
    expect |= {
        "slot_start": (slot_start, (b, nl)),
        "slot_valid": (slot_valid, (b, nl)),
        "inv_freq": (inv_freq, (d // 2,)),
    }
    for name, (x, shape) in expect.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if isinstance(fmt, ChannelKeys) and (fmt.bits not in (2, 4) or window % (8 // fmt.bits) or d % 2):
        raise ValueError(f"unsupported bits={fmt.bits}, window={window}, head_dim={d}")
    if isinstance(fmt, RotatedTokens) and d % 8:
        raise ValueError(f"the rotated ledger format needs head_dim % 8 == 0, got {d}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "window",
        "fmt",
        "interpret",
        "block_slots",
        "num_splits",
        "num_warps",
        "num_stages",
        "poison",
    ),
)
def ledger_attention(
    q: jax.Array,
    tier: QuantTier,
    inv_freq: jax.Array,
    *,
    window: int,
    fmt: QuantFormat,
    interpret: bool | None = None,
    block_slots: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 8,
    num_stages: int = 2,
    poison: bool = False,
) -> Partial:
    """Attention partial of one decode query per head over the packed ledger (Pallas kernel).

    Same arguments and results as ``pallas_kernels.reference.ledger_partial``: q [B, Hkv, G, D]; tier (codes
    [B, Hkv, NL, ...] in format ``fmt``, slot_start [B, NL] int32, slot_valid [B, NL] bool); inv_freq [D/2]
    f32. The "channel" format runs ``_ledger_kernel``; ``RotatedTokens`` runs ``_rotated_kernel`` on the
    rotated query (``reference.rotated_partial``). Returns a ``Partial`` (out [B, Hkv, G, D] unnormalized, m, l [B, Hkv, G], mass per slot
    [B, Hkv, G, NL]), all f32.

    Options: ``interpret`` (default: not on a GPU), ``block_slots`` (slots per inner step, a power of two;
    default ``BLOCK_TOKENS // W``), ``num_splits`` (programs per (row, KV head); default aims at
    ``TARGET_PROGRAMS`` programs), Triton ``num_warps`` / ``num_stages``, ``poison`` (NaN-initialized
    outputs, for checks).
    """
    codes, slot_start, slot_valid = tier
    _check_ledger_shapes(q, codes, slot_start, slot_valid, inv_freq, window, fmt)
    b, hkv, g, d = q.shape
    nl = codes.k_codes.shape[2]
    if nl == 0:
        return empty_partial(q)
    if isinstance(fmt, RotatedTokens):
        opts = dict(
            block_slots=block_slots,
            num_splits=num_splits,
            interpret=resolve_interpret(interpret),
            num_warps=num_warps,
            num_stages=num_stages,
            poison=poison,
        )
        return rotated_partial(q, tier, fmt, functools.partial(_rotated_call, **opts))
    bits = fmt.bits
    plan = plan_splits(nl, b * hkv, block_slots or default_block_slots(window), num_splits)
    ch, per = plan.per_program, 8 // bits
    start = pad_slots(slot_start.astype(jnp.int32), plan.padded, 0)
    valid = pad_slots(slot_valid.astype(jnp.int32), plan.padded, 0)
    in_specs = [
        pl.BlockSpec((None, None, g, d), lambda i, j, k: (i, j, 0, 0)),
        pl.BlockSpec((None, None, ch, d, window // per), lambda i, j, k: (i, j, k, 0, 0)),
        pl.BlockSpec((None, None, ch, d), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, ch, d), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, ch, window, d // per), lambda i, j, k: (i, j, k, 0, 0)),
        pl.BlockSpec((None, None, ch, window), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, None, ch, window), lambda i, j, k: (i, j, k, 0)),
        pl.BlockSpec((None, ch), lambda i, j, k: (i, k)),
        pl.BlockSpec((None, ch), lambda i, j, k: (i, k)),
        pl.BlockSpec((d // 2,), lambda i, j, k: (0,)),
    ]
    inputs = (q, *jax.tree.leaves(codes), start, valid, inv_freq.astype(jnp.float32))
    kernel = functools.partial(_ledger_kernel, window=window, bits=bits, plan=plan)
    parts = split_call(
        kernel,
        inputs,
        in_specs,
        q,
        plan,
        interpret=resolve_interpret(interpret),
        num_warps=num_warps,
        num_stages=num_stages,
        poison=poison,
        name="ledger_attention",
    )
    return combine_splits(*parts, nl)
