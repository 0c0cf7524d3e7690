"""LongBench and GSM8K loaders on small fixtures in the official schemas; prompts, truncation, scoring."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qevict_jax.eval import gsm8k, longbench
from qevict_jax.eval.testing import ByteTokenizer

FIXTURES = Path(__file__).parent / "fixtures"
LB = FIXTURES / "longbench"
TOK = ByteTokenizer()


def test_longbench_fixture_schema_and_loading():
    recs = longbench.load_task(LB, "hotpotqa")
    assert len(recs) == 2
    r = recs[0]
    raw = json.loads((LB / "hotpotqa.jsonl").read_text().splitlines()[0])
    assert (r.input, r.context, list(r.answers), r.length, r.id) == (
        raw["input"],
        raw["context"],
        raw["answers"],
        raw["length"],
        raw["_id"],
    )
    assert r.all_classes == ()  # null in the file
    assert longbench.load_task(LB, "trec")[0].all_classes[:2] == ("Abbreviation", "Expression abbreviated")
    assert len(longbench.load_task(LB, "hotpotqa", limit=1)) == 1


def test_longbench_missing_file_and_unknown_task():
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        longbench.load_task(LB, "qasper")
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.load_task(LB, "lcc")


def test_longbench_prompts_are_the_official_templates():
    r = longbench.load_task(LB, "hotpotqa")[0]
    prompt = longbench.build_prompt(r)
    assert prompt.startswith("Answer the question based on the given passages. Only give me the answer")
    assert f"The following are given passages.\n{r.context}\n\n" in prompt
    assert prompt.endswith(f"Question: {r.input}\nAnswer:")
    t = longbench.load_task(LB, "trec")[0]
    assert longbench.build_prompt(t) == (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        f"{t.context}\n{t.input}"
    )
    assert set(longbench.PROMPTS) == set(longbench.TASKS) == set(longbench.MAX_NEW_TOKENS)
    assert longbench.MAX_NEW_TOKENS["gov_report"] == 512 and longbench.MAX_NEW_TOKENS["hotpotqa"] == 32
    assert not longbench.uses_chat_template("samsum") and longbench.uses_chat_template("qasper")


def test_truncate_middle_keeps_both_ends():
    enc = lambda s: TOK.encode(s, add_bos=False)
    text = "HEAD-" + "x" * 100 + "-TAIL"
    out = longbench.truncate_middle(text, 20, enc, TOK.decode)
    assert out == text[:10] + text[-10:]
    assert longbench.truncate_middle("short", 20, enc, TOK.decode) == "short"


def test_longbench_scoring_per_metric():
    hp = longbench.load_task(LB, "hotpotqa")[0]
    assert longbench.score("hotpotqa", "Dijon.", hp.answers) == 1.0
    trec = longbench.load_task(LB, "trec")[0]
    assert longbench.score("trec", "City\nQuestion: next", trec.answers, trec.all_classes) == 1.0
    sam = longbench.load_task(LB, "samsum")[0]
    # first line only: 4 tokens, all in the 12-token reference in order: P = 1, R = 1/3 -> F = 1/2
    assert longbench.score("samsum", "Tom lost his keys\nmore text", sam.answers) == pytest.approx(0.5)
    gov = longbench.load_task(LB, "gov_report")[0]
    assert longbench.score("gov_report", gov.answers[0], gov.answers) == 1.0


def test_gsm8k_fixture_loading_and_prompt():
    probs = gsm8k.load(FIXTURES / "gsm8k" / "test.jsonl")
    assert [p.answer for p in probs] == ["72", "10", "2000"]
    assert probs[0].question.startswith("Natalia sold clips")
    assert len(gsm8k.load(FIXTURES / "gsm8k" / "test.jsonl", limit=2)) == 2
    prompt = gsm8k.few_shot_prompt(probs[0].question)
    assert prompt.count("Q: ") == 9 and prompt.count("The answer is") == 8
    assert prompt.startswith("Q: There are 15 trees in the grove.")
    assert prompt.endswith(f"Q: {probs[0].question}\nA:")
    with pytest.raises(FileNotFoundError):
        gsm8k.load(FIXTURES / "gsm8k" / "missing.jsonl")
