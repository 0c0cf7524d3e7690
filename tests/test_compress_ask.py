"""Compress once, ask many (``Pipeline.compress``, ``CompressedContext.ask`` / ``ask_many``, ``qevict ask``)
on the embedded SmolLM2: answers repeat, the stored cache never changes, a batch answers as its rows alone,
an answer is the one ``qevict generate --question-agnostic`` gives, and bad input is refused before any
compute."""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import pytest

import qevict_jax
from qevict_jax.cli import _encode_prompt, main
from qevict_jax.core.kv import full_kv_bytes
from qevict_jax.eval.needle import prose_paragraphs
from qevict_jax.runtime.compiled import EXECUTABLES
from qevict_jax.runtime.compressed import rows_of
from qevict_jax.runtime.generate import generate

# recent=32: a 365-token context compresses at β 0.2 (the default recent region of 128 needs ~1K tokens)
METHOD = "qevict-gated:0.2,recent=32"
NEW = 8
Q1 = "What is the secret code of the vault?"
Q2 = "What is the name of the ship captain?"  # as many tokens as Q1 (checked below)
Q3 = "Which city does the old lighthouse keeper live in?"


def _context(tok, tokens: int = 300) -> str:
    """Prose of the Python manual (~``tokens`` tokens) with three facts the questions ask about."""
    paras, text = prose_paragraphs(), ""
    for p in paras:
        if len(tok.encode(text)) >= tokens:
            break
        text += p + "\n"
    facts = (
        "The secret code of the vault is 4821. The ship's captain is named Ada. "
        "The lighthouse keeper lives in Oslo."
    )
    half = len(text) // 2
    return text[:half] + facts + "\n" + text[half:]


@pytest.fixture(scope="module")
def pipe(smollm2_dir):
    return qevict_jax.load(smollm2_dir)


@pytest.fixture(scope="module")
def context(pipe) -> str:
    return _context(pipe.tokenizer)


@pytest.fixture(scope="module")
def doc(pipe, context):
    return pipe.compress(context, method=METHOD, question_tokens=16, max_new_tokens=NEW)


