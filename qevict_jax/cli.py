"""The ``qevict`` command line: convert checkpoints, generate, ask many questions of one compressed context,
run needle checks, evaluate, diagnose."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from models.convert import convert
from models.tokenizer import token_index
from qevict_jax.cli_ask import add_ask_parser, cmd_ask
from qevict_jax.cli_train import add_train_gates_parser, cmd_train_gates
from qevict_jax.compressed import QUESTION_SEPARATOR
from qevict_jax.core.sharding import make_mesh
from qevict_jax.diagnostics.run import add_diagnose_parser, cmd_diagnose
from qevict_jax.eval.cli import add_eval_parser, cmd_eval
from qevict_jax.eval.needle import needle_correct, needle_prompt_text, needle_sample
from qevict_jax.eval.tasks import floats, names
from qevict_jax.methods.options import options_for, parse_set_options
from qevict_jax.methods.registry import (
    available_methods,
    bind_tokenizer,
    cache_stats,
    make_method,
)
from qevict_jax.model_args import (
    add_model_args,
    add_sampler_args,
    check_counts,
    eos_ids,
    kv_dtype,
    load,
    method_budget,
    read_prompt_file,
)
from qevict_jax.runtime.distributed import env_processes, initialize_from_env, is_main, launch, run_main
from qevict_jax.runtime.generate import SamplerConfig, generate
from qevict_jax.runtime.streaming import TextStream


def _add_method_args(p: argparse.ArgumentParser, multi: bool = False) -> None:
    if multi:
        p.add_argument("--methods", default="full", help="comma-separated method names")
        p.add_argument(
            "--budgets", default="0.2", help="comma-separated budgets β (fraction of full-KV bytes)"
        )
    else:
        p.add_argument("--method", default="full", help="KV-cache method (see `qevict methods`)")
        p.add_argument("--budget", type=float, default=0.2, help="budget β: fraction of full-KV bytes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qevict", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "convert", help="convert a HF safetensors folder or a GGUF file to an orbax checkpoint"
    )
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")

    p = sub.add_parser("generate", help="generate from a prompt file")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", type=Path)
    src.add_argument("--prompt", help="prompt text")
    p.add_argument(
        "--question",
        help="question appended after the prompt (kept uncompressed by question-agnostic methods)",
    )
    p.add_argument(
        "--question-agnostic", action="store_true", help="compress the context before the question"
    )
    p.add_argument(
        "--pallas",
        action="store_true",
        help="force the Pallas decode-attention kernels (interpret mode off GPU)",
    )
    p.add_argument("--kernel", action="store_true", help=argparse.SUPPRESS)  # renamed --pallas: an error
    p.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    _add_method_args(p)
    add_sampler_args(p, 64)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument(
        "--stream",
        action="store_true",
        help="print the answer as it is produced (a host callback per decoded token; off: none compiled in)",
    )
    p.add_argument(
        "--mesh",
        help="DATAxMODEL device mesh over every process's devices (default: 1 x all devices when there "
        "are several processes, else no mesh); the batch (1 prompt) divides by DATA, the KV heads by MODEL",
    )
    p.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run as this many local processes of one jax.distributed job (a local try of multi-host; on "
        "separate hosts set QEVICT_COORDINATOR, QEVICT_NUM_PROCESSES, QEVICT_PROCESS_ID instead)",
    )
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="with --processes: fake CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count)",
    )

    add_ask_parser(sub)

    p = sub.add_parser(
        "needle", help="seeded needle-in-a-haystack prompts over pydoc prose; accuracy per method"
    )
    add_model_args(p)
    _add_method_args(p, multi=True)
    p.add_argument("--context-tokens", type=int, default=4000)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print one JSON line per sample")

    add_eval_parser(sub)
    add_diagnose_parser(sub)
    sub.add_parser("methods", help="list the available KV-cache methods")

    add_train_gates_parser(sub)
    return parser


def _encode_prompt(tok, context: str, question: str | None, chat: bool) -> tuple[list[int], int]:
    """Token ids of the prompt (context, then the question if any, in the chat template when ``chat``) and
    the index of the first question token (the prompt length when there is no question)."""
    user = context if question is None else f"{context}{QUESTION_SEPARATOR}{question}"
    if chat and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)
    else:
        text = user
    ids = tok.encode(text)
    if question is None:
        return ids, len(ids)
    return ids, token_index(tok, text, text.index(user) + len(context))


def _generate_mesh(spec: str | None):
    """The mesh of ``--mesh DATAxMODEL``; by default 1 x every device of a multi-process job, else None."""
    if spec is None:
        return make_mesh(1, jax.device_count()) if jax.process_count() > 1 else None
    try:
        data, model = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh takes DATAxMODEL, e.g. 1x2, got {spec!r}") from None
    return make_mesh(data, model)


def cmd_generate(args) -> int:
    initialize_from_env()  # a process of a multi-process job (environment variables), before JAX starts
    opts = options_for(args.method, parse_set_options(args.set))
    if args.pallas:
        opts["pallas"] = True
    method = make_method(args.method, args.budget, **opts)
    if args.kernel:
        raise ValueError("--kernel was renamed --pallas (force the Pallas decode-attention kernels)")
    if args.stream and jax.process_count() > 1:
        raise ValueError("--stream prints from one process; a multi-process job prints its answer at the end")
    if args.stream and args.json:
        raise ValueError("--stream prints text as it comes and --json one line at the end: choose one")
    if args.question_agnostic and not args.question:
        raise ValueError("--question-agnostic needs --question (the part of the prompt kept uncompressed)")
    check_counts(args, "max_new_tokens")
    SamplerConfig(args.max_new_tokens, args.temperature, args.top_p)  # --temperature, --top-p: before loading
    text = args.prompt if args.prompt is not None else read_prompt_file(args.prompt_file)
    cfg, model, tok = load(args)
    method = bind_tokenizer(method, tok)
    ids, question_start = _encode_prompt(tok, text, args.question, chat=not args.no_chat)
    sampler = SamplerConfig(args.max_new_tokens, args.temperature, args.top_p, eos_ids(cfg, tok))
    starts = [question_start] if args.question_agnostic else None
    stream = TextStream(decode=tok.decode, write=_write_now) if args.stream else None
    res = generate(
        model,
        [ids],
        sampler,
        method,
        seed=args.seed,
        question_starts=starts,
        kv_dtype=kv_dtype(args),
        mesh=_generate_mesh(args.mesh),
        on_token=stream,
    )
    routing = cache_stats(res.cache)  # every process takes part (a cache across processes is gathered)
    if not is_main():  # only process 0 prints
        return 0
    out = tok.decode(res.tokens[0])
    record = {
        "text": out,
        "method": method.name,
        "budget": method_budget(method),
        "compressed": res.compressed,
        "budget_used": res.method.budget if res.compressed else None,  # the least β where `budget` cannot
        "note": res.note,
        "memory_ratio": res.memory_ratio,
        "cache_bytes": res.cache_bytes,
        "full_kv_bytes": res.full_kv_bytes,
        "prompt_tokens": len(ids),
        "new_tokens": res.new_tokens,
        "ttft_s": res.ttft_s,
        "compile_s": res.compile_s,
        "decode_tokens_per_s": res.decode_tokens_per_s,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        **routing,
    }
    if args.json:
        print(json.dumps(record))
    else:
        if args.stream:
            print()  # ends the streamed text's line
        if method.uses_budget and not res.compressed:
            print(
                f"note: {method.name} kept every token: its smallest cache (sinks, recent region, one unit of "
                f"history) is no smaller than the whole {len(ids)}-token prompt + {args.max_new_tokens} new "
                "tokens uncompressed, so nothing was compressed",
                file=sys.stderr,
            )
        if res.note is not None:
            print(f"note: {res.note}", file=sys.stderr)
        if not args.stream:
            print(out)
        print(
            f"\n[{method.name}] prompt {len(ids)} tokens, {res.new_tokens} new; TTFT {res.ttft_s:.2f}s; "
            f"decode {res.decode_tokens_per_s:.1f} tok/s; memory ratio {res.memory_ratio:.3f} "
            f"({res.cache_bytes} / {res.full_kv_bytes} bytes)",
            file=sys.stderr,
        )
    return 0


def _write_now(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_needle(args) -> int:

    methods = names(args.methods)
    budgets = floats(args.budgets, "--budgets")
    check_counts(args, "samples", "context_tokens", "max_new_tokens")
    scoped = parse_set_options(args.set)
    runs = []
    for name in methods:
        for b in [1.0] if name == "full" else budgets:
            runs.append(make_method(name, b, **options_for(name, scoped)))
    cfg, model, tok = load(args)
    runs = [bind_tokenizer(m, tok) for m in runs]
    sampler = SamplerConfig(args.max_new_tokens, eos_ids=eos_ids(cfg, tok))

    def count(text: str) -> int:
        return len(tok.encode(text, add_bos=False))

    prompts = []
    for i in range(args.samples):
        s = needle_sample(args.seed + i, args.context_tokens, count)
        text = tok.apply_chat_template(
            [{"role": "user", "content": needle_prompt_text(s)}], add_generation_prompt=True
        )
        prompts.append((s, tok.encode(text + s.answer_prefix)))
    rows = []
    for method in runs:
        correct, ratios, ttft, tps = 0, [], [], []
        for s, ids in prompts:
            res = generate(model, [ids], sampler, method, kv_dtype=kv_dtype(args))
            answer = tok.decode(res.tokens[0])
            ok = needle_correct(s, answer)
            correct += ok
            ratios.append(res.memory_ratio)
            ttft.append(res.ttft_s)
            tps.append(res.decode_tokens_per_s)
            if args.json:
                print(
                    json.dumps(
                        {
                            "method": method.name,
                            "budget": method_budget(method),
                            "answer": answer,
                            "expected": s.answer,
                            "correct": ok,
                            "prompt_tokens": len(ids),
                            "memory_ratio": res.memory_ratio,
                            "ttft_s": res.ttft_s,
                        }
                    ),
                    flush=True,
                )
            else:
                print(
                    f"  {method.name:>14} β={method_budget(method):<5} depth={s.depth:.2f} "
                    f"prompt={len(ids)} ok={ok} answer={answer.strip()!r} (expected {s.answer})",
                    file=sys.stderr,
                )
        rows.append(
            (
                method.name,
                method_budget(method),
                correct / len(prompts),
                sum(ratios) / len(ratios),
                sum(ttft) / len(ttft),
                sum(tps) / len(tps),
                len(prompts[0][1]),
            )
        )
    print(
        "| method | budget β | needle accuracy | measured memory ratio | TTFT (s) | decode tok/s | prompt tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, b, acc, ratio, t, s, n in rows:
        print(f"| {name} | {b:g} | {acc:.2f} | {ratio:.3f} | {t:.2f} | {s:.1f} | {n} |")
    return 0


def cmd_convert(args) -> int:

    out = convert(args.src, args.out, dtype=args.dtype)
    print(f"converted {args.src} -> {out}")
    return 0


def cmd_methods(args) -> int:
    print("\n".join(available_methods()))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "processes", 1) > 1 and env_processes() is None:
        # the launcher: the same command line in each local process (they see the QEVICT_* variables)
        cmd = [sys.executable, "-m", "qevict_jax.cli", *argv]
        return launch(cmd, processes=args.processes, devices_per_process=args.devices_per_process)
    handler = {
        "convert": cmd_convert,
        "generate": cmd_generate,
        "ask": cmd_ask,
        "needle": cmd_needle,
        "methods": cmd_methods,
        "eval": cmd_eval,
        "diagnose": cmd_diagnose,
        "train-gates": cmd_train_gates,
    }
    if env_processes() is not None:  # one process of a job: a failure ends it at once, named (run_main)
        run_main(lambda: handler[args.command](args))
    try:
        return handler[args.command](args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        print(f"qevict: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
