"""The report of a sweep: summary tables (Markdown, CSV) and Pareto plots (score against measured memory
ratio, one frontier per method, Full-KV dashed).

Uses matplotlib's object API with the Agg canvas (no pyplot, no display needed, the global backend untouched).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qevict_jax.eval.sweep import FULL, aggregate, markdown_table, pivot_markdown, summary_rows, write_csv


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


def pareto_figure(records: Sequence[Mapping[str, Any]], score_name: str = "score", metric: str = "score"):
    """A matplotlib Figure: one panel per length (plus all lengths pooled when there are several)."""
    from matplotlib.figure import Figure

    lengths = list(dict.fromkeys(r["length"] for r in records))
    panels: list[Any] = lengths if len(lengths) == 1 else [*lengths, None]
    fig = Figure(figsize=(5.2 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    tasks = sorted({r["task"] for r in records})
    for ax, length in zip(axes, panels, strict=True):
        _draw_panel(ax, frontier_points(records, length, metric), score_name)
        label = "all lengths" if length is None else f"length {length}"
        ax.set_title(
            f"{', '.join(tasks) if len(tasks) <= 3 else f'{len(tasks)} tasks'} · {label}", fontsize=10
        )
    return fig


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def _draw_panel(ax, points: Mapping[str, list[tuple[float, float]]], score_name: str) -> None:
    full = points.get(FULL)
    others = [m for m in points if m != FULL]
    for i, method in enumerate(others):
        xs, ys = zip(*points[method], strict=True)
        ax.plot(xs, ys, marker=_MARKERS[i % len(_MARKERS)], markersize=7, alpha=0.85, label=method)
    if full:
        y = sum(p[1] for p in full) / len(full)
        ax.axhline(y, color="black", linestyle="--", linewidth=1.2, label=f"Full-KV ({y:.3g})")
    xmax = max((x for m in others for x, _ in points[m]), default=1.0)
    ax.set_xlim(0, max(xmax * 1.15, 0.05))
    ys = [y for pts in points.values() for _, y in pts]
    if ys and min(ys) >= 0 and max(ys) <= 100:  # a percentage: show the whole scale
        ax.set_ylim(-2, 102)
    ax.set_xlabel("measured memory ratio (cache bytes / Full-KV bytes)")
    ax.set_ylabel(score_name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def pareto_plot(
    records: Sequence[Mapping[str, Any]], path: str | Path, score_name: str = "score", metric: str = "score"
) -> Path:
    """Save the Pareto figure as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = pareto_figure(records, score_name, metric)
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
) -> str:
    """Write summary.md, summary.csv and pareto.png into ``out_dir``; return the Markdown table."""
    out = Path(out_dir)
    rows = summary_rows(records, extra)
    table = markdown_table(rows, extra, score_name)
    (out / "summary.md").write_text(
        table + "\n\n" + pivot_markdown(rows, score_name) + "\n", encoding="utf-8"
    )
    write_csv(rows, out / "summary.csv", extra)
    if plot and records:
        pareto_plot(records, out / "pareto.png", score_name=score_name)
    return table
