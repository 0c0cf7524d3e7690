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

import numpy as np

from qevict_jax.core.kv import DEFAULT_KV_DTYPE
from qevict_jax.eval.fidelity import fidelity_stats
from qevict_jax.eval.sweep import FULL, Job
from qevict_jax.methods.full import FullKV
from qevict_jax.methods.options import options_for
from qevict_jax.methods.registry import (
    available_methods,
    bind_tokenizer,
    configure,
    make_method,
    method_option,
)
from qevict_jax.runtime.compiled import EXECUTABLES
from qevict_jax.runtime.generate import generate, generate_shared
from qevict_jax.runtime.prefill import fit_method
from qevict_jax.runtime.sampling import SamplerConfig
from qevict_jax.runtime.teacher_forced import teacher_forced


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
    question_start: int | None = None  # index of the first question token (question-agnostic mode)


def resolve_methods(
    names: Sequence[str],
    budgets: Sequence[float],
    log: Callable[[str], None] = print,
    scoped_options: Mapping[str | None, Mapping[str, Any]] | None = None,
    recent: int | float | None = None,
) -> dict[tuple[str, float | None], Any]:
    """Method objects per (name, budget); names missing from ``available_methods()`` are skipped with a note.

    scoped_options: ``methods.parse_set_options`` output (``--set``); recent: the benchmark's protected
    recent region, set on every method that has one (``protects_recent``) unless ``--set`` gives it.
    A method without a budget (Full-KV, fixed-bit quantization) appears once, with budget None.
    """
    available = available_methods()
    methods: dict[tuple[str, float | None], Any] = {}
    for name in names:
        if name not in available:
            log(f"note: method {name!r} is not available (available: {', '.join(available)}); skipped")
            continue
        options = options_for(name, scoped_options or {})
        for b in budgets:
            method = make_method(name, b, **options)
            if recent is not None and method.protects_recent and "recent" not in options:
                method = configure(method, None, recent=recent)
            methods.setdefault((name, method.budget), method)
    if not methods:
        raise ValueError(f"none of the methods {', '.join(names)} is available")
    return methods


def check_feasible(
    model, methods: Mapping[tuple[str, float | None], Any], prompts: Sequence[Prepared], kv_dtype: Any
) -> None:
    """Size every method's cache for every planned prompt shape without computing anything
    (``jax.eval_shape``); raise one ValueError listing every infeasible (method, budget, prompt length)."""
    problems = []
    for (name, budget), method in methods.items():
        for p in prompts:
            n = len(p.ids)
            try:
                fit_method(
                    method,
                    model_cfg=model.cfg,
                    lengths=np.asarray([n]),
                    max_new_tokens=p.max_new_tokens,
                    budget_rounding="bucket",
                    kv_dtype=kv_dtype,
                    least_beta=False,  # a cell runs at the β it is labelled with, or not at all
                )
            except ValueError as err:
                problems.append(f"{name} (β={budget}) at a {n}-token prompt: {err}")
    if problems:
        raise ValueError("some configurations cannot run:\n  " + "\n  ".join(problems))


def _trace_total() -> int:
    return sum(EXECUTABLES.compilations.values())


def _strip_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


@dataclasses.dataclass
class RowResult:
    """One row of a (batched) generation: its tokens, its share of the cache bytes (every cache leaf is
    [L, B, ...], so a row holds 1/B of them), Full-KV's bytes at its final length, the batch's timings."""

    tokens: list[int]
    cache_bytes: float
    full_kv_bytes: int
    ttft_s: float
    decode_tokens_per_s: float
    batch: int

    @property
    def memory_ratio(self) -> float:
        return self.cache_bytes / self.full_kv_bytes

    @classmethod
    def of(cls, res: Any, row: int) -> RowResult:
        """Row ``row`` of a ``GenerationResult``."""
        b = len(res.tokens)
        full = res.full_kv_bytes  # linear in the tokens: a row's share is its final length's
        if b > 1:
            final = res.prompt_lengths[row] + len(res.tokens[row]) - 1
            full = round(full * final / _total_final(res))
        return cls(res.tokens[row], res.cache_bytes / b, int(full), res.ttft_s, res.decode_tokens_per_s, b)


def _total_final(res: Any) -> int:
    """Tokens of every row's final length (the denominator of a batch's Full-KV bytes)."""
    return sum(n + len(t) - 1 for n, t in zip(res.prompt_lengths, res.tokens, strict=True))


