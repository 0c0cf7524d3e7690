"""Which kernel runs where.

The Pallas kernels lower to Triton on a GPU; on any other backend they only run in Pallas' interpret mode
(slow, for tests), so callers use the pure-jnp references there unless forced. On the CPU, decode attention
over the packed ledger runs the FFI kernel of ``cpu_ledger`` when it builds.
"""

from __future__ import annotations

import os

import jax
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import cpu_ledger
from pallas_kernels.formats import QuantFormat
from pallas_kernels.reference import ledger_partial


def on_gpu() -> bool:
    """True when the default JAX backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() == "gpu"


def use_pallas(force: bool | None = None) -> bool:
    """Whether to call the Pallas kernels: ``force`` when given, else only on a GPU backend."""
    return on_gpu() if force is None else bool(force)


def default_interpret() -> bool:
    """Pallas ``interpret`` flag: interpret everywhere except on a GPU."""
    return not on_gpu()


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret`` when given, else ``default_interpret()``."""
    return default_interpret() if interpret is None else bool(interpret)


def triton_params(num_warps: int, num_stages: int):
    """Triton compiler parameters (``pltriton.CompilerParams``; ``TritonCompilerParams`` in older jax)."""
    cls = getattr(pltriton, "CompilerParams", None) or pltriton.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


def use_cpu_kernel() -> bool:
    """Whether decode attention over the ledger runs the CPU kernel (``cpu_ledger``): on the CPU backend,
    when it builds, unless ``QEVICT_CPU_KERNEL=0``."""
    if jax.default_backend() != "cpu" or os.environ.get("QEVICT_CPU_KERNEL", "1") == "0":
        return False
    return cpu_ledger.available()


def ledger_attention(*args, window: int, fmt: QuantFormat):
    """``reference.ledger_partial`` by the fastest path here: the CPU kernel where ``use_cpu_kernel()``,
    else the jnp reference (which XLA fuses on any backend)."""
    fn = cpu_ledger.ledger_attention_cpu if use_cpu_kernel() else ledger_partial
    return fn(*args, window=window, fmt=fmt)
