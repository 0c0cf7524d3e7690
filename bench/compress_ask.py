"""N questions on one context: compress once and ask them as one batch (``Pipeline.compress`` +
``CompressedContext.ask_many``, what ``qevict ask`` runs), against N separate question-agnostic generations
(``generate(..., question_starts=...)``, what each ``qevict generate --question-agnostic`` runs: a prefill and
compression of the same context per question), in one process, compilation excluded (one warm-up of each path).

The context is prose of the Python manual with one fact per question (``--write-context`` saves it, with the
questions, for the command-line comparison in docs/generate.md). Each row is the fastest of ``--repeats``
wall times; the rows alternate, so a load that changes during the run weighs on all of them alike.

Usage: python bench/compress_ask.py [--model NAME] [--context 1500] [--new-tokens 32] [--repeats 3]
       [--method qevict-gated] [--write-context DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from qevict_jax.cli import _encode_prompt
from qevict_jax.compressed import DEFAULT_QUESTION_AGNOSTIC_METHOD, ContextPrompt
from qevict_jax.eval.needle import prose_paragraphs
from qevict_jax.methods.registry import bind_tokenizer, make_method
from qevict_jax.model_args import add_model_args, kv_dtype, load
from qevict_jax.pipeline import Pipeline
from qevict_jax.runtime.generate import generate

FACTS = (
    ("The secret code of the vault is 4821.", "What is the secret code of the vault?"),
    ("The ship's captain is named Ada Lovelace.", "What is the name of the ship's captain?"),
    ("The lighthouse keeper lives in Bergen.", "Which city does the lighthouse keeper live in?"),
    ("The meeting was moved to Thursday at noon.", "When was the meeting moved to?"),
)


def context_text(count_tokens, tokens: int) -> str:
    """About ``tokens`` tokens of the manual's prose, the facts spread through it at 1/5, 2/5, 3/5 and 4/5."""
    paras, body = prose_paragraphs(), []
    while count_tokens("\n".join(body)) < tokens:
        body.append(paras[len(body)])
    for k, (fact, _) in reversed(list(enumerate(FACTS))):
        body.insert((k + 1) * len(body) // (len(FACTS) + 1), fact)
    return "\n".join(body)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--context", type=int, default=1500, help="tokens of prose (the facts come on top)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--method", default=DEFAULT_QUESTION_AGNOSTIC_METHOD)
    ap.add_argument("--budget", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--write-context", type=Path, help="write context.txt and questions.txt here")
    args = ap.parse_args()

    cfg, model, tok = load(args)
    pipe = Pipeline(model=model, tokenizer=tok, kv_dtype=kv_dtype(args))
    method = bind_tokenizer(make_method(args.method, args.budget), tok)
    text = context_text(lambda t: len(tok.encode(t)), args.context)
    questions = [q for _, q in FACTS]
    if args.write_context:
        args.write_context.mkdir(parents=True, exist_ok=True)
        (args.write_context / "context.txt").write_text(text + "\n")
        (args.write_context / "questions.txt").write_text("\n".join(questions) + "\n")
    sampler = pipe.sampler(args.new_tokens)
    prompts = [_encode_prompt(tok, text, q, chat=True) for q in questions]
    longest = max(len(ids) - start for ids, start in prompts)

    def separate() -> list[str]:
        out = []
        for ids, start in prompts:
            res = generate(model, [ids], sampler, method, question_starts=[start], kv_dtype=pipe.kv_dtype)
            out.append(tok.decode(res.tokens[0]))
        return out

    def once_batched() -> list[str]:
        ctx = pipe.compress(text, method=method, question_tokens=longest, max_new_tokens=args.new_tokens)
        return [a.text for a in ctx.ask_many(questions, max_new_tokens=args.new_tokens)]

    def once_one_by_one() -> list[str]:
        ctx = pipe.compress(text, method=method, question_tokens=longest, max_new_tokens=args.new_tokens)
        return [ctx.ask(q, max_new_tokens=args.new_tokens).text for q in questions]

    runs = {
        f"{len(questions)} x (compress + answer): generate --question-agnostic each": separate,
        "compress once + ask each question in turn": once_one_by_one,
        f"compress once + ask_many (one batch of {len(questions)})": once_batched,
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    answers: dict[str, list[str]] = {}
    for rep in range(args.repeats + 1):  # the first round compiles
        for name, run in runs.items():
            t0 = time.perf_counter()
            answers[name] = run()
            if rep:
                times[name].append(time.perf_counter() - t0)
    n_ctx = len(ContextPrompt.render(tok, text).context_ids)
    print(
        f"{args.model}, {method.name} β={args.budget:g}, context {n_ctx} tokens, {len(questions)} questions, "
        f"{args.new_tokens} new tokens at most, greedy; fastest of {args.repeats}, compilation excluded"
    )
    print("| path | wall time (s) | answers |")
    print("|---|---|---|")
    for name in runs:
        shown = "; ".join(repr(a.strip()[:40]) for a in answers[name])
        print(f"| {name} | {min(times[name]):.2f} | {shown} |")


if __name__ == "__main__":
    main()
