"""``qevict train-gates``: train learned retention gates (TRIM-KV) with the model frozen."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from qevict_jax.model_args import add_model_args, load
from qevict_jax.training.train_gates import TrainConfig, load_text, train


def add_train_gates_parser(sub) -> None:
    """The ``train-gates`` subcommand's options."""
    p = sub.add_parser(
        "train-gates",
        help="train learned retention gates (TRIM-KV) with the model frozen; resumes from --out",
    )
    add_model_args(p)
    p.add_argument(
        "--text", default="pydoc", help="training prose: a text file, or pydoc (the Python manual)"
    )
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps (a resumed run continues)")
    p.add_argument("--memory", type=float, default=128.0, help="memory size M of the capacity term")
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder (resumed from its latest step)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this much training")


def run_train_gates(args: argparse.Namespace, model, tok) -> dict:
    """``qevict train-gates`` with a loaded model and tokenizer: tokenize ``--text``, train, print a summary."""
    ids = np.asarray(tok.encode(load_text(args.text), add_bos=False), np.int32)
    tcfg = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        memory=args.memory,
        lr=args.lr,
        warmup=args.warmup,
        clip=args.clip,
        seed=args.seed,
        save_every=args.save_every,
    )
    max_s = None if args.max_minutes is None else 60.0 * args.max_minutes
    extra = {"model": args.model, "text": args.text, "text_tokens": len(ids)}
    summary = train(model, ids, tcfg, args.out, max_seconds=max_s, extra_config=extra)
    print(json.dumps(summary))
    return summary


def cmd_train_gates(args) -> int:
    _, model, tok = load(args)
    run_train_gates(args, model, tok)
    return 0
