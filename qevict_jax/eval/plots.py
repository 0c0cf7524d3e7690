"""The report of a sweep: summary tables (Markdown, CSV) and its plot: grouped bars per task and method with
95% Wilson intervals when the methods ran at one budget, else score against measured memory ratio (one
frontier per method, intervals on each point); Full-KV dashed, methods named on the plot, not only coloured.

Uses matplotlib's object API with the Agg canvas (no pyplot, no display needed, the global backend untouched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qevict_jax.eval.summary import aggregate, markdown_table, pivot_markdown, summary_rows, write_csv
from qevict_jax.eval.sweep import FULL


def frontier_points(records: Sequence[Mapping[str, Any]], length: Any = None, metric: str = "score") -> dict:
    """Per method: [(memory ratio, metric)] sorted by memory, each point a (method, budget) mean.

    The mean is taken per task first, then over tasks (so every task weighs the same); ``length`` None pools
    every length.
    """
    recs = [r for r in records if length is None or r["length"] == length]
    per_task = aggregate(recs, ("task", "method", "budget"), extra=(metric,) if metric != "score" else ())
    points = aggregate(per_task, ("method", "budget"), extra=(metric,) if metric != "score" else ())
    out: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        if p["memory_ratio"] is None or p[metric] is None:
            continue
        out.setdefault(p["method"], []).append((p["memory_ratio"], p[metric]))
    return {m: sorted(v) for m, v in out.items()}


def pareto_optimal(points: Sequence[tuple[float, float]]) -> list[bool]:
    """Whether each (memory, score) point is Pareto-optimal: no other point has memory <= and score >=,
    one of them strictly."""

    def dominated(p: tuple[float, float]) -> bool:
        return any(q[0] <= p[0] and q[1] >= p[1] and q != p for q in points)

    return [not dominated(p) for p in points]


def wilson_interval(*, mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z = 1.96) of a proportion ``mean`` in [0, 1] seen over ``n`` samples.

    RULER scores with partial credit (multi-value needles) are means of values in [0, 1]; their variance is
    at most the binomial p (1 - p) that the interval assumes, so for them it errs on the wide side.
    """
    if n < 1:
        raise ValueError(f"an interval needs at least one sample, got n={n}")
    p = min(max(mean, 0.0), 1.0)
    z2 = z * z / n
    centre = (p + z2 / 2) / (1 + z2)
    half = z * (p * (1 - p) / n + z2 / (4 * n)) ** 0.5 / (1 + z2)
    # the interval contains p exactly (at p = 0 or 1 rounding would otherwise leave it a ulp outside)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def _percent_interval(score: float, n: int) -> tuple[float, float]:
    """Wilson interval of a 0-100 score as (below, above) offsets for an error bar."""
    lo, hi = wilson_interval(mean=score / 100, n=n)
    return score - 100 * lo, 100 * hi - score


def bar_cells(records: Sequence[Mapping[str, Any]], length: Any) -> dict[str, dict[str, tuple[float, int]]]:
    """Per task, then per method: (mean score, samples) at ``length``; a "mean" task (the mean of the
    per-task means, over every sample) is added when there are several tasks."""
    recs = [r for r in records if r["length"] == length]
    cells: dict[str, dict[str, tuple[float, int]]] = {}
    for row in aggregate(recs, ("task", "method")):
        cells.setdefault(row["task"], {})[row["method"]] = (row["score"], row["n"])
    if len(cells) > 1:
        methods = dict.fromkeys(m for per_task in cells.values() for m in per_task)
        cells["mean"] = {
            m: (
                sum(c[m][0] for c in cells.values() if m in c) / sum(m in c for c in cells.values()),
                sum(c[m][1] for c in cells.values() if m in c),
            )
            for m in methods
        }
    return cells


