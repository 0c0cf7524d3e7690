"""Reduce a policy trace against the Full-KV reference to the paper's diagnostics, aggregate them over
passages (mean ± spread = standard deviation over passages) and print them as tables shaped like the
paper's Tables 14-16 and 18, or as JSON records (one per policy and metric).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from qevict_jax.diagnostics import metrics as M
from qevict_jax.diagnostics.trace import PolicyTrace, ReferenceTrace, window_mass

LAGS = (1, 2, 4, 8)
TRANSITIONS = [(a, b) for a in M.TIER_NAMES for b in M.TIER_NAMES]


def passage_metrics(
    ref: ReferenceTrace, trace: PolicyTrace, row: int, horizon: int = 32, eligibility: int = 3
) -> tuple[dict[str, float], dict[str, Any]]:
    """The diagnostics of passage ``row``: (scalars {metric: value}, series {"fmm": [R], "counts": {lag:
    [3, 3]}}).

    Scalars: fmm (mean over uncensored events), churn (mean over event pairs), lir, lir_median_return,
    lir_oracle (Global LIR of the oracle F policy with the same F slots, ``metrics.oracle_tiers``),
    qsa (mean over events where defined), rq and rq_ratio, mass_F/Q/E/local (tier-mass shares), hist_F/Q/E
    (the same over the routed history only), q_to_f (lag-1 Q->F transitions, summed over layers), and
    ``T{δ}_{a}{b}`` lag-δ transition probabilities. QSA's reference starts from the Full-KV mass of the
    prompt queries the policy's ranking starts from (the observation window, or every prompt query for
    "cumulative-all").
    """
    tiers, r_count = trace.tiers[row], trace.tiers.shape[1]
    nw = tiers.shape[-1]
    rows = ref.rows[row]  # [G, L, T]
    mass = window_mass(rows, trace.sink, trace.window, nw)  # [G, L, NW]
    total = rows.sum(-1)
    prompt_rows = ref.prompt_all[row] if trace.ranking == "cumulative-all" else ref.prompt_rows[row]
    prompt = window_mass(prompt_rows, trace.sink, trace.window, nw)  # [L, NW]
    fmm = M.future_missed_mass(mass, total, tiers, trace.omega, horizon)
    lir = M.global_lir(tiers, eligibility)
    reference = M.cumulative_reference(prompt, mass, trace.omega, r_count)
    qsa = M.qsa(trace.scores[row], reference, tiers)
    oracle = M.global_lir(M.oracle_tiers(reference, tiers, trace.nf), eligibility) if trace.nf else None
    rq = M.recovered_q_mass(mass, tiers, trace.scores[row], trace.scores_pre[row], trace.omega)
    shares = M.tier_mass(mass, total, tiers, trace.omega)
    nanmean = lambda x: float(np.nanmean(x)) if np.isfinite(x).any() else float("nan")
    out = {
        "fmm": nanmean(fmm),
        "churn": float(np.mean(M.selection_churn(tiers))) if r_count > 1 else float("nan"),
        "lir": lir["lir"],
        "lir_median_return": lir["median_return"],
        "lir_oracle": oracle["lir"] if oracle else float("nan"),
        "qsa": nanmean(qsa),
        "rq": rq["rq"],
        "rq_ratio": rq["rq_ratio"],
        **{f"mass_{k}": v for k, v in shares.items()},
        **{f"hist_{k}": v for k, v in M.historical_shares(shares).items()},
    }
    counts = {}
    for lag in LAGS:
        if lag >= r_count:
            continue
        probs, cnt = M.transition_matrix(tiers, lag)
        counts[lag] = cnt
        for i, a in enumerate(M.TIER_NAMES):
            for j, b in enumerate(M.TIER_NAMES):
                out[f"T{lag}_{a}{b}"] = float(probs[i, j])
    out["q_to_f"] = float(counts[1][1, 0]) if 1 in counts else float("nan")
    return out, {"fmm": fmm, "counts": counts}


def spread(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, standard deviation, n) over the finite values (NaN, NaN, 0 when there are none; the standard
    deviation is NaN for a single value)."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
    if not len(v):
        return float("nan"), float("nan"), 0
    return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else float("nan"), len(v)


def records(per_policy: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """One JSON-ready record per (policy, metric): mean, spread (std over passages), n, per-passage values
    (NaN written as None)."""
    out = []
    for policy, rows in per_policy.items():
        for metric in rows[0]:
            vals = [r[metric] for r in rows]
            mean, sd, n = spread(vals)
            clean = lambda x: None if x is None or not math.isfinite(x) else x
            out.append(
                {
                    "policy": policy,
                    "metric": metric,
                    "mean": clean(mean),
                    "spread": clean(sd),
                    "n": n,
                    "values": [clean(x) for x in vals],
                }
            )
    return out


def _cell(recs: dict[tuple[str, str], dict], policy: str, metric: str, scale: float, digits: int) -> str:
    r = recs.get((policy, metric))
    if r is None or r["mean"] is None:
        return "-"
    if r["spread"] is None:  # a single passage
        return f"{r['mean'] * scale:.{digits}f}"
    return f"{r['mean'] * scale:.{digits}f} ± {r['spread'] * scale:.{digits}f}"


def tables(recs: list[dict[str, Any]], windows: dict[str, int], horizon: int, eligibility: int) -> str:
    """Markdown tables shaped like the paper's Tables 14 (drift), 15 (tier mass), 16 (lag-δ transitions)
    and 18 (promotion ablation), mean ± std over passages; percentages where the paper uses them."""
    by = {(r["policy"], r["metric"]): r for r in recs}
    policies = list(dict.fromkeys(r["policy"] for r in recs))
    lines = [
        f"Table 14 (drift): Future Missed Mass (H = {horizon}), selection churn, Global LIR (m = {eligibility})",
        "",
        "| policy | W | FMM (%) | churn (%) | Global LIR (%) | median return (events) | oracle LIR (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in policies:
        lines.append(
            f"| {p} | {windows[p]} | {_cell(by, p, 'fmm', 100, 1)} | {_cell(by, p, 'churn', 100, 1)} | "
            f"{_cell(by, p, 'lir', 100, 1)} | {_cell(by, p, 'lir_median_return', 1, 1)} | "
            f"{_cell(by, p, 'lir_oracle', 100, 1)} |"
        )
    lines += [
        "",
        "Table 15 (tier mass): share of Full-KV attention mass on F, Q, evicted and local (sinks + recent ring);",
        "then the same shares of the routed history only (local left out)",
        "",
        "| policy | F (%) | Q (%) | evicted (%) | local (%) | history: F (%) | Q (%) | evicted (%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in policies:
        cells = " | ".join(_cell(by, p, f"mass_{t}", 100, 1) for t in ("F", "Q", "E", "local"))
        hist = " | ".join(_cell(by, p, f"hist_{t}", 100, 1) for t in ("F", "Q", "E"))
        lines.append(f"| {p} | {cells} | {hist} |")
    lines += [
        "",
        "Table 16 (transitions): lag-δ tier transition probabilities between routing events (%)",
        "",
        "| policy | δ | " + " | ".join(f"{a}→{b}" for a, b in TRANSITIONS) + " |",
        "|---|---|" + "---|" * len(TRANSITIONS),
    ]
    for p in policies:
        for lag in LAGS:
            if (p, f"T{lag}_FF") not in by:
                continue
            cells = " | ".join(_cell(by, p, f"T{lag}_{a}{b}", 100, 1) for a, b in TRANSITIONS)
            lines.append(f"| {p} | {lag} | {cells} |")
    lines += [
        "",
        "Table 18 (promotion): FMM, Q-tier score agreement (Spearman), recovered Q mass, Global LIR, Q→F moves",
        "",
        "| policy | FMM (%) | QSA | RQ (%) | RQ ratio (%) | Global LIR (%) | Q→F transitions |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in policies:
        lines.append(
            f"| {p} | {_cell(by, p, 'fmm', 100, 1)} | {_cell(by, p, 'qsa', 1, 3)} | {_cell(by, p, 'rq', 100, 1)} | "
            f"{_cell(by, p, 'rq_ratio', 100, 1)} | {_cell(by, p, 'lir', 100, 1)} | {_cell(by, p, 'q_to_f', 1, 0)} |"
        )
    return "\n".join(lines)
