"""Where does a RULER answer sit after the prompt is compressed? The tier of its windows, layer by layer.

For each RULER sample the prompt is prefilled through each window-tier method (QEvict, R1-R4: the placement
of ``diagnostics.trace.policy_trace``'s event 0), and for each reference answer (a needle's value) the windows
holding its tokens in the prompt are looked up in every layer: held in F (exact), in the Q tier (read back
through its low-bit codes), evicted, or still in the recent region (exact, not routed yet). One row per
(sample, answer, method) gives the layers in each tier for the answer's window with the fewest exact layers
(the one a copy of the answer is most likely to garble), and the last rows the mean per method over the
answers that left the recent region. ``--question-agnostic`` prefills the context alone, before its
question, which is what that mode compresses.

Usage: python bench/answer_tiers.py [--model NAME] --tasks niah_single_2,niah_multikey_2 --length 4096
    --budget 0.1 --methods 'qevict;r2' [--samples 10] [--seed 1000] [--question-agnostic]
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from qevict_jax.core.kv import DEFAULT_KV_DTYPE
from qevict_jax.diagnostics.metrics import LOCAL, E, F, Q
from qevict_jax.diagnostics.trace import policy_trace, require_traceable
from qevict_jax.eval.tasks import generation_setup
from qevict_jax.model_args import add_model_arg, load
from qevict_jax.pipeline import resolve_method


def find_span(ids: Sequence[int], sub: Sequence[int]) -> int:
    """First index of the token run ``sub`` in ``ids``; -1 if absent."""
    n = len(sub)
    for i in range(len(ids) - n + 1):
        if list(ids[i : i + n]) == list(sub):
            return i
    return -1


def answer_positions(tokenizer, ids: Sequence[int], answer: str) -> range | None:
    """Prompt positions of ``answer``'s tokens: its own tokenization found in ``ids``, else that tokenization
    less its first token found right after one token (the first characters merged with what precedes them,
    e.g. a space), that token included; None if neither is there."""
    sub = list(tokenizer.encode(answer, add_bos=False))
    start = find_span(ids, sub)
    if start >= 0:
        return range(start, start + len(sub))
    start = find_span(ids, sub[1:]) if len(sub) > 1 else -1
    if start >= 1:
        return range(start - 1, start + len(sub) - 1)
    return None


def layer_counts(tiers: np.ndarray, windows: Sequence[int]) -> tuple[int, int, int, int]:
    """(F, Q, evicted, recent) layer counts of the window among ``windows`` with the fewest exact layers (F or
    recent: not routed yet, in the recent region), the first of those tied; tiers [L, NW]."""
    counts = [tuple(int(np.sum(tiers[:, w] == t)) for t in (F, Q, E, LOCAL)) for w in windows]
    return min(counts, key=lambda c: c[0] + c[3])


def answer_tiers(
    model, ids: Sequence[int], spans: Sequence[range], method
) -> list[tuple[int, int, int, int]]:
    """Prefill ``ids`` through ``method`` (a window-tier method) and return, per span of prompt positions, the
    (F, Q, evicted, recent) layer counts of its bottleneck window (``layer_counts``); positions among the sinks are
    always in F and do not count."""
    omega = method.cache.omega
    # one routing interval after the prefill (the trace needs one); the tiers read are the prefill's
    seq = np.asarray([list(ids) + [ids[-1]] * omega], np.int32)
    trace = policy_trace(model, seq, len(ids), method, kv_dtype=DEFAULT_KV_DTYPE)
    tiers = trace.tiers[0, 0]  # [L, NW] after the prefill placement
    out = []
    for span in spans:
        wins = sorted({(t - trace.sink) // trace.window for t in span if t >= trace.sink})
        out.append(layer_counts(tiers, wins) if wins else (tiers.shape[0], 0, 0, 0))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(p)
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_2,niah_multivalue")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--budget", type=float, default=0.1)
    p.add_argument(
        "--methods",
        default="qevict;r2",
        help="window-tier method specs (name[,option=value...]), separated by ';'",
    )
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=1000, help="RULER seed (1000: the development samples)")
    p.add_argument("--question-agnostic", action="store_true", help="prefill the context alone")
    args = p.parse_args(argv)
    specs = [s.strip() for s in args.methods.split(";") if s.strip()]
    methods = []
    for spec in specs:
        try:
            m = resolve_method(spec, args.budget, recent=64)  # RULER's protected recent region
            require_traceable(m)
        except ValueError as err:
            p.error(f"--methods {spec!r}: {err}")
        methods.append(m)
    _, model, tok = load(argparse.Namespace(model=args.model, dtype=None))
    setup = argparse.Namespace(
        eval_task="ruler", tasks=args.tasks, no_chat=False, depths=None, haystack="ruler", seed=args.seed,
        max_new_tokens=48, samples=args.samples,
    )  # fmt: skip
    tasks, prepare, _ = generation_setup(setup, tok)
    print(f"# {args.model}, {args.length} tokens, β = {args.budget}, seed {args.seed}, "
          f"{'question-agnostic' if args.question_agnostic else 'question-aware'}")  # fmt: skip
    print("| task | sample | answer | method | F layers | Q layers | evicted layers | recent layers |")
    print("|---|---|---|---|---|---|---|---|")
    totals: dict[str, list[tuple[int, int, int, int]]] = collections.defaultdict(list)
    missing = 0
    for task, sample in tqdm([(t, i) for t in tasks for i in range(args.samples)], desc="answer tiers"):
        prep = prepare(task, args.length, sample)
        ids = list(prep.ids[: prep.question_start] if args.question_agnostic else prep.ids)
        found = [(a, answer_positions(tok, ids, a)) for a in prep.references]
        missing += sum(span is None for _, span in found)
        found = [(a, span) for a, span in found if span is not None]
        for m in methods:
            counts = answer_tiers(model, ids, [span for _, span in found], m)
            for (answer, _), c in zip(found, counts, strict=True):
                totals[m.name].append(c)
                print(
                    f"| {task} | {sample} | {answer} | {m.name} | {c[0]} | {c[1]} | {c[2]} | {c[3]} |",
                    flush=True,
                )
    if missing:
        print(
            f"{missing} answers were not found as a token run of their prompt and are left out",
            file=sys.stderr,
        )
    for name, rows in totals.items():
        routed = np.asarray([c for c in rows if c[3] < sum(c)], float)  # not wholly in the recent region
        mean = np.mean(routed, axis=0) if len(routed) else np.full(4, np.nan)
        print(
            f"| mean of {len(routed)} routed answers | | | {name} | "
            + " | ".join(f"{x:.1f}" for x in mean)
            + " |"
        )


if __name__ == "__main__":
    main()
