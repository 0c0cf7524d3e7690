"""Shapes and compilations: the length buckets that share one compilation, and the cache of compiled
executables that the generation functions run through (``generate.py``)."""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

import jax


def bucket_length(n: int) -> int:
    """Round a prompt length up to its bucket: multiples of max(64, 2^floor(log2 n) / 16).

    The bucket granularity is at most 1/16 of the length, so a whole bucket shares one compilation and
    padding wastes little prefill compute.
    """
    if n < 1:
        raise ValueError("empty prompt")
    step = max(64, (1 << (n.bit_length() - 1)) // 16)
    return -(-n // step) * step


def bucket_floor(n: int) -> int:
    """Smallest prompt length that falls in the same bucket as ``n``."""
    top = bucket_length(n)
    lo = n
    while lo > 1 and bucket_length(lo - 1) == top:
        lo -= 1
    return lo


def chunk_capacity(n: int) -> int:
    """Padded length of an appended chunk of ``n`` tokens (a multiple of 16: one compilation per bucket)."""
    return -(-n // 16) * 16


class ExecutableCache:
    """Ahead-of-time compiled executables, keyed by function, static arguments and dynamic shapes, dtypes
    and shardings.

    Compiling ahead of time keeps compilation out of the measured time to first token. The cache keeps the
    ``capacity`` most recently used executables: each XLA CPU executable holds its machine code in memory
    mappings of its own, and an unbounded cache in a long process (a sweep over many shapes, the test suite)
    runs into the kernel's limit on mappings (``vm.max_map_count``), where the compiler crashes.
    ``compilations`` counts the compilations per function name (a test of "one compilation per shape
    bucket" reads it).
    """

    def __init__(self, capacity: int = 48) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._executables: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self.compilations: collections.Counter[str] = collections.Counter()
        self._latest: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self._executables)

    def clear(self) -> None:
        self._executables.clear()
        self._latest.clear()

    def latest(self, name: str) -> Any:
        """The compiled executable that the function named ``name`` (as in ``compilations``: "_prefill",
        "_decode", ...) ran through last, or None; its ``memory_analysis()`` gives XLA's buffer sizes."""
        key = self._latest.get(name)
        return self._executables.get(key) if key is not None else None

    def run(self, jitted, static: Mapping[str, Any], *args, **kwargs) -> tuple[Any, float]:
        """Call ``jitted(*args, **kwargs, **static)`` through a cached executable; returns (outputs, seconds
        spent compiling).

        ``static``: the static arguments by name (the jitted function's ``static_argnames``); ``args`` and
        ``kwargs``: the traced inputs (by name when a static parameter comes before them in the signature).
        The executable is keyed by the static values and the traced inputs' tree, shapes, dtypes and
        shardings.
        """
        positions = [k for k in static if not isinstance(k, str)]
        if positions:
            raise TypeError(
                f"static arguments are given by name (static_argnames), got positions {positions}"
            )
        leaves, treedef = jax.tree.flatten((args, kwargs))
        # an executable is compiled for its inputs' shardings too (one device, or a mesh's NamedShardings)
        layout = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)
        key = (jitted, tuple(sorted(static.items(), key=lambda kv: kv[0])), treedef, layout)
        compile_s = 0.0
        if key in self._executables:
            self._executables.move_to_end(key)
        else:
            t0 = time.perf_counter()
            self._executables[key] = jitted.lower(*args, **kwargs, **static).compile()
            compile_s = time.perf_counter() - t0
            self.compilations[getattr(jitted, "__name__", repr(jitted))] += 1
            while len(self._executables) > self.capacity:
                self._executables.popitem(last=False)
        self._latest[getattr(jitted, "__name__", repr(jitted))] = key
        return self._executables[key](*args, **kwargs), compile_s


EXECUTABLES = ExecutableCache()
