"""The split-K machinery every decode kernel shares (docs/design.md §9): how the slot axis is cut into
programs, the online softmax a program runs over its slots, the ``pallas_call`` and the jnp combine.

A kernel is written as ``load(rows, valid) -> (logits per query head [BS, W], values [BS, W, D])`` for one
step of ``block`` slots; ``online_softmax`` folds the steps and writes the program's partial to
``PartialRefs``, and ``split_attention`` launches it over grid ``(B, Hkv, splits)`` and merges the programs'
partials into one ``tiers.Partial``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from models.attention import NEG_INF
from pallas_kernels.dispatch import resolve_interpret, triton_params
from pallas_kernels.tiers import Partial

TARGET_PROGRAMS = 512  # programs per launch the split heuristic aims at (a few waves on ~132 SMs)
BLOCK_TOKENS = 32  # tokens per inner step by default (block slots = BLOCK_TOKENS // W)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """How a kernel is launched: ``interpret`` (None: not on a GPU), Triton ``num_warps`` / ``num_stages``,
    ``poison`` (outputs start as NaN, so an element the kernel does not write shows up: a check for tests
    and the GPU bench), and the slot split (``block_slots`` per inner step, a power of two, default
    ``default_block_slots``; ``num_splits`` programs per (row, KV head), default ``plan_splits``')."""

    interpret: bool | None = None
    num_warps: int | None = None  # None: the kernel's own default
    num_stages: int = 2
    poison: bool = False
    block_slots: int | None = None
    num_splits: int | None = None

    def plan(self, *, slots: int, rows: int, window: int) -> SplitPlan:
        """The split of ``slots`` slots of ``window`` tokens for ``rows`` = B * Hkv."""
        return plan_splits(slots, rows, self.block_slots or default_block_slots(window), self.num_splits)


DEFAULT_LAUNCH = Launch()


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
# in-kernel helpers


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


class PartialRefs(NamedTuple):
    """The output refs of one program: out [G, D], m [G], l [G], per-slot sums mass [G, CH] relative to
    the step maxima step_max [G, C]."""

    out: object
    m: object
    l: object  # noqa: E741
    mass: object
    step_max: object


class Running(NamedTuple):
    """Online-softmax state per query head g: running max, sum and unnormalized output [D]."""

    m: tuple[jax.Array, ...]
    den: tuple[jax.Array, ...]
    acc: tuple[jax.Array, ...]


def _fold_step(state: Running, logits: Sequence[jax.Array], *, valid, v, step, block: int, outs) -> Running:
    """Fold one step of ``block`` slots into the running state of every query head.

    logits: per head g, [BS, W] scaled logits; valid [BS, W] bool; v [BS, W, D] f32. Writes the per-slot
    sums ``exp(s - m_new)`` to ``outs.mass[g, step*BS:(step+1)*BS]`` and ``m_new`` to
    ``outs.step_max[g, step]``.
    """
    ms, dens, accs = [], [], []
    rows = pl.ds(step * block, block)
    for g, s in enumerate(logits):
        s = jnp.where(valid, s, NEG_INF)
        m_new = jnp.maximum(state.m[g], jnp.max(s))
        p = jnp.where(valid, jnp.exp(s - m_new), 0.0)  # [BS, W]
        alpha = jnp.exp(state.m[g] - m_new)
        slot = jnp.sum(p, axis=1)  # [BS]
        outs.mass[g, rows] = slot
        outs.step_max[g, step] = m_new
        ms.append(m_new)
        dens.append(alpha * state.den[g] + jnp.sum(slot))
        accs.append(alpha * state.acc[g] + jnp.sum(p[:, :, None] * v, axis=(0, 1)))
    return Running(tuple(ms), tuple(dens), tuple(accs))


StepLoad = Callable[[object, jax.Array], tuple[Sequence[jax.Array], jax.Array]]


def online_softmax(
    load: StepLoad, *, valid_ref, outs: PartialRefs, plan: SplitPlan, groups: int, window: int, d: int
) -> None:
    """One program's attention over its ``plan.chunks`` steps of ``plan.block`` slots.

    ``load(rows, valid)``: for the slot range ``rows`` (a ``pl.ds``) and its validity valid [BS] bool, the
    scaled logits per query head [BS, W] and the values [BS, W, D] f32. valid_ref: [CH] int32 slot validity.
    Writes the program's partial to ``outs``.
    """
    bs = plan.block

    def step(i, state: Running) -> Running:
        rows = pl.ds(i * bs, bs)
        valid = valid_ref[rows] != 0  # [BS]
        logits, v = load(rows, valid)
        tok_valid = jnp.broadcast_to(valid[:, None], (bs, window))
        return _fold_step(state, logits, valid=tok_valid, v=v, step=i, block=bs, outs=outs)

    init = Running(
        tuple(jnp.float32(NEG_INF) for _ in range(groups)),
        tuple(jnp.float32(0.0) for _ in range(groups)),
        tuple(jnp.zeros((d,), jnp.float32) for _ in range(groups)),
    )
    state = jax.lax.fori_loop(0, plan.chunks, step, init)
    for g in range(groups):
        outs.out[g, :] = state.acc[g]
        outs.m[g] = state.m[g]
        outs.l[g] = state.den[g]


# ----------------------------------------------------------------------------------------------------------
# the launch


def pad_slots(x: jax.Array, n: int, value) -> jax.Array:
    """Pad x [B, N] along N to ``n`` with ``value``."""
    return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=value)


