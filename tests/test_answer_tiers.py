"""bench/answer_tiers.py: where an answer's tokens are found in a prompt, and the tiers of their windows after
the prefill, against hand-checked values and the budget's invariants on a tiny random model."""

from __future__ import annotations

import numpy as np
import pytest
from tiny import decisive_model, load_bench, roomy_method, tiny_llama

from qevict_jax.diagnostics.metrics import LOCAL, E, F, Q
from qevict_jax.methods.registry import make_method

answer_tiers = load_bench("answer_tiers")

TINY = tiny_llama(512)


class CharTokenizer:
    """One token per character (its code point), except a space and the digit after it, which are one token
    (as " 1" is in many BPE vocabularies): then an answer's first digit is merged with what precedes it."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text) and text[i + 1].isdigit():
                out.append(1000 + ord(text[i + 1]))
                i += 2
            else:
                out.append(ord(text[i]))
                i += 1
        return out


def test_answer_positions_finds_the_answer_as_the_prompt_tokenizes_it():
    tok = CharTokenizer()
    ids = tok.encode("key:1234567. the key is: 7654321. x")
    assert len(ids) == 34  # " 7" is one token (index 24)
    assert answer_tiers.answer_positions(tok, ids, "1234567") == range(4, 11)  # its own tokens
    assert answer_tiers.answer_positions(tok, ids, "7654321") == range(24, 31)  # " 7" merged, then 654321
    assert answer_tiers.answer_positions(tok, ids, "1111111") is None
    assert answer_tiers.find_span([1, 2, 3, 2, 3], [2, 3]) == 1
    assert answer_tiers.find_span([1, 2], [2, 3]) == -1


def test_layer_counts_take_the_window_with_fewest_f_layers():
    # 4 layers x 4 windows; window 0: F F Q E, window 2: F Q Q E (the bottleneck of {0, 2}), window 3 recent
    tiers = np.array([[F, E, F, LOCAL], [F, E, Q, LOCAL], [Q, E, Q, LOCAL], [E, E, E, LOCAL]], np.int8)
    assert answer_tiers.layer_counts(tiers, [0, 2]) == (1, 2, 1, 0)
    assert answer_tiers.layer_counts(tiers, [0]) == (2, 1, 1, 0)
    assert answer_tiers.layer_counts(tiers, [1]) == (0, 0, 4, 0)
    # a window still in the recent region is exact: the routed window is the bottleneck
    assert answer_tiers.layer_counts(tiers, [3, 2]) == (1, 2, 1, 0)
    assert answer_tiers.layer_counts(tiers, [3]) == (0, 0, 0, 4)


@pytest.fixture(scope="module")
def model():
    return decisive_model(TINY)


def test_answer_tiers_obey_each_methods_tiers(model):
    ids = list(np.random.default_rng(0).integers(1, TINY.vocab_size, size=300))
    spans = [range(40, 47), range(150, 160), range(2, 4)]  # the last lies among the 5 sinks: always F
    layers = TINY.num_layers
    # room for every token: nothing is evicted
    kept = answer_tiers.answer_tiers(model, ids, spans, roomy_method("qevict", TINY, 308))
    assert all(c[2] == 0 and sum(c) == layers for c in kept)
    assert kept[2] == (layers, 0, 0, 0)
    # R2 has no Q tier; at a small budget each span's window is in F or evicted
    r2 = answer_tiers.answer_tiers(model, ids, spans, make_method("r2", 0.2, recent=16))
    assert all(c[1] == 0 and sum(c) == layers for c in r2)
    assert any(c[2] > 0 for c in r2[:2])
