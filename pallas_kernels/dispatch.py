"""When to run the Pallas kernels, and how (compiled on a GPU, interpreted elsewhere).

The kernels lower to Triton through Pallas on a GPU; on any other backend they only run in Pallas'
interpret mode (slow, for tests), so callers use the pure-jnp references there unless forced.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pltriton


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
