"""QEvict: recoverable quantized KV-cache eviction, and every baseline over the same machinery."""

from qevict_jax.methods import available_methods, make_method

__all__ = ["available_methods", "make_method"]
