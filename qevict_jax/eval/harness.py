"""Glue between a sweep job and the model: build the prompt, generate (or teacher-force), score, measure.

``GenerationHarness`` serves RULER, LongBench and GSM8K: a task supplies ``prepare(task, length, sample) ->
Prepared`` (token ids, generation length, references, scorer); the harness runs ``generate`` with the job's
method and returns the record. ``FidelityHarness`` runs ``teacher_forced`` and compares with Full-KV.
Both take the generation function as an argument, so tests can inject a fake one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from qevict_jax.eval.sweep import FULL, Job


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A prompt ready to run, shared by every method at one (task, length, sample)."""

    ids: list[int]
    max_new_tokens: int
    references: list[str]
    score: Callable[[str], float]  # prediction -> score in [0, 1]
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # extra record fields
    stop_ids: tuple[int, ...] = ()  # extra end-of-answer tokens for this prompt
    annotate: Callable[[str], Mapping[str, Any]] | None = None  # prediction -> extra record fields


def resolve_methods(
    names: Sequence[str], budgets: Sequence[float], log: Callable[[str], None] = print
) -> dict[tuple[str, float | None], Any]:
    """Method objects per (name, budget); names missing from ``available_methods()`` are skipped with a note.

    A method without a ``budget`` attribute (Full-KV, fixed-bit quantization) appears once, with budget None.
    """
    from qevict_jax.methods import available_methods, make_method

    available = available_methods()
    methods: dict[tuple[str, float | None], Any] = {}
    for name in names:
        if name not in available:
            log(f"note: method {name!r} is not available (available: {', '.join(available)}); skipped")
            continue
        for b in budgets:
            method = make_method(name, b)
            methods.setdefault((name, method_budget(method, b)), method)
    if not methods:
        raise ValueError(f"none of the methods {', '.join(names)} is available")
    return methods


def check_feasible(
    model, methods: Mapping[tuple[str, float | None], Any], prompts: Sequence[Prepared]
) -> None:
    """Size every method's cache for every planned prompt shape without computing anything
    (``jax.eval_shape``); raise one ValueError listing every infeasible (method, budget, prompt length)."""
    import jax
    import jax.numpy as jnp

    from qevict_jax.generate import _budget_tokens, bucket_length

    problems = []
    for (name, budget), method in methods.items():
        for p in prompts:
            n = len(p.ids)
            lengths = jnp.asarray([n], jnp.int32)
            tokens = _budget_tokens(method, lengths, p.max_new_tokens, "bucket")

            def init(method=method, lengths=lengths, n=n, p=p, tokens=tokens):
                return method.init_cache(
                    model.cfg, lengths, bucket_length(n), p.max_new_tokens, model.dtype, tokens
                )

            try:
                jax.eval_shape(init)
            except ValueError as err:
                problems.append(f"{name} (β={budget}) at a {n}-token prompt: {err}")
    if problems:
        raise ValueError("some configurations cannot run:\n  " + "\n  ".join(problems))


def method_budget(method: Any, requested: float | None = None) -> float | None:
    """The byte budget β a method runs at: its ``budget`` (or ``cache.budget``) attribute; the requested one
    for a budgeted method that exposes neither; None for methods without a budget."""
    for owner in (method, getattr(method, "cache", None)):
        budget = getattr(owner, "budget", None)
        if isinstance(budget, int | float):
            return float(budget)
    return requested if getattr(method, "uses_budget", False) else None


def _trace_total() -> int:
    from qevict_jax import generate as gen

    return sum(gen.TRACE_COUNTS.values())


def _strip_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


