"""No behaviour change: on the fixed 2K prompt of ``tests/pin_tokens.py``, Full-KV and every registered method at
β = 0.2 generate exactly the pinned tokens, at the pinned measured memory ratio, with the pinned routing counters
(``tests/data/token_pins.json``, written by ``python tests/pin_tokens.py --write``).

Tokens that differ from the pins pass only at a near tie: teacher-forced, every pinned token is within
``TIE_NATS`` of the best log-probability on this machine (``pin_tokens.tie_deficits``). A method excused so is
held to its pinned bytes, not to its routing counters (a routing event's scores depend on the tokens decoded).

The run is a subprocess of ``pin_tokens.py``: its own process for the compilation of 27 decode loops and a shared
prefill (kept out of this process's executable cache and memory mappings), with XLA's persistent compilation
cache, so a rerun on unchanged code loads the executables.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pin_tokens import NEW_TOKENS, SKIPPED, TIE_NATS

from qevict_jax.methods.registry import available_methods

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "pin_tokens.py"
PINS = HERE / "data" / "token_pins.json"


@pytest.fixture(scope="module")
def measured(smollm2_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pins") / "measured.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-dir", str(smollm2_dir), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def pins() -> dict:
    return json.loads(PINS.read_text())


@pytest.mark.slow
def test_the_prompt_and_the_methods_are_the_pinned_ones(measured, pins):
    assert measured["prompt"] == pins["prompt"], "the fixed prompt changed: the pins no longer apply"
    assert (measured["beta"], measured["max_new_tokens"]) == (pins["beta"], pins["max_new_tokens"])
    assert measured["skipped"] == pins["skipped"]
    assert sorted(measured["methods"]) == sorted(pins["methods"]), (
        "the registered methods changed: pin the new ones (python tests/pin_tokens.py --write on the commit "
        "before the change) or rename them in the pins"
    )


def at_a_tie(measured: dict, name: str) -> bool:
    """The pinned tokens of ``name`` are a greedy decoding of this run's logits up to near ties."""
    deficits = measured.get("tie_deficits", {}).get(name)
    return deficits is not None and max(deficits) <= TIE_NATS


@pytest.mark.slow
def test_every_method_generates_the_pinned_tokens(measured, pins):
    differ = {
        name: (measured["methods"][name]["tokens"], want["tokens"], measured.get("tie_deficits", {}).get(name))
        for name, want in pins["methods"].items()
        if name in measured["methods"] and measured["methods"][name]["tokens"] != want["tokens"]
    }
    beyond_ties = {name: d for name, d in differ.items() if not at_a_tie(measured, name)}
    assert beyond_ties == {}, f"(measured, pinned tokens, pinned tokens' deficits): {beyond_ties}"


@pytest.mark.slow
def test_every_method_keeps_its_pinned_memory_and_counters(measured, pins):
    for name, want in pins["methods"].items():
        got = measured["methods"].get(name)
        if got is None:
            continue
        assert got["memory_ratio"] == pytest.approx(want["memory_ratio"], rel=0, abs=1e-9), name
        assert got["cache_bytes"] == want["cache_bytes"], name
        assert got["full_kv_bytes"] == want["full_kv_bytes"], name
        assert got["compressed"] == want["compressed"], name
        if got["tokens"] == want["tokens"] or not at_a_tie(measured, name):
            assert got.get("counters") == want.get("counters"), name


@pytest.mark.slow
def test_a_method_alone_generates_what_it_generates_in_the_shared_prefill(measured, pins):
    """``generate`` with one method (its own prefill) gives the tokens of the shared prefill, pinned (ties
    aside)."""
    assert sorted(measured["alone"]) == sorted(pins["alone"])
    for name, tokens in measured["alone"].items():
        assert tokens == pins["methods"][name]["tokens"] or at_a_tie(measured, name), name


def test_the_pins_cover_full_kv_and_every_registered_method():
    """Cheap and without the model: the pins file names every registered method but the skipped ones (with
    why), each with its tokens and measured ratio."""
    pins = json.loads(PINS.read_text())
    assert sorted(pins["methods"]) == sorted(set(available_methods()) - set(SKIPPED))
    assert pins["skipped"] == SKIPPED and all(SKIPPED.values())
    for name, rec in pins["methods"].items():
        assert len(rec["tokens"]) == NEW_TOKENS, name
        assert 0 < rec["memory_ratio"] <= 1.0 + 1e-3, name
    assert pins["methods"]["full"]["compressed"] is False
    assert pins["prompt"]["tokens"] > 1900
