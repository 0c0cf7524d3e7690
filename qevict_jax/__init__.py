"""QEvict: recoverable quantized KV-cache eviction, and every baseline over the same machinery.

``qevict_jax.load(name)`` gives a ``Pipeline`` (model + tokenizer) with ``generate`` and ``chat``;
``make_method`` builds any method for the lower-level ``qevict_jax.runtime.generate.generate``.
"""

from qevict_jax.methods.registry import available_methods, make_method
from qevict_jax.pipeline import Conversation, Pipeline, Reply, load

__all__ = ["Conversation", "Pipeline", "Reply", "available_methods", "load", "make_method"]
