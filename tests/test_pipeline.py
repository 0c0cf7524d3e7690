"""The one-import façade: method specs, ``load(...).generate`` and a conversation whose turns are appended to
one cache, on the embedded SmolLM2 model."""

from __future__ import annotations

import pytest

import qevict_jax
from qevict_jax.methods.full import FullKV
from qevict_jax.pipeline import parse_method_spec, resolve_method
from qevict_jax.runtime.generate import generate


@pytest.mark.parametrize(
    "spec, want",
    [
        ("qevict", ("qevict", None, {})),
        ("qevict:0.1", ("qevict", 0.1, {})),
        ("qevict:0.2,n_obs=64,quant=rot-k4v3", ("qevict", 0.2, {"n_obs": 64, "quant": "rot-k4v3"})),
        ("snapkv , n_obs = 16", ("snapkv", None, {"n_obs": 16})),
    ],
)
def test_method_specs_parse(spec, want):
    assert parse_method_spec(spec) == want


@pytest.mark.parametrize("bad", [":0.2", "qevict:high", "qevict,n_obs", "qevict,=3"])
def test_bad_method_specs_are_clear_errors(bad):
    with pytest.raises(ValueError, match="method spec"):
        parse_method_spec(bad)


def test_a_spec_sets_the_method_its_budget_and_options():
    m = resolve_method("qevict:0.1,n_obs=64", budget=0.3, recent=32)
    assert m.budget == 0.1 and m.cache.n_obs == 64 and m.cache.recent == 32
    assert resolve_method("snapkv", budget=0.3).budget == 0.3
    assert isinstance(resolve_method("full"), FullKV)
    with pytest.raises(ValueError, match="no option"):
        resolve_method("qevict", n_obbs=3)


@pytest.fixture(scope="module")
def pipe():
    return qevict_jax.load("smollm2-135m-instruct")


def test_generate_is_the_low_level_generate(pipe):
    reply = pipe.generate("Name a colour.", method="qevict:0.2", max_new_tokens=8)
    ids = pipe.encode("Name a colour.")
    ref = generate(pipe.model, [ids], pipe.sampler(8), qevict_jax.make_method("qevict", 0.2))
    assert reply.result.tokens == ref.tokens and reply.text == pipe.tokenizer.decode(ref.tokens[0])
    assert reply.compressed is False and reply.method == "qevict" and reply.prompt_tokens == len(ids)


def test_a_streamed_reply_writes_the_text_it_returns(pipe):
    pieces: list[str] = []
    reply = pipe.generate("Name a colour.", method="qevict:0.2", max_new_tokens=12, stream=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == reply.text  # piece by piece, and nothing lost
    plain = pipe.generate("Name a colour.", method="qevict:0.2", max_new_tokens=12)
    assert plain.result.tokens == reply.result.tokens


def test_a_conversation_appends_each_turn_as_the_template_renders_the_transcript(pipe):
    """Turn 2 is appended to turn 1's cache; the tokens in the cache are exactly the chat template's
    rendering of the transcript, and the answer is what Full-KV generates from that rendering in one go."""
    chat = pipe.chat(method="full", max_new_tokens=12)
    first = chat.send("My name is Ada.")
    second = chat.send("What is my name?")
    tok = pipe.tokenizer
    held = first.result.prompt_lengths[0] + len(first.result.tokens[0])  # prompt 1 + answer 1 (incl. pending)
    assert second.result.next_positions[0] == held + second.prompt_tokens + len(second.result.tokens[0]) - 1
    transcript = chat.messages[:-1]  # up to the second question
    rendered = tok.encode(tok.apply_chat_template(transcript, add_generation_prompt=True))
    whole = generate(pipe.model, [rendered], pipe.sampler(12), FullKV())
    assert held + second.prompt_tokens == len(rendered)
    assert second.result.tokens == whole.tokens
