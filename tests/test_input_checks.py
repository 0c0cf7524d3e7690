"""Bad input is named before any work (issue 51, items 3-5): every probe exits 2 (the API: ValueError) with
one line naming the option or the file, no traceback, no model loaded and no sweep.json written; a malformed
results record is named by file and line, never counted, and recomputed by a rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import qevict_jax.cli
import qevict_jax.eval.cli
from qevict_jax.cli import main
from qevict_jax.eval.cli import build_parser, run_eval
from qevict_jax.eval.testing import EOS, ByteTokenizer, tiny_model
from qevict_jax.methods.options import options_for, parse_set_options
from qevict_jax.methods.registry import make_method
from qevict_jax.pipeline import resolve_method
from qevict_jax.runtime.sampling import SamplerConfig

TOK = ByteTokenizer()
RECORD = {
    "task": "niah_single_1",
    "method": "full",
    "budget": None,
    "length": 700,
    "sample": 0,
    "score": 100.0,
}


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: every probe must be refused before it."""

    def refuse(args):
        raise AssertionError(f"the model was loaded for {args}")

    monkeypatch.setattr(qevict_jax.cli, "load", refuse)
    monkeypatch.setattr(qevict_jax.eval.cli, "load", refuse)


def _run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    return code, capsys.readouterr().err