class GenerationHarness:
    """Runs one generation job: prepare (cached per task/length/sample), generate, decode, score.

    The prompt pass does not depend on the method (a method only decides what its cache keeps), so by
    default the methods of one (task, length, sample) share one prefill (``generate.generate_shared``):
    at the sample's first job every method still pending for it (``plan``) runs from that prefill. Their
    records carry ``shared_prefill`` (methods sharing it) and a ``ttft_s`` that includes the shared pass.
    ``question_agnostic``: each prompt's context is compressed before its question is appended.
    """

    def __init__(
        self,
        model,
        tokenizer,
        methods: Mapping[tuple[str, float | None], Any],
        prepare: Callable[[str, int, int], Prepared],
        eos_ids: Sequence[int],
        seed: int = 0,
        generate_fn: Callable | None = None,
        kv_dtype: Any = None,
        question_agnostic: bool = False,
        share_prefill: bool = True,
        batch: int = 1,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        methods = {key: bind_tokenizer(m, tokenizer) for key, m in methods.items()}
        self.model, self.tokenizer, self.methods = model, tokenizer, methods
        self.eos_ids = tuple(eos_ids)
        self.seed = seed
        self.share_prefill = share_prefill and generate_fn is None
        self.batch = batch if self.share_prefill else 1
        self.generate_fn = generate_fn or generate
        self.kv_dtype = DEFAULT_KV_DTYPE if kv_dtype is None else kv_dtype
        self.question_agnostic = question_agnostic
        self.prepare = functools.lru_cache(maxsize=64)(prepare)
        self._groups: dict[tuple, tuple[list[int], list[tuple[str, float | None]]]] = {}
        self._ready: dict[tuple, tuple[RowResult, float, int]] = {}

    def plan(self, jobs: Sequence[Job]) -> None:
        """The jobs still to run (``run_sweep`` calls this first): the samples of one (task, length) are cut
        into groups of ``batch`` that run together, every method still pending for them from one prefill."""
        pending: dict[tuple, dict[int, list[tuple[str, float | None]]]] = {}
        for j in jobs:
            per_sample = pending.setdefault((j.task, j.length), {})
            per_sample.setdefault(j.sample, []).append((j.method, j.budget))
        self._groups = {}
        for (task, length), per_sample in pending.items():
            samples = list(per_sample)
            for i in range(0, len(samples), self.batch):
                group = samples[i : i + self.batch]
                names = list(dict.fromkeys(w for s in group for w in per_sample[s]))
                for s in group:
                    self._groups[(task, length, s)] = (group, names)

    def _generate(self, job: Job, p: Prepared, sampler) -> tuple[RowResult, float, int]:
        """(row result, wall seconds per method and row, methods sharing the prefill) of ``job``."""
        if self.question_agnostic and p.question_start is None:
            raise ValueError(
                f"{job.task}: this task's prompts have no question start (question-agnostic mode)"
            )
        want = (job.task, job.length, job.sample, job.method, job.budget)
        if want in self._ready:
            return self._ready.pop(want)
        key = (job.task, job.length, job.sample)
        group, names = self._groups.get(key, ([job.sample], [(job.method, job.budget)]))
        if not self.share_prefill or (job.method, job.budget) not in names:
            group, names = [job.sample], [(job.method, job.budget)]
        prompts = [self.prepare(job.task, job.length, s) for s in group]
        starts = [q.question_start for q in prompts] if self.question_agnostic else None
        t0 = time.perf_counter()
        if self.share_prefill:
            results = generate_shared(
                self.model,
                [q.ids for q in prompts],
                sampler,
                [self.methods[w] for w in names],
                seed=self.seed,
                question_starts=starts,
                kv_dtype=self.kv_dtype,
            )
        else:
            method = self.methods[names[0]]
            results = [
                self.generate_fn(
                    self.model,
                    [p.ids],
                    sampler,
                    method,
                    seed=self.seed,
                    question_starts=starts,
                    kv_dtype=self.kv_dtype,
                )
            ]
        wall = (time.perf_counter() - t0) / (len(names) * len(group))
        for name, res in zip(names, results, strict=True):
            for row, s in enumerate(group):
                self._ready[(job.task, job.length, s, *name)] = (RowResult.of(res, row), wall, len(names))
        return self._ready.pop(want)

    def __call__(self, job: Job) -> dict[str, Any]:
        p = self.prepare(job.task, job.length, job.sample)
        method = self.methods[(job.method, job.budget)]
        stops = tuple(dict.fromkeys(self.eos_ids + p.stop_ids))
        sampler = SamplerConfig(p.max_new_tokens, eos_ids=stops)
        traces = _trace_total()
        res, wall, shared = self._generate(job, p, sampler)
        prediction = self.tokenizer.decode(_strip_eos(res.tokens, stops))
        return {
            "score": 100.0 * p.score(prediction),
            "prediction": prediction,
            "references": list(p.references),
            "memory_ratio": res.memory_ratio,
            "cache_bytes": res.cache_bytes,
            "full_kv_bytes": res.full_kv_bytes,
            "prompt_tokens": len(p.ids),
            "new_tokens": len(res.tokens),
            "ttft_s": res.ttft_s,
            "decode_tokens_per_s": res.decode_tokens_per_s,
            "wall_s": wall,
            "compiled": _trace_total() != traces,
            "shared_prefill": shared,
            "batch": res.batch,
            "recent": method_option(method, "recent") if "recent" in method.options else None,
            "question_agnostic": self.question_agnostic,
            "question_tokens": len(p.ids) - p.question_start if p.question_start is not None else None,
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
        kv_dtype: Any = None,
    ) -> None:
        self.kv_dtype = DEFAULT_KV_DTYPE if kv_dtype is None else kv_dtype
        self.model, self.methods = model, methods
        self.sample_fn = functools.lru_cache(maxsize=4)(sample_fn)
        self.teacher_forced_fn = teacher_forced_fn or teacher_forced
        self._full_cache: collections.OrderedDict[tuple[int, int], Any] = collections.OrderedDict()

    def _full(self, length: int, sample: int):
        key = (length, sample)
        if key not in self._full_cache:
            s = self.sample_fn(length, sample)
            self._full_cache[key] = self._run(s, FullKV())[0]
            while len(self._full_cache) > 2:
                self._full_cache.popitem(last=False)
        return self._full_cache[key]

    def _run(self, s, method):
        targets = np.asarray([s.targets])
        return self.teacher_forced_fn(self.model, [s.prefix], targets, method, kv_dtype=self.kv_dtype), s

    def __call__(self, job: Job) -> dict[str, Any]:
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
