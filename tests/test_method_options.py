"""One parser for method options given as text (issue 48): ``--set`` items and method specs split and type
``name=value`` the same way, so an option means the same thing whichever way it is written."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qevict_jax.methods.options import (
    options_for,
    parse_method_spec,
    parse_option_item,
    parse_option_value,
    parse_set_options,
)
from qevict_jax.methods.registry import make_method

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
VALUES = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-(10**6), 10**6),
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
    st.from_regex(r"[a-z][a-z0-9_-]{0,11}", fullmatch=True).filter(
        lambda s: s not in ("true", "false", "none")
    ),
)


@given(st.dictionaries(NAMES, VALUES, max_size=5))
def test_set_items_and_a_spec_give_the_same_options(options):
    items = [f"{k}={v}" for k, v in options.items()]
    via_set = options_for("qevict", parse_set_options(items))
    name, budget, via_spec = parse_method_spec(",".join(["qevict:0.1", *items]))
    assert (name, budget) == ("qevict", 0.1)
    assert via_set == via_spec == options  # each value comes back as the object that was written


@pytest.mark.parametrize(
    "text, want",
    [
        ("true", True),
        ("False", False),
        ("none", None),
        ("3", 3),
        ("0.5", 0.5),
        ("-1e3", -1000.0),
        (" rot-k4v3 ", "rot-k4v3"),
    ],
)
def test_option_values_by_hand(text, want):
    got = parse_option_value(text)
    assert got == want and type(got) is type(want)


def test_a_malformed_item_names_what_was_expected():
    with pytest.raises(ValueError, match=r"--set takes name=value or method.name=value, got 'n_obs'"):
        parse_set_options(["n_obs"])
    with pytest.raises(ValueError, match=r"method spec 'qevict,=3': expected option=value, got '=3'"):
        parse_method_spec("qevict,=3")
    with pytest.raises(ValueError, match="the budget after ':' must be a number, got 'true'"):
        parse_method_spec("qevict:true")
    assert parse_option_item(" q_frac = 0.7 ", expected="x") == ("q_frac", 0.7)


def test_a_spec_and_set_items_build_the_same_method():
    spec = "qevict:0.1,q_frac=0.7,q_spill=none,quant=rot-k4v3"
    name, budget, options = parse_method_spec(spec)
    from_set = options_for(
        "qevict", parse_set_options(["q_frac=0.7", "qevict.q_spill=none", "quant=rot-k4v3"])
    )
    assert make_method(name, budget, **options) == make_method("qevict", 0.1, **from_set)
