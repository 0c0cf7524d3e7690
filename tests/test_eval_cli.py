"""``qevict eval ...`` end to end on a tiny random model and a byte tokenizer (plumbing, not quality)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest

from qevict_jax.eval.cli import DEFAULT_METHODS, add_eval_parser, build_parser, run_eval
from qevict_jax.eval.testing import EOS, ByteTokenizer, tiny_model
from qevict_jax.runtime.generate import GenerationResult, generate

FIXTURES = Path(__file__).parent / "fixtures"
TOK = ByteTokenizer()
TIMING = {"ttft_s", "decode_tokens_per_s", "wall_s", "compiled"}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)[1]


def args_for(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["eval", *argv])


def test_parser_defaults_and_wiring():
    parser = argparse.ArgumentParser(prog="qevict")
    add_eval_parser(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["eval", "ruler", "--lengths", "2048,4096", "--out", "runs/x"])
    assert (a.command, a.eval_task, a.methods, a.budgets, a.lengths) == (
        "eval",
        "ruler",
        DEFAULT_METHODS,
        "0.2",
        "2048,4096",
    )
    assert a.tasks == "niah_single_1" and a.model and a.max_new_tokens is None
    lb = parser.parse_args(["eval", "longbench", "--data-dir", "d"])
    assert lb.tasks == "all" and lb.data_dir == Path("d")
    assert parser.parse_args(["eval", "gsm8k", "--data-file", "f"]).samples == 50
    assert parser.parse_args(["eval", "fidelity"]).targets == 64


def needle_echo(model, prompts, sampler, method=None, seed=0, budget_rounding="bucket", **_):
    """A fake ``generate``: answers with every magic number of the prompt; bytes scale with the budget."""
    text = TOK.decode(prompts[0])
    answer = " " + ", ".join(re.findall(r"is: (\d+)\.", text))
    budget = getattr(getattr(method, "cache", None), "budget", 1.0)
    return GenerationResult(
        tokens=[TOK.encode(answer, add_bos=False) + [EOS]],
        prompt_lengths=[len(prompts[0])],
        ttft_s=0.01,
        decode_s=0.01,
        cache=None,
        cache_bytes=int(1000 * budget),
        full_kv_bytes=1000,
    )


def test_ruler_sweep_with_injected_generate(tmp_path, model, capsys):
    notes = []
    out = tmp_path / "ruler"
    a = args_for(
        "ruler", "--tasks", "niah_single_1,niah_multikey_2", "--lengths", "700,800", "--samples", "2",
        "--methods", "full,qevict,no-such-method", "--budgets", "0.1,0.2", "--out", str(out), "--no-progress",
    )  # fmt: skip
    records = run_eval(a, model, TOK, (EOS,), generate_fn=needle_echo, log=notes.append)
    assert any("no-such-method" in n and "skipped" in n for n in notes)
    assert len(records) == 2 * 2 * 2 * 3  # tasks x lengths x samples x (full, qevict 0.1, qevict 0.2)
    single = [r for r in records if r["task"] == "niah_single_1"]
    assert all(r["score"] == 100.0 for r in single)  # the echo finds the only needle
    assert {(r["method"], r["budget"]) for r in records} == {("full", None), ("qevict", 0.1), ("qevict", 0.2)}
    assert {r["memory_ratio"] for r in records if r["method"] == "qevict"} == {0.1, 0.2}
    for r in records:
        assert r["prompt_tokens"] <= r["length"] - 128 + 1  # RULER: prompt + niah's 128 new tokens fit
    table = capsys.readouterr().out
    assert "| niah_single_1 | qevict | 0.1 | 4 | 100.0 | 0.100 |" in table
    assert "| average |" in table
    for name in ("results.jsonl", "summary.md", "summary.csv", "summary.png", "sweep.json"):
        assert (out / name).is_file()


def _without_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def test_ruler_kill_and_resume_with_the_tiny_model(tmp_path, model):
    """A run that dies after 3 samples, resumed, equals an uninterrupted run (timings aside)."""
    argv = ("ruler", "--lengths", "700", "--samples", "5", "--methods", "full", "--max-new-tokens", "4")
    calls = []

    def dies_after_three(*a, **k):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return generate(*a, **k)

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        run_eval(
            args_for(*argv, "--out", str(out), "--no-progress"),
            model,
            TOK,
            (EOS,),
            generate_fn=dies_after_three,
        )
    assert len((out / "results.jsonl").read_text().splitlines()) == 3
    resumed = run_eval(args_for(*argv, "--out", str(out), "--no-progress"), model, TOK, (EOS,))
    fresh = run_eval(args_for(*argv, "--out", str(tmp_path / "fresh"), "--no-progress"), model, TOK, (EOS,))
    assert _without_timing(resumed) == _without_timing(fresh)
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["sample"] for r in lines] == [0, 1, 2, 3, 4]  # each sample once, in order
    with pytest.raises(ValueError, match="another configuration"):
        run_eval(args_for(*argv, "--seed", "1", "--out", str(out), "--no-progress"), model, TOK, (EOS,))


def test_longbench_sweep(tmp_path, model):
    a = args_for(
        "longbench", "--data-dir", str(FIXTURES / "longbench"), "--tasks", "hotpotqa,trec,samsum,gov_report",
        "--lengths", "256", "--samples", "5", "--methods", "full", "--max-new-tokens", "4",
        "--out", str(tmp_path), "--no-progress",
    )  # fmt: skip
    records = run_eval(a, model, TOK, (EOS,))
    assert [(r["task"], r["sample"]) for r in records] == [
        ("hotpotqa", 0), ("hotpotqa", 1), ("trec", 0), ("trec", 1), ("samsum", 0), ("gov_report", 0),
    ]  # fmt: skip
    gov = records[-1]
    assert gov["references"] == ["The agency found that contracts lacked oversight."]
    # truncated to 256 tokens in the middle, then wrapped in the chat template
    assert 256 < gov["prompt_tokens"] <= 256 + len(TOK.encode(TOK.apply_chat_template([{"content": ""}])))
    assert all(0.0 <= r["score"] <= 100.0 for r in records)


def test_gsm8k_sweep_with_injected_answers(tmp_path, model):
    answers = iter([" 48 / 2 = 24. 48 + 24 = 72. The answer is 72.\n\nQ: more", " I think 11."])

    def fake(model, prompts, sampler, method=None, seed=0, budget_rounding="bucket", **_):
        assert TOK.decode(prompts[0]).endswith("\nA:")
        r = needle_echo(model, prompts, sampler, method)
        return dataclasses.replace(r, tokens=[TOK.encode(next(answers), add_bos=False)])

    a = args_for("gsm8k", "--data-file", str(FIXTURES / "gsm8k" / "test.jsonl"), "--samples", "2",
                 "--methods", "full", "--out", str(tmp_path), "--no-progress")  # fmt: skip
    records = run_eval(a, model, TOK, (EOS,), generate_fn=fake)
    assert [r["score"] for r in records] == [100.0, 0.0]
    assert [r["extracted"] for r in records] == ["72", "11"]
    assert [r["length"] for r in records] == [0, 0]


def test_fidelity_sweep_full_is_exact(tmp_path, model):
    a = args_for("fidelity", "--lengths", "200", "--samples", "2", "--targets", "6", "--methods", "full",
                 "--out", str(tmp_path), "--no-progress")  # fmt: skip
    records = run_eval(a, model, TOK, (EOS,))
    assert len(records) == 2
    for r in records:
        assert r["kl"] == 0.0 and r["top1"] == 1.0 and r["score"] == 100.0 and r["ppl_change"] == 0.0
        assert r["prompt_tokens"] == 200 and r["targets"] == 6 and r["ppl"] > 1
    assert "top-1 agreement (%)" in (tmp_path / "summary.md").read_text()


def test_infeasible_budget_is_refused_before_any_sample(tmp_path, model):
    """A budget that cannot hold sink + recent + one window fails up front, naming the minimum β, and
    nothing has been computed or written."""
    out = tmp_path / "infeasible"
    a = args_for(
        "ruler", "--lengths", "700", "--samples", "2", "--methods", "full,qevict", "--budgets", "0.01",
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"qevict \(β=0.01\).*β >= "):
        run_eval(a, model, TOK, (EOS,), log=lambda m: None)
    assert not (out / "results.jsonl").exists() or (out / "results.jsonl").read_text() == ""
