"""``qevict ask``: compress a context once, before any question, then answer every question from it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from qevict_jax.compressed import DEFAULT_QUESTION_AGNOSTIC_METHOD, ContextPrompt
from qevict_jax.methods.options import options_for, parse_set_options
from qevict_jax.methods.registry import make_method
from qevict_jax.model_args import (
    add_model_args,
    add_sampler_args,
    check_counts,
    kv_dtype,
    load,
    method_budget,
    read_prompt_file,
)
from qevict_jax.pipeline import Pipeline
from qevict_jax.runtime.compressed import check_room
from qevict_jax.runtime.generate import SamplerConfig


def add_ask_parser(sub) -> None:
    """The ``ask`` subcommand's options."""
    p = sub.add_parser(
        "ask",
        help="compress a context once, before any question, then answer every --question from it (one batch)",
    )
    add_model_args(p)
    p.add_argument("--context-file", type=Path, required=True, help="the context (UTF-8 text)")
    p.add_argument(
        "--question",
        action="append",
        help="a question about the context; repeat for more (answered together)",
    )
    p.add_argument(
        "--method",
        default=DEFAULT_QUESTION_AGNOSTIC_METHOD,
        help=f"KV-cache method (default {DEFAULT_QUESTION_AGNOSTIC_METHOD}, the best question-agnostic one "
        "in the records: docs/generate.md)",
    )
    p.add_argument("--budget", type=float, default=0.2, help="budget β: fraction of full-KV bytes")
    p.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    add_sampler_args(p, 64)
    p.add_argument("--json", action="store_true", help="print one JSON line")


def cmd_ask(args) -> int:
    """Compress ``--context-file`` once, sized for the longest question, then answer every ``--question`` as
    one batch; every input is checked before the context is compressed."""
    opts = options_for(args.method, parse_set_options(args.set))
    method = make_method(args.method, args.budget, **opts)
    check_counts(args, "max_new_tokens")
    SamplerConfig(args.max_new_tokens, args.temperature, args.top_p)  # --temperature, --top-p: before loading
    if not args.question:
        raise ValueError("--question: give at least one question (repeat --question for more)")
    for i, q in enumerate(args.question):
        if not q.strip():
            raise ValueError(f"--question {i + 1} is empty")
    text = read_prompt_file(args.context_file, option="--context-file")
    if not text.strip():
        raise ValueError(f"--context-file {args.context_file} is empty: give the text to compress")
    cfg, model, tok = load(args)
    pipe = Pipeline(model=model, tokenizer=tok, kv_dtype=kv_dtype(args))
    prompt = ContextPrompt.render(tok, text, chat=not args.no_chat)
    # the questions' lengths checked against the model's context before anything is compressed
    context_tokens = len(prompt.context_ids)
    longest = 0
    for i, q in enumerate(args.question):
        n = len(prompt.question_ids(q, what=f"--question {i + 1}"))
        check_room(context_tokens, n, args.max_new_tokens, cfg, what=f"--question {i + 1}")
        longest = max(longest, n)
    ctx = pipe.compress(
        text,
        method=method,
        question_tokens=longest,  # one question: sized as `generate --question-agnostic` sizes it
        max_new_tokens=args.max_new_tokens,
        chat=not args.no_chat,
        seed=args.seed,
    )
    answers = ctx.ask_many(
        args.question,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    res = answers[0].result
    if args.json:
        record = {
            "method": method.name,
            "budget": method_budget(method),
            "compressed": ctx.compressed,
            "context_tokens": ctx.context_tokens,
            "cache_bytes": ctx.cache_bytes,
            "full_kv_bytes": ctx.full_kv_bytes,
            "memory_ratio": ctx.memory_ratio,
            "compress_s": ctx.prefill_s,
            "compile_s": ctx.compile_s + res.compile_s,
            "ttft_s": res.ttft_s,
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "answers": [
                {
                    "question": a.question,
                    "text": a.text,
                    "question_tokens": a.question_tokens,
                    "new_tokens": len(a.tokens),
                    "cache_bytes": a.cache_bytes,
                    "full_kv_bytes": a.full_kv_bytes,
                    "memory_ratio": a.memory_ratio,
                }
                for a in answers
            ],
        }
        print(json.dumps(record))
        return 0
    if method.uses_budget and not ctx.compressed:
        print(
            f"note: {method.name} kept every token: the {ctx.context_tokens}-token context is too short to "
            "gain from compression",
            file=sys.stderr,
        )
    for a in answers:
        print(f"Q: {a.question}\nA: {a.text}\n")
    print(
        f"[{method.name}] context {ctx.context_tokens} tokens compressed once to {ctx.cache_bytes} bytes "
        f"(memory ratio {ctx.memory_ratio:.3f}) in {ctx.prefill_s:.2f}s; {len(answers)} answers as "
        f"one batch: TTFT {res.ttft_s:.2f}s, decode {res.decode_tokens_per_s:.1f} tok/s",
        file=sys.stderr,
    )
    return 0
