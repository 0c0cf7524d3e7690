"""Range checks of configuration fields, written as tables (one ``Bound`` per field) so that every
configuration class states its valid values in one place and reports them in the same words."""

from __future__ import annotations

import dataclasses
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