def _leaves(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def test_the_compressed_context_reports_its_own_measured_bytes(pipe, doc):
    assert doc.compressed and doc.method.name == doc.requested_method.name == "qevict-gated"
    assert doc.context_tokens == len(doc.prompt.context_ids) > 300
    nbytes = sum(x.nbytes for x in jax.tree.leaves(doc.cache))
    assert doc.cache_bytes == nbytes
    assert doc.full_kv_bytes == full_kv_bytes(pipe.model.cfg, doc.context_tokens, pipe.kv_dtype)
    assert doc.memory_ratio == nbytes / doc.full_kv_bytes and 0.1 < doc.memory_ratio < 0.3
    with pytest.raises(AttributeError):  # frozen
        doc.cache = None


def test_ask_repeats_and_never_changes_the_compressed_cache(doc):
    before = _leaves(doc.cache)
    answers = []
    for q in (Q1, Q2, Q1):
        answers.append(doc.ask(q, max_new_tokens=NEW))
        assert not any(x.is_deleted() for x in jax.tree.leaves(doc.cache))  # never donated
        after = _leaves(doc.cache)
        assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert answers[0].tokens == answers[2].tokens and answers[0].text == answers[2].text
    assert len(answers[0].tokens) > 0 and answers[0].question == Q1
    # each answer's bytes: its cache over the uncompressed cache of context + question + answer
    a = answers[1]
    final = doc.context_tokens + a.question_tokens + len(a.tokens) - 1
    assert a.full_kv_bytes == full_kv_bytes(doc.model.cfg, final, doc.kv_dtype)
    assert a.cache_bytes == a.result.cache_bytes


def test_each_call_works_on_new_buffers(doc):
    """The jitted append and decode donate their cache: every call gets copies, never the stored buffers."""
    for rows in (1, 2):
        copy = rows_of(doc.cache, rows)
        for old, new in zip(jax.tree.leaves(doc.cache), jax.tree.leaves(copy), strict=True):
            assert new.shape == (old.shape[0], rows, *old.shape[2:])
            assert new.unsafe_buffer_pointer() != old.unsafe_buffer_pointer()
            assert all(np.array_equal(np.asarray(new[:, r]), np.asarray(old[:, 0])) for r in range(rows))


def test_a_batch_answers_as_its_questions_alone(doc):
    """Rows of one batch are copies of one cache. With equal question lengths they meet the same routing
    events as alone, so greedy tokens are equal; with different lengths the events follow row 0's count, so
    only row 0 is guaranteed to be its answer alone."""
    ids = doc.question_ids([Q1, Q2, Q3], NEW)
    assert len(ids[0]) == len(ids[1]) != len(ids[2])
    alone = [doc.ask(q, max_new_tokens=NEW).tokens for q in (Q1, Q2, Q3)]
    batch = doc.ask_many([Q1, Q2], max_new_tokens=NEW)
    assert [a.tokens for a in batch] == alone[:2] and [a.row for a in batch] == [0, 1]
    assert [a.tokens for a in doc.ask([Q3, Q1], max_new_tokens=NEW)][0] == alone[2]  # ask of a list: a batch


def test_an_answer_is_the_question_agnostic_generate_answer(pipe, context):
    """``generate(..., question_starts)``, what ``qevict generate --question-agnostic`` runs, on the prompt
    ``qevict generate`` builds: the same tokens when the cache is sized for the question's length."""
    tok = pipe.tokenizer
    ids, start = _encode_prompt(tok, context, Q1, chat=True)
    method = qevict_jax.make_method("qevict-gated", 0.2, recent=32)
    ref = generate(
        pipe.model, [ids], pipe.sampler(NEW), method, question_starts=[start], kv_dtype=pipe.kv_dtype
    )
    doc = pipe.compress(context, method=method, question_tokens=len(ids) - start, max_new_tokens=NEW)
    assert list(doc.prompt.context_ids) == ids[:start] and doc.prompt.question_ids(Q1) == ids[start:]
    reply = doc.ask(Q1, max_new_tokens=NEW)
    assert ref.compressed and reply.tokens == tuple(ref.tokens[0])


@pytest.fixture
def no_compute(monkeypatch):
    """Every jitted call goes through ``EXECUTABLES.run``: a bad input must be refused before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a jitted computation ran before the input was checked")

    monkeypatch.setattr(EXECUTABLES, "run", refuse)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda pipe, doc: pipe.compress(""), "context is empty"),
        (lambda pipe, doc: pipe.compress(" \n\t"), "context is empty"),
        (
            lambda pipe, doc: pipe.compress("Some text.", question_tokens=9000),
            "question_tokens: .* 8192 tokens",
        ),
        (lambda pipe, doc: pipe.compress("Some text.", max_new_tokens=0), "max_new_tokens must be >= 1"),
        (lambda pipe, doc: doc.ask([]), "no question given"),
        (lambda pipe, doc: doc.ask(""), "question is empty"),
        (lambda pipe, doc: doc.ask_many([Q1, "  "]), "question 2 is empty"),
        (lambda pipe, doc: doc.ask_many(Q1), "must be a list of strings"),
        (
            lambda pipe, doc: doc.ask(Q1, max_new_tokens=9000),
            r"question: the \d+-token context .* 8192 tokens",
        ),
        (lambda pipe, doc: doc.ask([Q1, Q2 * 1000]), r"question 2: the \d+-token context .* 8192 tokens"),
        (lambda pipe, doc: doc.ask(Q1, max_new_tokens=0), "max_new_tokens"),
        (lambda pipe, doc: doc.ask([Q1, Q2], stream=print), "stream follows one answer"),
    ],
)
def test_bad_input_is_refused_before_any_compute(pipe, doc, no_compute, call, match):
    with pytest.raises(ValueError, match=match):
        call(pipe, doc)


# ------------------------------------------------------------------------------------------------ qevict ask


def _ask(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ask", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_qevict_ask_answers_each_question_as_generate_question_agnostic(
    pipe, context, smollm2_dir, tmp_path, capsys
):
    """One compression, two questions of one length: each answer is ``generate --question-agnostic``'s."""
    f = tmp_path / "context.txt"
    f.write_text(context)
    argv = ["--model", str(smollm2_dir), "--context-file", str(f), "--question", Q1, "--question", Q2]
    code, out, err = _ask(capsys, *argv, "--set", "recent=32", "--max-new-tokens", str(NEW), "--json")
    assert code == 0, err
    record = json.loads(out)
    method = qevict_jax.make_method("qevict-gated", 0.2, recent=32)  # the default method of `qevict ask`
    for q, got in zip((Q1, Q2), record["answers"], strict=True):
        ids, start = _encode_prompt(pipe.tokenizer, context, q, chat=True)
        ref = generate(pipe.model, [ids], pipe.sampler(NEW), method, question_starts=[start])
        assert got["question"] == q and got["text"] == pipe.tokenizer.decode(ref.tokens[0])
        assert got["question_tokens"] == len(ids) - start and got["new_tokens"] == len(ref.tokens[0])
    assert record["method"] == "qevict-gated" and record["compressed"] is True
    assert record["memory_ratio"] == record["cache_bytes"] / record["full_kv_bytes"] < 0.3
    code, out, err = _ask(capsys, *argv, "--set", "recent=32", "--max-new-tokens", str(NEW))
    assert code == 0 and out.count("Q: ") == 2 and record["answers"][1]["text"] in out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--context-file", "{ctx}"], "--question: give at least one question"),
        (["--context-file", "{ctx}", "--question", ""], "--question 1 is empty"),
        (["--context-file", "{ctx}", "--question", "Who?", "--question", " "], "--question 2 is empty"),
        (["--context-file", "{empty}", "--question", "Who?"], "--context-file .*empty.txt is empty"),
        (["--context-file", "{missing}", "--question", "Who?"], "--context-file .*missing.txt: No such file"),
        (
            ["--context-file", "{ctx}", "--question", "Who?", "--max-new-tokens", "0"],
            "--max-new-tokens must be",
        ),
        (["--context-file", "{ctx}", "--question", "Who?", "--method", "nope"], "nope"),
        (
            ["--context-file", "{ctx}", "--question", "Who?", "--max-new-tokens", "9000"],
            "--question 1: the .*8192",
        ),
    ],
)
def test_qevict_ask_refuses_bad_input_in_one_line(smollm2_dir, tmp_path, capsys, no_compute, argv, match):
    paths = {
        "ctx": tmp_path / "ctx.txt",
        "empty": tmp_path / "empty.txt",
        "missing": tmp_path / "missing.txt",
    }
    paths["ctx"].write_text("The vault code is 4821.")
    paths["empty"].write_text("  \n")
    argv = [a.format(**paths) for a in argv]
    code, out, err = _ask(capsys, "--model", str(smollm2_dir), *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("qevict: error: "), err
    assert re.search(match, err), err
