"""The one parser of method options given as text: ``--set`` items (``name=value``, ``method.name=value``) and
method specs (``"qevict:0.2,n_obs=64"``). Both split ``name=value`` the same way (``parse_option_item``) and
type a value the same way (``parse_option_value``); ``registry.configure`` then checks each option against its
method, so a name or value is judged in one place whichever way it came in.
"""

from __future__ import annotations

from typing import Any

ScopedOptions = dict[str | None, dict[str, Any]]
"""{method name, or None for every method: {option: value}} (``parse_set_options``)."""


def parse_option_value(text: str) -> Any:
    """A command-line option value: true/false, none, an int, a float, else the string itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def parse_option_item(item: str, *, expected: str) -> tuple[str, Any]:
    """``"name = value"`` -> (name, ``parse_option_value(value)``); anything else is a ValueError that says
    what was ``expected`` and what was given."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"{expected}, got {item!r}")
    return key.strip(), parse_option_value(value)


def parse_set_options(items: list[str] | None) -> ScopedOptions:
    """``--set`` items (``name=value`` for every method, ``method.name=value`` for one) ->
    {method name or None: {option: value}}."""
    scoped: ScopedOptions = {}
    for item in items or []:
        key, value = parse_option_item(item, expected="--set takes name=value or method.name=value")
        scope, dot, name = key.rpartition(".")
        scoped.setdefault(scope if dot else None, {})[name] = value
    return scoped


def options_for(name: str, scoped: ScopedOptions) -> dict[str, Any]:
    """The options of method ``name`` from ``parse_set_options``' result (scoped ones win)."""
    return {**scoped.get(None, {}), **scoped.get(name, {})}


def parse_method_spec(spec: str) -> tuple[str, float | None, dict[str, Any]]:
    """``"qevict:0.2,n_obs=64"`` -> ("qevict", 0.2, {"n_obs": 64}); the budget and the options are optional."""
    head, *rest = [part.strip() for part in spec.split(",")]
    name, sep, budget_text = head.partition(":")
    if not name.strip():
        raise ValueError(f"method spec {spec!r} names no method (expected name[:budget][,option=value...])")
    budget = None
    if sep:
        budget = parse_option_value(budget_text)
        if isinstance(budget, bool) or not isinstance(budget, int | float):
            raise ValueError(
                f"method spec {spec!r}: the budget after ':' must be a number, got {budget_text!r}"
            )
        budget = float(budget)
    expected = f"method spec {spec!r}: expected option=value"
    options = dict(parse_option_item(item, expected=expected) for item in rest)
    return name.strip(), budget, options
