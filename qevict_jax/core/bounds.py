"""Range checks of configuration fields, written as tables (one ``Bound`` per field) so that every
configuration class states its valid values in one place and reports them in the same words; and the typing
of an option's value by its field's declared type (``typed_value``), so that a value of the wrong type is
named, not passed on to fail inside a comparison."""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Callable, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Bound:
    """A field's valid values: ``ok(value)``, and ``rule``, the words of the error (``"{field} must be
    {rule}, got {value}"``)."""

    field: str
    ok: Callable[[Any], bool]
    rule: str


def check_bounds(obj: object, bounds: Sequence[Bound]) -> None:
    """Raise ``ValueError`` on the first field of ``obj`` outside its ``Bound``."""
    for b in bounds:
        value = getattr(obj, b.field)
        if not b.ok(value):
            raise ValueError(f"{b.field} must be {b.rule}, got {value}")


_TYPE_NAMES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None)}
_KIND_WORDS = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    type(None): "none",
}


def _parse_text(text: str, kind: type) -> Any:
    """``text`` as a value of ``kind``; raises ValueError when it is not one."""
    low = text.strip().lower()
    if kind is bool:
        if low not in ("true", "false"):
            raise ValueError(text)
        return low == "true"
    if kind is type(None):
        if low != "none":
            raise ValueError(text)
        return None
    if kind is int:
        try:
            return int(text.strip())
        except ValueError:
            return _integral(float(text))
    return kind(text.strip()) if kind is not str else text


def _integral(value: float) -> int:
    """``value`` as an int when it is a whole number (``1e6``); raises ValueError otherwise."""
    if not float(value).is_integer():
        raise ValueError(value)
    return int(value)


def typed_value(name: str, value: Any, annotation: str, rule: str = "") -> Any:
    """``value`` of option ``name`` as the type its field declares: ``annotation`` is the field's type as
    written (``"int"``, ``"float | None"``, ``"int | float"``; other annotations take ``value`` as it is).

    A string (a command-line value) is parsed as the first declared type it reads as (``"none"`` is None
    where None is allowed); an int is taken for a float, a whole float (``1e6``) for an int, never a bool
    for a number. Anything else is a ValueError naming the option, the value and what it takes (``rule``: its
    range or choices, e.g. ``"in [0, 1]"``).
    """
    kinds = [_TYPE_NAMES.get(part.strip()) for part in annotation.split("|")]
    if not kinds or None in kinds:
        return value
    order = [k for k in (bool, int, float, str, type(None)) if k in kinds]
    if isinstance(value, str) and str not in kinds:
        for kind in order:
            try:
                return _parse_text(value, kind)
            except ValueError:
                continue
    elif value is None or isinstance(value, bool):
        if type(value) in kinds:
            return value
    elif isinstance(value, numbers.Integral) and (int in kinds or float in kinds):
        return int(value) if int in kinds else float(value)
    elif isinstance(value, numbers.Real) and float in kinds:
        return float(value)
    elif isinstance(value, numbers.Real) and int in kinds and float(value).is_integer():
        return int(value)
    elif isinstance(value, str | os.PathLike) and str in kinds:
        return os.fspath(value)  # a folder option (``gates``) given as a Path
    takes = " or ".join(_KIND_WORDS[k] for k in order)
    raise ValueError(f"option {name!r} takes {takes}{f' ({rule})' if rule else ''}, got {value!r}")