def sweep_figure(records: Sequence[Mapping[str, Any]], score_name: str = "score", *, intervals: bool = True):
    """The figure of a sweep: grouped bars per task and method when every method ran at one budget (the
    points of a frontier would sit on top of each other), the memory frontier otherwise (``pareto_figure``).
    ``intervals``: 95% Wilson intervals, for scores that are a per-sample 0-100 success (RULER-like)."""
    budgets = {r["budget"] for r in records if r["method"] != FULL}
    if len(budgets) <= 1:
        return bars_figure(records, score_name, intervals=intervals)
    return pareto_figure(records, score_name, intervals=intervals)


_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--", "**", "||")


def bars_figure(records: Sequence[Mapping[str, Any]], score_name: str = "score", *, intervals: bool = True):
    """Horizontal bars, one panel per length: per task a group of bars, one per method, labelled with the
    method's name, its score and (``intervals``) a 95% Wilson interval; Full-KV is the dashed line across each
    group."""
    from matplotlib.figure import Figure

    lengths = list(dict.fromkeys(r["length"] for r in records))
    methods = [m for m in dict.fromkeys(r["method"] for r in records) if m != FULL]
    tasks = list(dict.fromkeys(t for length in lengths for t in bar_cells(records, length)))
    tasks = [*(t for t in tasks if t != "mean"), *(["mean"] if "mean" in tasks else [])]
    rows = len(tasks) * (len(methods) + 1)
    fig = Figure(figsize=(5.6 * len(lengths) + 1.6, 1.2 + 0.24 * rows), layout="constrained")
    axes = fig.subplots(1, len(lengths), squeeze=False, sharey=True)[0]
    for ax, length in zip(axes, lengths, strict=True):
        cells = bar_cells(records, length)
        ticks, labels = [], []
        for g, task in enumerate(tasks):
            top = g * (len(methods) + 1)
            for i, method in enumerate(methods):
                y = top + i + 1
                ticks.append(y)  # every panel has every row, so panels that share the axis agree
                labels.append(method)
                if method not in cells.get(task, {}):
                    continue
                score, n = cells[task][method]
                err = _percent_interval(score, n) if intervals else (0.0, 0.0)
                ax.barh(
                    y,
                    score,
                    height=0.8,
                    color=f"C{i}",
                    hatch=_HATCHES[i % len(_HATCHES)],
                    alpha=0.85,
                    edgecolor="white",
                    xerr=[[e] for e in err] if intervals else None,
                    capsize=2,
                    error_kw={"elinewidth": 0.8},
                )
                ax.text(min(score + err[1] + 1.5, 101), y, f"{score:.3g} (n={n})", va="center", fontsize=7)
            ticks.append(top)
            labels.append(task)
            if FULL in cells.get(
                task, {}
            ):  # a dashed line across the group, its value named on its header row
                full = cells[task][FULL][0]
                ax.vlines(
                    full, top + 0.5, top + len(methods) + 0.5, colors="black", linestyles="--", linewidth=1.2
                )
                ax.text(full - 1, top, f"Full-KV {full:.3g}", ha="right", va="center", fontsize=7)
        ax.set_ylim(rows - 0.4, -0.6)
        ax.set_yticks(ticks, labels, fontsize=8)
        for label in ax.get_yticklabels():
            if label.get_text() in tasks:  # a group's header row
                label.set_fontweight("bold")
        ax.set_xlim(0, 118)
        ax.set_xlabel(score_name + (" (bars: 95% Wilson intervals)" if intervals else ""))
        ax.set_title(f"length {length}", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    return fig


def pareto_figure(
    records: Sequence[Mapping[str, Any]],
    score_name: str = "score",
    metric: str = "score",
    *,
    intervals: bool = False,
):
    """A matplotlib Figure: one panel per length (plus all lengths pooled when there are several), each
    frontier named by its method; with ``intervals`` (RULER-like 0-100 scores of ``metric`` "score") each
    point carries its 95% Wilson interval."""
    from matplotlib.figure import Figure

    lengths = list(dict.fromkeys(r["length"] for r in records))
    panels: list[Any] = lengths if len(lengths) == 1 else [*lengths, None]
    fig = Figure(figsize=(5.2 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    tasks = sorted({r["task"] for r in records})
    for ax, length in zip(axes, panels, strict=True):
        counts = _point_counts(records, length) if intervals and metric == "score" else None
        _draw_panel(ax, frontier_points(records, length, metric), score_name, counts)
        label = "all lengths" if length is None else f"length {length}"
        ax.set_title(
            f"{', '.join(tasks) if len(tasks) <= 3 else f'{len(tasks)} tasks'} · {label}", fontsize=10
        )
    return fig


def _point_counts(records: Sequence[Mapping[str, Any]], length: Any) -> dict[tuple[str, float], int]:
    """Samples behind each frontier point, keyed by (method, memory ratio) as ``frontier_points`` gives it."""
    recs = [r for r in records if length is None or r["length"] == length]
    per_task = aggregate(recs, ("task", "method", "budget"))
    counts: dict[tuple[str, Any], int] = {}
    for row in per_task:
        counts[(row["method"], row["budget"])] = counts.get((row["method"], row["budget"]), 0) + row["n"]
    memory = {
        (p["method"], p["budget"]): p["memory_ratio"] for p in aggregate(per_task, ("method", "budget"))
    }
    return {(m, memory[(m, b)]): n for (m, b), n in counts.items() if memory[(m, b)] is not None}


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _draw_panel(
    ax,
    points: Mapping[str, list[tuple[float, float]]],
    score_name: str,
    counts: Mapping[tuple[str, float], int] | None = None,
) -> None:
    full = points.get(FULL)
    others = [m for m in points if m != FULL]
    for i, method in enumerate(others):
        xs, ys = zip(*points[method], strict=True)
        yerr = None
        if counts is not None:
            yerr = list(
                zip(*(_percent_interval(y, counts[(method, x)]) for x, y in points[method]), strict=True)
            )
        ax.errorbar(
            xs,
            ys,
            yerr=yerr,
            marker=_MARKERS[i % len(_MARKERS)],
            markersize=7,
            alpha=0.85,
            capsize=3,
            label=method,
        )
        ax.annotate(
            method, (xs[-1], ys[-1]), xytext=(6, 0), textcoords="offset points", fontsize=7, va="center"
        )
    if full:
        y = sum(p[1] for p in full) / len(full)
        ax.axhline(y, color="black", linestyle="--", linewidth=1.2, label=f"Full-KV ({y:.3g})")
    xmax = max((x for m in others for x, _ in points[m]), default=1.0)
    ax.set_xlim(0, max(xmax * 1.3, 0.05))
    ys = [y for pts in points.values() for _, y in pts]
    if ys and min(ys) >= 0 and max(ys) <= 100:  # a percentage: show the whole scale
        ax.set_ylim(-2, 102)
    ax.set_xlabel("measured memory ratio (cache bytes / Full-KV bytes)")
    ax.set_ylabel(score_name + (" (bars: 95% Wilson intervals)" if counts is not None else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def sweep_plot(
    records: Sequence[Mapping[str, Any]],
    path: str | Path,
    score_name: str = "score",
    *,
    intervals: bool = True,
) -> Path:
    """Save the sweep's figure (``sweep_figure``) as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = sweep_figure(records, score_name, intervals=intervals)
    FigureCanvasAgg(fig)
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def write_summary(
    records: Sequence[Mapping[str, Any]],
    out_dir: str | Path,
    extra: Sequence[str] = (),
    score_name: str = "score",
    plot: bool = True,
    *,
    intervals: bool = True,
) -> str:
    """Write summary.md, summary.csv and summary.png into ``out_dir``; return the Markdown table.
    ``intervals``: the plot's 95% Wilson intervals (off for scores that are not a per-sample success rate,
    e.g. fidelity's top-1 agreement)."""
    out = Path(out_dir)
    rows = summary_rows(records, extra)
    table = markdown_table(rows, extra, score_name)
    (out / "summary.md").write_text(
        table + "\n\n" + pivot_markdown(rows, score_name) + "\n", encoding="utf-8"
    )
    write_csv(rows, out / "summary.csv", extra)
    if plot and records:
        sweep_plot(records, out / "summary.png", score_name, intervals=intervals)
    return table
