"""The collectives a compiled decode loop runs per step, read from its HLO text (``compiled.as_text()`` of
``qevict_jax.runtime.compiled.EXECUTABLES.latest("_decode")``): what a sharded step moves between devices.
Used by ``bench/throughput.py`` and the sharding checks (``tests/sharding_worker.py``), which put this folder
on ``sys.path``."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

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
