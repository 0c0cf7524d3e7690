"""The model on the command line: the arguments every ``qevict`` command that runs a model takes, loading the
model and tokenizer they name, and the checks of the inputs those commands share (counts, a prompt file), made
before the model loads."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from models.checkpoint import load_model
from models.registry import DEFAULT_MODEL, registered_names, resolve_model
from models.tokenizer import Tokenizer

KV_DTYPES = ("bfloat16", "float16", "float32")
COMPUTE_DTYPES = {None: None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """--model alone (the bench scripts): a registered name or a path, default ``DEFAULT_MODEL``."""
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"registered name ({', '.join(registered_names())}), converted folder, HF folder or .gguf "
        f"(default {DEFAULT_MODEL})",
    )


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --kv-dtype and --set."""
    add_model_arg(p)
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None, help="compute dtype (default: checkpoint's)"
    )
    p.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        default="bfloat16",
        help="storage dtype of the KV cache and of Full-KV's reference bytes (default bfloat16)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        help="a method option (n_obs=64, recent=64, ranking=cumulative-all, ...); method.NAME=VALUE sets it "
        "for one method; repeatable; an option a method lacks is an error",
    )


def check_counts(args: argparse.Namespace, *names: str) -> None:
    """Refuse a count option below 1 (``--max-new-tokens 0``, ``--samples 0``) before anything runs, naming it
    as it is typed: a count of 0 is never replaced by a default."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def read_prompt_file(path: Path, *, option: str = "--prompt-file") -> str:
    """The text of the file ``path`` given to ``option``; a ValueError naming both when it is missing, a folder
    or not text."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{option} {path} is not UTF-8 text (byte {err.start} is {err.object[err.start]:#04x}); "
            "give a text file"
        ) from None
    except OSError as err:  # missing, a folder, unreadable
        raise ValueError(f"{option} {path}: {err.strerror or err}") from None


def kv_dtype(args: argparse.Namespace) -> Any:
    """The ``--kv-dtype`` as a jnp dtype."""
    return jnp.dtype(args.kv_dtype)


def load(args: argparse.Namespace) -> tuple[Any, Any, Tokenizer]:
    """(model config, model, tokenizer) of ``--model`` in ``--dtype``; converts a source on first use."""
    path = resolve_model(args.model)
    cfg, model = load_model(path, dtype=COMPUTE_DTYPES[args.dtype])
    return cfg, model, Tokenizer.from_dir(path)


def eos_ids(cfg: Any, tok: Tokenizer) -> tuple[int, ...]:
    """Stop tokens: the model config's and the tokenizer's."""
    return tuple(sorted(set(cfg.eos_token_ids) | set(tok.eos_token_ids)))


def add_sampler_args(p: argparse.ArgumentParser, max_new: int) -> None:
    """--max-new-tokens (default ``max_new``), --temperature, --top-p, --seed."""
    p.add_argument("--max-new-tokens", type=int, default=max_new)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def method_budget(method) -> float:
    """The byte budget β of a budgeted method, 1.0 for methods that keep everything."""
    return 1.0 if method.budget is None else method.budget
