"""Streaming: the tokens a sink receives as they are sampled are the tokens ``generate`` returns, streaming
changes no output, one compiled loop serves every stream, and a loop compiled without a stream has no host
callback in it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from tiny import decisive_model, tiny_llama

from models.model import Transformer
from qevict_jax.cli import build_parser, cmd_generate
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.registry import make_method
from qevict_jax.runtime.compiled import EXECUTABLES
from qevict_jax.runtime.generate import SamplerConfig, generate, generate_shared
from qevict_jax.runtime.streaming import TextStream

TINY = tiny_llama(1024)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return decisive_model(TINY)


class Recorder:
    """A sink that keeps, per row, the live tokens in the order they arrive."""

    def __init__(self, rows: int) -> None:
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self.calls = 0

    def __call__(self, tokens: np.ndarray, live: np.ndarray) -> None:
        self.calls += 1
        for i, (t, ok) in enumerate(zip(tokens.tolist(), live.tolist(), strict=True)):
            if ok:
                self.rows[i].append(t)


def _prompts(rng: np.random.Generator, lengths: list[int]) -> list[list[int]]:
    return [rng.integers(0, TINY.vocab_size, n).tolist() for n in lengths]


@pytest.mark.parametrize(
    "method", [FullKV(), make_method("qevict", 0.3, omega=2, recent=16)], ids=["full", "qevict"]
)
def test_streamed_tokens_are_the_returned_tokens(model, method):
    prompts = _prompts(np.random.default_rng(0), [300, 170, 233])
    # an EOS that some rows hit early, so rows stop at different steps and later calls carry dead rows
    plain = generate(model, prompts, SamplerConfig(max_new_tokens=24), method)
    eos = plain.tokens[1][5]
    sampler = SamplerConfig(max_new_tokens=24, eos_ids=(eos,))
    expected = generate(model, prompts, sampler, method)
    rec = Recorder(len(prompts))
    streamed = generate(model, prompts, sampler, method, on_token=rec)
    assert streamed.tokens == expected.tokens  # streaming changes nothing
    assert rec.rows == expected.tokens
    assert min(len(t) for t in expected.tokens) < max(len(t) for t in expected.tokens)  # ragged stops
    assert streamed.cache_bytes == expected.cache_bytes


def test_streaming_a_continued_turn(model):
    method = make_method("qevict", 0.3, omega=2, recent=16)
    rng = np.random.default_rng(1)
    sampler = SamplerConfig(max_new_tokens=12)
    first = generate(model, _prompts(rng, [400]), sampler, method)
    turn = _prompts(rng, [37])
    expected = generate(model, turn, sampler, past=first)
    first_again = generate(model, _prompts(np.random.default_rng(1), [400]), sampler, method)
    rec = Recorder(1)
    streamed = generate(model, turn, sampler, past=first_again, on_token=rec)
    assert rec.rows == expected.tokens == streamed.tokens


def test_one_compilation_serves_every_stream_and_off_has_no_callback(model):
    prompts = _prompts(np.random.default_rng(2), [200])
    sampler = SamplerConfig(max_new_tokens=9)
    generate(model, prompts, sampler, FullKV())
    off = EXECUTABLES.latest("_decode").as_text()
    generate(model, prompts, sampler, FullKV(), on_token=Recorder(1))
    on = EXECUTABLES.latest("_decode").as_text()
    before = EXECUTABLES.compilations["_decode"]
    recs = [Recorder(1), Recorder(1)]
    for rec in recs:
        generate(model, prompts, sampler, FullKV(), on_token=rec)
    assert EXECUTABLES.compilations["_decode"] == before  # a new sink is not a new executable
    assert recs[0].rows == recs[1].rows and recs[0].calls == 9
    host_call = re.compile(r'custom_call_target="[^"]*callback[^"]*"')  # e.g. xla_ffi_python_cpu_callback
    assert not host_call.search(off)
    assert host_call.search(on)


def test_text_stream_writes_each_character_once_complete():
    # a byte-level "tokenizer": "é" is two tokens (0xC3 0xA9) and must appear only after its second byte
    pieces: list[str] = []
    sink = TextStream(decode=lambda ids: bytes(ids).decode("utf-8", errors="replace"), write=pieces.append)
    for b in "aé!".encode():
        sink(np.array([b, 0]), np.array([True, False]))
    assert pieces == ["a", "é", "!"]
    sink(np.array([ord("x"), 0]), np.array([False, True]))  # row 0 finished: nothing more is written
    assert "".join(pieces) == sink.text == "aé!"


def test_streaming_several_methods_at_once_is_refused(model):
    with pytest.raises(ValueError, match="one method"):
        generate_shared(
            model,
            [[1, 2, 3]],
            SamplerConfig(max_new_tokens=2),
            [make_method("full"), make_method("full")],
            on_token=Recorder(1),
        )


def test_cli_stream_prints_the_answer_it_would_print_whole(capsys):
    argv = ["generate", "--prompt", "Name a colour.", "--method", "qevict", "--max-new-tokens", "10"]
    assert cmd_generate(build_parser().parse_args([*argv, "--json"])) == 0
    whole = json.loads(capsys.readouterr().out)["text"]
    assert cmd_generate(build_parser().parse_args([*argv, "--stream"])) == 0
    assert capsys.readouterr().out == whole + "\n"
    with pytest.raises(ValueError, match="choose one"):  # refused before the model loads
        cmd_generate(build_parser().parse_args([*argv, "--stream", "--json"]))
