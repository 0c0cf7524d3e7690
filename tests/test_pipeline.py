"""The one-import façade: method specs, ``load(...).generate`` and a conversation whose turns are appended to
one cache, on the embedded SmolLM2 model."""

from __future__ import annotations

import json

import numpy as np
import pytest

import qevict_jax
from qevict_jax.cli import build_parser, cmd_generate
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.options import parse_method_spec
from qevict_jax.pipeline import resolve_method
from qevict_jax.runtime.generate import generate
from qevict_jax.runtime.prefill import fit_method


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
def pipe(smollm2_dir):
    return qevict_jax.load(smollm2_dir)


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


HARBOUR = (
    "Here are my notes on the town I grew up in. The harbour town of Vellmoor sits at the mouth of a slow"
    " green river. Its fishermen leave before dawn in blue boats, and the market opens when they return "
    "with herring, mackerel and the odd crab. Above the quay stands a lighthouse painted in red and white"
    " rings; its keeper, an old man called Tobias Wren, has kept the lamp burning for forty-one years and"
    " writes the weather in a ledger every evening. Behind the lighthouse a steep lane climbs past the "
    "bakery, the chandlery and a chapel with a copper roof gone green with age. In summer the town fills "
    "with walkers who come for the cliff path, which runs eleven miles north to the village of Sandrel. "
    "In winter the storms close the harbour for days at a time, and the fishermen mend their nets in the "
    "long shed beside the slipway while the rain drums on the tin roof. The school has only two "
    "classrooms, and every child learns to row before they learn to swim."
)
FESTIVAL = (
    "Each autumn Vellmoor holds a lantern festival. Families carve lanterns from turnips, light them with"
    " candle stubs and carry them down the lane to the quay, where the boats are strung with coloured "
    "paper. The keeper rings the lighthouse bell at nine, everyone sets their lantern on the water, and "
    "the tide carries them out past the breakwater while the band plays the old harbour song."
)


def test_a_chat_that_starts_short_is_compressed_from_the_turn_where_the_budget_holds_it(pipe):
    """Issue 51, scaled to SmolLM2 on a 2-core CPU: a chat that opens with a 5-word turn (35 templated tokens)
    and grows. With QEvict's default recent region (128) β = 0.2 first holds the smallest cache near 800
    tokens (the issue's chat grows past 4K); here ``recent=16, window=8`` bring that down to about 200, so
    the second turn (a ~230-token passage) is where compression starts. The first turn is kept whole; the
    second compresses the conversation so far and is what ``generate`` gives on the chat template's rendering
    of that transcript; its memory ratio is β of the sequence then, and the cache keeps that size over the
    later turns, each what ``generate(..., past=...)`` gives on the template's next tokens."""
    beta, options = 0.2, {"recent": 16, "window": 8}
    chat = pipe.chat(method="qevict", budget=beta, max_new_tokens=8, **options)
    texts = ["My name is Ada.", HARBOUR, FESTIVAL, "What is my name?"]
    replies = []
    for text in texts:
        replies.append(chat.send(text))
    assert [r.compressed for r in replies] == [False, True, True, True]
    assert [r.compressed_turn for r in replies] == [None, 2, 2, 2]
    assert replies[0].memory_ratio >= 1.0 and all(r.note is None for r in replies)

    tok, sampler, method = pipe.tokenizer, pipe.sampler(8), qevict_jax.make_method("qevict", beta, **options)
    transcripts = [chat.messages[: 2 * i + 1] for i in range(len(texts))]  # up to each user turn
    rendered = [tok.encode(tok.apply_chat_template(t, add_generation_prompt=True)) for t in transcripts]
    assert replies[0].prompt_tokens == len(rendered[0]) == 35
    first = generate(pipe.model, [rendered[0]], sampler, FullKV())
    assert replies[0].result.tokens == first.tokens
    ref = generate(pipe.model, [rendered[1]], sampler, method)  # the switch: a prefill of the whole history
    assert ref.compressed and replies[1].compressed_at == len(rendered[1])
    assert replies[1].result.history[0][: len(rendered[1])] == rendered[1]
    assert replies[1].result.tokens == ref.tokens and replies[1].result.cache_bytes == ref.cache_bytes
    assert 0.15 < replies[1].memory_ratio <= beta
    for i in (2, 3):
        held = ref.history[0]
        assert rendered[i][: len(held)] == held  # the template renders the cache's tokens as the transcript
        ref = generate(pipe.model, [rendered[i][len(held) :]], sampler, past=ref)
        assert replies[i].result.tokens == ref.tokens and replies[i].compressed_at == len(rendered[1])
        assert replies[i].result.cache_bytes == replies[1].result.cache_bytes  # a constant footprint
        assert replies[i].memory_ratio < replies[i - 1].memory_ratio <= beta


def test_a_mid_length_prompt_gets_the_least_beta_and_one_note_by_cli_and_api(pipe, smollm2_dir, capsys):
    """A 583-token prompt at β = 0.2 (8 new tokens): long enough to compress, too short for β = 0.2 to hold
    QEvict's smallest cache. The CLI and the API both compress it at the least β that holds it (the one a
    refusal names, ``fit_method(..., least_beta=False)``), with the same one-line note (stderr and ``note`` in
    ``--json``; ``Reply.note`` and a UserWarning), and give the same tokens."""
    notes = "The lighthouse keeper writes the weather in his ledger every evening. " * 46
    ids = pipe.encode(notes)
    with pytest.raises(ValueError, match=r"β >= ") as err:
        fit_method(
            qevict_jax.make_method("qevict", 0.2), model_cfg=pipe.model.cfg, lengths=np.asarray([len(ids)]),
            max_new_tokens=8, budget_rounding="bucket", kv_dtype=pipe.kv_dtype, least_beta=False,
        )  # fmt: skip
    least = float(str(err.value).split("β >= ")[1].split(",")[0])
    assert 0.2 < least < 1
    with pytest.warns(UserWarning, match=rf"compressed at β={least:g}") as warned:
        reply = pipe.generate(notes, method="qevict:0.2", max_new_tokens=8)
    assert len(warned) == 1 and reply.note == str(warned[0].message) and "\n" not in reply.note
    assert reply.compressed and reply.result.method.budget == least and reply.memory_ratio <= least
    argv = ["generate", "--model", str(smollm2_dir), "--prompt", notes, "--method", "qevict"]
    argv += ["--budget", "0.2"]
    assert cmd_generate(build_parser().parse_args([*argv, "--max-new-tokens", "8", "--json"])) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["prompt_tokens"] == len(ids) and record["compressed"] is True
    assert (record["budget"], record["budget_used"], record["note"]) == (0.2, least, reply.note)
    assert record["text"] == reply.text
    assert cmd_generate(build_parser().parse_args([*argv, "--max-new-tokens", "8"])) == 0
    assert capsys.readouterr().err.count(f"note: {reply.note}\n") == 1