class GenerationHarness:
    """Runs one generation job: prepare (cached per task/length/sample), generate, decode, score."""

    def __init__(
        self,
        model,
        tokenizer,
        methods: Mapping[tuple[str, float | None], Any],
        prepare: Callable[[str, int, int], Prepared],
        eos_ids: Sequence[int],
        seed: int = 0,
        generate_fn: Callable | None = None,
    ) -> None:
        from qevict_jax.generate import generate

        self.model, self.tokenizer, self.methods = model, tokenizer, methods
        self.eos_ids = tuple(eos_ids)
        self.seed = seed
        self.generate_fn = generate_fn or generate
        self.prepare = functools.lru_cache(maxsize=8)(prepare)

    def __call__(self, job: Job) -> dict[str, Any]:
        from qevict_jax.generate import SamplerConfig

        p = self.prepare(job.task, job.length, job.sample)
        method = self.methods[(job.method, job.budget)]
        stops = tuple(dict.fromkeys(self.eos_ids + p.stop_ids))
        sampler = SamplerConfig(p.max_new_tokens, eos_ids=stops)
        traces = _trace_total()
        t0 = time.perf_counter()
        res = self.generate_fn(self.model, [p.ids], sampler, method, seed=self.seed)
        wall = time.perf_counter() - t0
        prediction = self.tokenizer.decode(_strip_eos(res.tokens[0], stops))
        return {
            "score": 100.0 * p.score(prediction),
            "prediction": prediction,
            "references": list(p.references),
            "memory_ratio": res.memory_ratio,
            "cache_bytes": res.cache_bytes,
            "full_kv_bytes": res.full_kv_bytes,
            "prompt_tokens": len(p.ids),
            "new_tokens": len(res.tokens[0]),
            "ttft_s": res.ttft_s,
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "wall_s": wall,
            "compiled": _trace_total() != traces,
            **p.info,
            **(p.annotate(prediction) if p.annotate else {}),
        }


class FidelityHarness:
    """Runs one fidelity job: teacher-force the sample's targets with the method and with Full-KV, compare."""

    def __init__(
        self,
        model,
        methods: Mapping[tuple[str, float | None], Any],
        sample_fn: Callable[[int, int], Any],
        teacher_forced_fn: Callable | None = None,
    ) -> None:
        from qevict_jax.generate import teacher_forced

        self.model, self.methods = model, methods
        self.sample_fn = functools.lru_cache(maxsize=4)(sample_fn)
        self.teacher_forced_fn = teacher_forced_fn or teacher_forced
        self._full_cache: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()

    def _full(self, length: int, sample: int):
        key = (length, sample)
        if key not in self._full_cache:
            from qevict_jax.kv import FullKV

            s = self.sample_fn(length, sample)
            self._full_cache[key] = self._run(s, FullKV())[0]
            while len(self._full_cache) > 2:
                self._full_cache.popitem(last=False)
        return self._full_cache[key]

    def _run(self, s, method):
        import numpy as np

        return self.teacher_forced_fn(self.model, [s.prefix], np.asarray([s.targets]), method), s

    def __call__(self, job: Job) -> dict[str, Any]:
        from qevict_jax.eval.fidelity import fidelity_stats

        s = self.sample_fn(job.length, job.sample)
        full = self._full(job.length, job.sample)
        traces = _trace_total()
        t0 = time.perf_counter()
        res, _ = (full, s) if job.method == FULL else self._run(s, self.methods[(job.method, job.budget)])
        wall = time.perf_counter() - t0
        stats = fidelity_stats(full.logprobs[0], res.logprobs[0], s.targets)
        return {
            "score": 100.0 * stats.top1,
            "kl": stats.kl,
            "top1": stats.top1,
            "ppl": stats.ppl,
            "ppl_full": stats.ppl_full,
            "ppl_change": stats.ppl_change,
            "memory_ratio": res.memory_ratio,
            "cache_bytes": res.cache_bytes,
            "full_kv_bytes": res.full_kv_bytes,
            "prompt_tokens": len(s.prefix),
            "targets": len(s.targets),
            "prediction": None,
            "ttft_s": None,
            "decode_tokens_per_s": None,
            "wall_s": wall,
            "compiled": _trace_total() != traces,
            "start_paragraph": s.start_paragraph,
        }


def warn(message: str) -> None:
    print(message, file=sys.stderr)
