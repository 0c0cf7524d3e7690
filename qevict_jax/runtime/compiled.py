"""Shapes and compilations: the length buckets that share one compilation, the cache of compiled
executables that the generation functions run through (``generate.py``), and the collectives a compiled
decode loop runs per step (read from its HLO text: what a sharded step moves between devices)."""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np


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


# ------------------------------------------------------------------------------------- collectives in HLO

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+)\[([\d,]*)\]")
_ITEM_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


class Collective(NamedTuple):
    """One collective instruction of a compiled program: op (``COLLECTIVES``), its result's array shapes
    (a combined op has several), its operands' shapes, bytes = the larger of the result's and the
    operands' total bytes (what one device sends or receives, at most), and how often one run of the
    enclosing loop body executes it (``times``: known trip counts of the loops nested in it)."""

    op: str
    result: tuple[tuple[int, ...], ...]
    operands: tuple[tuple[int, ...], ...]
    bytes: int
    times: int


def _arrays(text: str) -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of every array type in an HLO type string (a tuple type has several)."""
    out = []
    for dtype, dims in _ARRAY.findall(text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        bits = _ITEM_BITS.get(dtype) or int(re.sub(r"\D", "", dtype.split("e")[0]) or 8)
        out.append((shape, int(np.prod(shape, dtype=np.int64)) * bits // 8))
    return out


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of every computation of an HLO module's text, and the entry's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def decode_loop_collectives(hlo: str, *, dynamic_loops: bool) -> list[Collective]:
    """The collectives one iteration of the outermost while loop of a compiled program runs (its condition
    and body: the decode loop's step, from ``compiled.as_text()``), each with how often it runs per
    iteration.

    Nested loops with a known trip count (the layer scan) multiply their collectives by it; loops without
    one (the routing moves, 0 iterations on a step without a routing event) and conditional branches are
    included, once, only when ``dynamic_loops`` (an upper bound: a step with a routing event, each move
    loop taken once); else a step without one."""
    comps, entry = _computations(hlo)
    shapes = {}
    for lines in comps.values():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if m:
                shapes[m.group(1)] = m.group(2)
    loops = [line for line in comps[entry] if " while(" in line]
    if len(loops) != 1:
        raise ValueError(f"expected one while loop in the entry computation, found {len(loops)}")
    found: list[Collective] = []

    def walk(name: str, times: int, seen: frozenset) -> None:
        for line in comps.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            op = m.group(3).removesuffix("-start")
            if op in COLLECTIVES and not m.group(3).endswith("-done"):
                result = _arrays(m.group(2))
                if m.group(3).endswith("-start"):  # (operands, results) tuple of an async op: the largest
                    result = [max(result, key=lambda a: a[1])]
                args = re.findall(r"%([\w.\-]+)", m.group(4).split("),")[0])
                operands = [a for arg in args for a in _arrays(shapes.get(arg, ""))]
                size = max(sum(b for _, b in result), sum(b for _, b in operands))
                found.append(
                    Collective(op, tuple(s for s, _ in result), tuple(s for s, _ in operands), size, times)
                )
            elif m.group(3) == "while":
                body = re.search(r"body=%([\w.\-]+)", line).group(1)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                if (trips or dynamic_loops) and body not in seen:
                    walk(body, times * (int(trips.group(1)) if trips else 1), seen | {body})
            else:
                called = re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)
                if m.group(3) == "conditional" and dynamic_loops:
                    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                    pair = re.findall(r"(?:true|false)_computation=%([\w.\-]+)", line)
                    called += re.findall(r"%([\w.\-]+)", branches.group(1)) if branches else pair
                for c in called:
                    if c not in seen:
                        walk(c, times, seen | {c})

    body = re.search(r"body=%([\w.\-]+)", loops[0]).group(1)
    condition = re.search(r"condition=%([\w.\-]+)", loops[0]).group(1)
    walk(condition, 1, frozenset({condition}))  # the loop test runs once per step too
    walk(body, 1, frozenset({body}))
    return found


def decode_step_collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes one device moves through collectives in one decode step (``decode_loop_collectives``): "step",
    a step without a routing event, and "routing_step", one with (the upper bound)."""
    return {
        key: sum(c.bytes * c.times for c in decode_loop_collectives(hlo, dynamic_loops=dyn))
        for key, dyn in (("step", False), ("routing_step", True))
    }