def _write(path: Path, data: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def _sweep_with_records(tmp: Path, sweep_json: str) -> None:
    _write(tmp / "out" / "results.jsonl", json.dumps(RECORD) + "\n")
    _write(tmp / "out" / "sweep.json", sweep_json)


RULER = ["eval", "ruler", "--methods", "full,qevict", "--lengths", "1024", "--out", "{tmp}/out"]
GENERATE = ["generate", "--prompt", "hi", "--method", "qevict"]

# (id, argv ({tmp}: the test's folder), files made first, words the error must contain)
PROBES = [
    # 3. silent wrong results
    ("max-new-tokens-0", [*RULER, "--max-new-tokens", "0"], None, ["--max-new-tokens", ">= 1", "0"]),
    ("samples-0", [*RULER, "--samples", "0"], None, ["--samples", ">= 1"]),
    ("generate-max-new-tokens-0", [*GENERATE, "--max-new-tokens", "0"], None, ["--max-new-tokens", ">= 1"]),
    ("needle-samples-0", ["needle", "--samples", "0"], None, ["--samples", ">= 1"]),
    # 4. tracebacks instead of errors
    ("set-q_frac-abc", [*GENERATE, "--set", "q_frac=abc"], None, ["q_frac", "'abc'", "[0, 1]"]),
    ("set-window-abc", [*GENERATE, "--set", "window=abc"], None, ["window", "'abc'", "integer"]),
    ("set-window-1.5", [*GENERATE, "--set", "window=1.5"], None, ["window", "1.5", "integer"]),
    ("eval-set-window-1.5", [*RULER, "--set", "qevict.window=1.5"], None, ["window", "1.5", "integer"]),
    (
        "set-bool-maybe",
        [*GENERATE, "--set", "promotion=maybe"],
        None,
        ["promotion", "'maybe'", "true or false"],
    ),
    (
        "prompt-file-folder",
        ["generate", "--prompt-file", "{tmp}/prompts"],
        lambda tmp: (tmp / "prompts").mkdir(),
        ["--prompt-file", "prompts", "directory"],
    ),
    (
        "report-only-malformed",
        ["eval", "report", "{tmp}/old", "--out", "{tmp}/report"],
        lambda tmp: _write(tmp / "old" / "results.jsonl", '{}\n{"task": "t", "method": "full"}\n'),
        ["old", "no results.jsonl records"],
    ),
    # 5. messages that do not say what to fix
    (
        "lengths-vs-max-new-tokens",
        [*RULER, "--max-new-tokens", "2000"],
        None,
        ["--max-new-tokens 2000", "1024"],
    ),
    (
        "lengths-vs-task-default",
        [*RULER[:-4], "--lengths", "100", "--out", "{tmp}/out"],
        None,
        ["--lengths 100"],
    ),
    (
        "empty-sweep-json",
        RULER,
        lambda tmp: _sweep_with_records(tmp, ""),
        ["sweep.json", "cannot be read"],
    ),
    (
        "sweep-json-not-an-object",
        RULER,
        lambda tmp: _sweep_with_records(tmp, "[]"),
        ["sweep.json", "JSON object"],
    ),
    (
        "binary-prompt-file",
        ["generate", "--prompt-file", "{tmp}/prompt.bin"],
        lambda tmp: _write(tmp / "prompt.bin", b"\x00\xff\xfe\x01 not text"),
        ["--prompt-file", "prompt.bin", "UTF-8"],
    ),
    ("budgets-abc", ["eval", "ruler", "--budgets=abc", "--out", "{tmp}/out"], None, ["--budgets", "'abc'"]),
    ("needle-budgets-abc", ["needle", "--budgets=abc"], None, ["--budgets", "'abc'"]),
    ("lengths-abc", [*RULER, "--lengths", "4096,x"], None, ["--lengths", "'x'"]),
    ("depths-out-of-range", [*RULER, "--depths", "0.5,2"], None, ["--depths", "[0, 1]", "2"]),
    (
        "fidelity-max-new-tokens",
        ["eval", "fidelity", "--max-new-tokens", "8"],
        None,
        ["--max-new-tokens", "--targets"],
    ),
]


@pytest.mark.parametrize("argv, setup, words", [p[1:] for p in PROBES], ids=[p[0] for p in PROBES])
def test_every_bad_input_is_one_named_line_before_any_work(tmp_path, capsys, no_model, argv, setup, words):
    if setup:
        setup(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, err = _run([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err  # one line, the last one
    for word in words:
        assert word in errors[0], (word, errors[0])
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written: no sweep.json, no lock, no results


API_PROBES = [
    ("spec-q_frac-abc", lambda: resolve_method("qevict:0.2,q_frac=abc"), ["q_frac", "'abc'", "[0, 1]"]),
    ("spec-window-1.5", lambda: resolve_method("qevict:0.2,window=1.5"), ["window", "1.5"]),
    ("kwarg-window-1.5", lambda: make_method("qevict", 0.2, window=1.5), ["window", "1.5"]),
    ("kwarg-n_obs-text", lambda: make_method("snapkv", 0.2, n_obs="many"), ["n_obs", "'many'"]),
    ("kwarg-flag-number", lambda: make_method("qevict", 0.2, promotion=1), ["promotion", "true or false"]),
    ("budget-text", lambda: make_method("qevict", "abc"), ["budget", "'abc'", "(0, 1]"]),
    (
        "set-ranking-number",
        lambda: make_method("qevict", 0.2, **options_for("qevict", parse_set_options(["ranking=3"]))),
        ["ranking", "one of", "cumulative"],
    ),
    ("sampler-max-new-tokens-0", lambda: SamplerConfig(0), ["max_new_tokens", ">= 1"]),
]


@pytest.mark.parametrize("call, words", [p[1:] for p in API_PROBES], ids=[p[0] for p in API_PROBES])
def test_the_api_raises_value_errors_that_name_the_option(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_typed_options_take_what_their_field_declares():
    """The same values by --set text and by keyword: parsed by the field's type, not guessed."""
    m = make_method("qevict", 0.2, **options_for("qevict", parse_set_options(["q_frac=1", "q_spill=none"])))
    assert m.cache.q_frac == 1.0 and isinstance(m.cache.q_frac, float) and m.cache.q_spill is None
    assert make_method("qevict", 0.2, recent=0.25).cache.recent == 0.25  # int | float keeps the float
    assert make_method("qevict", 0.2, budget_bytes=1e6).cache.budget_bytes == 1_000_000  # a whole float
    assert make_method("qevict", 0.2, promotion="false").cache.promotion is False
    assert make_method("gates", 0.2, gates=Path("/g")).gates == "/g"


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)[1]


def _args(*argv: str):
    return build_parser().parse_args(["eval", *argv])


def _untimed(record: dict) -> dict:
    return {
        k: v for k, v in record.items() if k not in ("ttft_s", "decode_tokens_per_s", "wall_s", "compiled")
    }


def test_malformed_records_are_named_never_counted_and_recomputed(tmp_path, model, capsys):
    out = tmp_path / "sweep"
    argv = ("ruler", "--lengths", "700", "--samples", "2", "--methods", "full", "--max-new-tokens", "4",
            "--out", str(out), "--no-progress")  # fmt: skip
    run_eval(_args(*argv), model, TOK, (EOS,), log=lambda _: None)
    results = out / "results.jsonl"
    good = [json.loads(line) for line in results.read_text().splitlines()]
    no_score = {k: v for k, v in good[1].items() if k != "score"}
    lines = [b"{}", json.dumps(good[0]).encode(), b"\xff not json", json.dumps(no_score).encode()]
    results.write_bytes(b"\n".join(lines) + b"\n")
    capsys.readouterr()

    code, err = _run(["eval", "report", str(out), "--out", str(tmp_path / "report")], capsys)
    assert code == 0 and "Traceback" not in err
    for note in ("line 1 lacks task", "line 3 is not valid JSON", "line 4 lacks score"):
        assert f"{results}: {note}" in err
    table = (tmp_path / "report" / "summary.md").read_text()
    assert "| niah_single_1 | full | - | 1 |" in table  # n = 1: the record without a score is not counted

    rerun = run_eval(_args(*argv), model, TOK, (EOS,), log=lambda _: None)
    assert f"{results}: line 4 lacks score" in capsys.readouterr().err
    assert [_untimed(r) for r in rerun] == [_untimed(r) for r in good]  # sample 1 ran again, as before
    appended = json.loads(results.read_bytes().splitlines()[-1])
    assert len(results.read_bytes().splitlines()) == 5 and _untimed(appended) == _untimed(good[1])


def test_a_refused_sweep_writes_no_sweep_json_and_the_corrected_one_runs(
    tmp_path, model, capsys, monkeypatch
):
    """An infeasible budget is found after the model loads (it needs the model's shape), before sweep.json is
    written; the corrected command, with another configuration, then runs in the same folder."""
    monkeypatch.setattr(qevict_jax.eval.cli, "load", lambda args: (model.cfg, model, TOK))
    out = tmp_path / "sweep"
    argv = ["eval", "ruler", "--lengths", "700", "--samples", "1", "--out", str(out), "--no-progress"]
    code, err = _run([*argv, "--methods", "qevict", "--budgets", "0.01", "--max-new-tokens", "8"], capsys)
    assert code == 2 and "qevict (β=0.01)" in err and "Traceback" not in err
    assert not (out / "sweep.json").exists() and not (out / "results.jsonl").exists()
    code, err = _run([*argv, "--methods", "full", "--max-new-tokens", "4"], capsys)
    assert code == 0, err
    assert json.loads((out / "sweep.json").read_text())["max_new_tokens"] == 4
    assert len((out / "results.jsonl").read_text().splitlines()) == 1


def test_a_ruler_prompt_that_cannot_fit_names_the_options(tmp_path, model):
    """The answer leaves room, but not for the smallest prompt: the error names --lengths and
    --max-new-tokens (not only RULER's max_seq_length), and no sweep.json is written."""
    out = tmp_path / "sweep"
    args = _args(
        "ruler", "--lengths", "300", "--max-new-tokens", "290", "--methods", "full", "--out", str(out)
    )
    with pytest.raises(ValueError, match=r"--lengths 300 .*290 answer tokens, --max-new-tokens"):
        run_eval(args, model, TOK, (EOS,), log=lambda _: None)
    assert not (out / "sweep.json").exists()