def _program_block(n: int) -> Callable[[int, int, int], tuple[int, ...]]:
    """Index map of program (i, j, k): block (i, j, k) of the leading axes, all of the ``n`` trailing ones."""
    return lambda i, j, k: (i, j, k) + (0,) * n


def split_attention(
    kernel: Callable[..., None],
    *,
    q: jax.Array,
    slot_inputs: Sequence[jax.Array],
    row_inputs: Sequence[jax.Array],
    shared_inputs: Sequence[jax.Array] = (),
    slots: int,
    plan: SplitPlan,
    launch: Launch,
    default_warps: int,
    name: str,
    out_dim: int | None = None,
) -> Partial:
    """Run a split-K decode kernel over grid (B, Hkv, splits) and merge its programs' partials.

    The kernel sees, in order: the query [G, D] of q [B, Hkv, G, D]; ``CH = plan.per_program`` slots of each
    of ``slot_inputs`` [B, Hkv, N, ...]; the same slots of each of ``row_inputs`` [B, plan.padded] (padded
    with ``pad_slots``); each of ``shared_inputs`` whole ([M]); then the ``PartialRefs``. Slot inputs are
    not padded: the kernel must mask its loads past ``slots`` by the (padded) validity it reads.
    ``default_warps``: Triton warps when ``launch`` names none. ``out_dim``: D of the output when the query
    carries more than one D-vector per head (q [B, Hkv, G, k D]; None: q's last axis). Returns the
    ``Partial`` over the first ``slots`` slots.
    """
    b, hkv, g, dq = q.shape
    d = out_dim or dq
    ns, ch, nc = plan.splits, plan.per_program, plan.chunks
    f32 = jnp.float32
    out_shape = (
        jax.ShapeDtypeStruct((b, hkv, ns, g, d), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g, ch), f32),
        jax.ShapeDtypeStruct((b, hkv, ns, g, nc), f32),
    )
    out_specs = tuple(pl.BlockSpec((None, None, None, *s.shape[3:]), _program_block(len(s.shape) - 3)) for s in out_shape)
    inputs = [q, *slot_inputs, *row_inputs, *shared_inputs]
    in_specs = [
        pl.BlockSpec((None, None, g, dq), lambda i, j, k: (i, j, 0, 0)),
        *(pl.BlockSpec((None, None, ch, *x.shape[3:]), _program_block(x.ndim - 3)) for x in slot_inputs),
        *(pl.BlockSpec((None, ch), lambda i, j, k: (i, k)) for _ in row_inputs),
        *(pl.BlockSpec(x.shape, lambda i, j, k: (0,)) for x in shared_inputs),
    ]
    n_in, aliases = len(inputs), {}

    def body(*refs):
        # with poison the NaN output buffers come in as aliased inputs: skip them
        kernel(*refs[:n_in], PartialRefs(*refs[-len(out_shape) :]))

    if launch.poison:
        inputs += [jnp.full(s.shape, jnp.nan, s.dtype) for s in out_shape]
        in_specs += list(out_specs)
        aliases = {n_in + i: i for i in range(len(out_shape))}
    interpret = resolve_interpret(launch.interpret)
    parts = pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=(b, hkv, ns),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=None if interpret else triton_params(launch.num_warps or default_warps, launch.num_stages),
        name=name,
    )(*inputs)
    partial = combine_splits(*parts, slots)
    shapes = [(b, hkv, g, d), (b, hkv, g), (b, hkv, g), (b, hkv, g, slots)]
    chex.assert_shape([partial.out, partial.m, partial.l, partial.mass], shapes)
    return partial
