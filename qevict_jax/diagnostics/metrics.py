"""The paper's diagnostics as pure numpy functions over one passage's traces (QEvict, ../shared/REFERENCES.md).

Conventions (every function):

- G decode steps; step g feeds the token at position P + g (P prompt tokens) and its query row is what the
  Full-KV reference trace records. Routing events r = 0..R-1: event 0 is the prefill placement, event r >= 1
  the decode routing event after step r·Ω - 1, so the tiers of event r are the ones decode steps
  ``[r·Ω, (r+1)·Ω)`` read (``event_of_step``).
- L layers, NW window ids (window w = positions ``[S + wW, S + (w+1)W)``, as in the cache).
- ``mass`` [G, L, NW]: Full-KV head-mean attention mass of step g's query on window w of layer l;
  ``total`` [G, L]: the row's whole mass (1 up to rounding: sinks included).
- ``tiers`` [R, L, NW] int8: the tier of every window after event r, coded ``F``, ``Q``, ``E`` (evicted:
  routed out of the ring and in neither F nor Q) or ``LOCAL`` (a sink-side window not routed yet: in the
  recent ring, or not written yet). Sinks are not windows; their mass is in ``total`` and counts as local.
- Per-layer values are averaged over layers (each layer's rows are head-means), unless a docstring says
  the counts are pooled.
"""

from __future__ import annotations

import numpy as np

F, Q, E, LOCAL = 0, 1, 2, 3
TIER_NAMES = ("F", "Q", "E")


def event_of_step(num_steps: int, omega: int, num_events: int) -> np.ndarray:
    """[G] int: the routing event whose tiers decode step g reads (``min(g // Ω, R - 1)``)."""
    return np.minimum(np.arange(num_steps) // omega, num_events - 1)


def tier_mass(mass: np.ndarray, total: np.ndarray, tiers: np.ndarray, omega: int) -> dict[str, float]:
    """Tier-mass distribution: the share of Full-KV mass each tier holds, averaged over steps and layers.

    mass [G, L, NW], total [G, L], tiers [R, L, NW]. At step g (event r = ``event_of_step``) the share of
    tier X in layer l is ``sum_w mass[g, l, w] [tiers[r, l, w] = X] / total[g, l]``; "local" is the rest
    (sinks, the recent ring, tokens written since event r), so the four shares sum to 1.
    Returns {"F", "Q", "E", "local"} -> mean share over the G steps and L layers.
    """
    g = mass.shape[0]
    t = tiers[event_of_step(g, omega, tiers.shape[0])]  # [G, L, NW]
    denom = np.where(total > 0, total, 1.0)
    out = {}
    for name, code in zip(TIER_NAMES, (F, Q, E), strict=True):
        out[name] = float(np.mean(np.sum(np.where(t == code, mass, 0.0), axis=-1) / denom))
    out["local"] = 1.0 - out["F"] - out["Q"] - out["E"]
    return out


def historical_shares(shares: dict[str, float]) -> dict[str, float]:
    """Tier-mass shares of the routed history only: {"F", "Q", "E"} of ``tier_mass`` renormalized to sum to
    1 (the local mass of sinks and the recent ring left out); NaN when the routed windows hold no mass."""
    hist = shares["F"] + shares["Q"] + shares["E"]
    return {k: shares[k] / hist if hist > 0 else float("nan") for k in TIER_NAMES}


def future_missed_mass(
    mass: np.ndarray, total: np.ndarray, tiers: np.ndarray, omega: int, horizon: int = 32
) -> np.ndarray:
    """Future Missed Mass per routing event: [R] float, NaN where censored.

    At event r (first step s = r·Ω), the share of the Full-KV mass of the next H steps ``[s, s + H)`` that
    falls on windows evicted at r (``tiers[r] == E``: they existed and are unreachable):
    ``FMM_r = mean_l sum_{g, w} mass[g, l, w] [tiers[r, l, w] = E] / sum_g total[g, l]``.
    Events without a full horizon (``s + H > G``) are censored (NaN).
    """
    g = mass.shape[0]
    r_count = tiers.shape[0]
    out = np.full(r_count, np.nan)
    for r in range(r_count):
        s = r * omega
        if s + horizon > g:
            continue
        evicted = tiers[r] == E  # [L, NW]
        missed = np.sum(np.where(evicted[None], mass[s : s + horizon], 0.0), axis=(0, 2))  # [L]
        out[r] = float(np.mean(missed / np.maximum(total[s : s + horizon].sum(axis=0), 1e-30)))
    return out


def selection_churn(tiers: np.ndarray) -> np.ndarray:
    """Selection churn between consecutive events: [R-1] float.

    The reachable set of event r (per layer) is the routed windows in F ∪ Q. churn_r = mean over layers of
    ``1 - |A_r ∩ A_{r+1}| / |A_r ∪ A_{r+1}|`` (two empty sets: churn 0).
    """
    reach = (tiers == F) | (tiers == Q)  # [R, L, NW]
    inter = np.sum(reach[:-1] & reach[1:], axis=-1)
    union = np.sum(reach[:-1] | reach[1:], axis=-1)
    jac = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return (1.0 - jac).mean(axis=-1)


def global_lir(tiers: np.ndarray, eligibility: int = 3) -> dict[str, float]:
    """Global LIR (late-importance revival), pooled over layers and windows.

    A pair (event r, window k) of a layer is eligible when k was routed (F, Q or E) and out of F in each of
    the events ``r - m + 1 .. r`` (m = ``eligibility``, so r >= m - 1); it is rescued when k is in F at some
    event r' > r. LIR = rescued / eligible (pairs never rescued before the last event count in the
    denominator). ``median_return``: median over rescued pairs of ``r' - r`` for the first such r'.
    Returns {"lir", "rescued", "eligible", "median_return"}; lir and median_return are NaN without eligible
    or rescued pairs.
    """
    if eligibility < 1:
        raise ValueError(f"eligibility must be >= 1, got {eligibility}")
    r_count = tiers.shape[0]
    out_f = (tiers == Q) | (tiers == E)  # [R, L, NW]
    in_f = tiers == F
    # next_f[r] = first event r' > r with k in F (r_count = never)
    next_f = np.full(tiers.shape, r_count, np.int64)
    nxt = np.full(tiers.shape[1:], r_count, np.int64)
    for r in range(r_count - 1, -1, -1):
        next_f[r] = nxt
        nxt = np.where(in_f[r], r, nxt)
    eligible = np.zeros(tiers.shape, bool)
    for r in range(eligibility - 1, r_count):
        eligible[r] = np.all(out_f[r - eligibility + 1 : r + 1], axis=0)
    rescued = eligible & (next_f < r_count)
    n_el, n_res = int(eligible.sum()), int(rescued.sum())
    lags = (next_f - np.arange(r_count)[:, None, None])[rescued]
    return {
        "lir": n_res / n_el if n_el else float("nan"),
        "rescued": float(n_res),
        "eligible": float(n_el),
        "median_return": float(np.median(lags)) if n_res else float("nan"),
    }


def oracle_tiers(reference: np.ndarray, tiers: np.ndarray, nf: int) -> np.ndarray:
    """The tiers of an oracle F policy: at every event, per layer, the ``nf`` routed windows with the most
    cumulative Full-KV mass (``cumulative_reference``, [R, L, NW]) are in F, every other routed window is out
    (E); windows the policy has not routed yet (``tiers`` [R, L, NW] == LOCAL) stay LOCAL. Ties: lower window
    id first. Its ``global_lir`` is the revival rate of the Full-KV ranking itself."""
    routed = tiers != LOCAL
    key = np.where(routed, reference, -np.inf)
    order = np.argsort(-key, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(key.shape[-1])[None, None], axis=-1)
    out = np.where(routed, E, LOCAL).astype(np.int8)
    return np.where(routed & (rank < nf), F, out).astype(np.int8)


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..N of x [N], ties given their average rank (as ``scipy.stats.rankdata``)."""
    x = np.asarray(x, np.float64)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), np.float64)
    sx = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sx[j + 1] == sx[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation of a, b [N] (Pearson of average ranks); NaN when N < 2 or a side is
    constant."""
    if len(a) < 2:
        return float("nan")
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = np.sqrt(np.sum(ra * ra) * np.sum(rb * rb))
    return float(np.sum(ra * rb) / den) if den > 0 else float("nan")


def cumulative_reference(
    prompt_mass: np.ndarray, mass: np.ndarray, omega: int, num_events: int
) -> np.ndarray:
    """Cumulative Full-KV mass per window at each event: [R, L, NW].

    prompt_mass [L, NW]: the Full-KV mass of the prompt's observation rows (the same rows the cache's
    default ranking starts from); event r adds the decode rows before it: ``prompt_mass + sum_{g < r·Ω}
    mass[g]``.
    """
    csum = np.concatenate([np.zeros_like(mass[:1]), np.cumsum(mass, axis=0)], axis=0)  # [G+1, L, NW]
    steps = np.minimum(np.arange(num_events) * omega, mass.shape[0])
    return prompt_mass[None] + csum[steps]


def qsa(scores: np.ndarray, reference: np.ndarray, tiers: np.ndarray, min_windows: int = 3) -> np.ndarray:
    """Q-tier score agreement per event: [R] float (NaN where undefined).

    For event r and layer l, the Spearman correlation, over the windows event r puts in Q, between the
    cache's score ``scores[r, l, w]`` (its ranking signal after the event) and the cumulative Full-KV mass
    ``reference[r, l, w]`` (``cumulative_reference``); averaged over the layers where it is defined (at least
    ``min_windows`` Q windows and neither side constant). An empty Q tier gives NaN.
    """
    out = np.full(tiers.shape[0], np.nan)
    for r in range(tiers.shape[0]):
        vals = []
        for layer in range(tiers.shape[1]):
            sel = tiers[r, layer] == Q
            if sel.sum() >= min_windows:
                rho = spearman(scores[r, layer, sel], reference[r, layer, sel])
                if not np.isnan(rho):
                    vals.append(rho)
        if vals:
            out[r] = float(np.mean(vals))
    return out


def recovered_q_mass(
    mass: np.ndarray, tiers: np.ndarray, scores_post: np.ndarray, scores_pre: np.ndarray, omega: int
) -> dict[str, float]:
    """RQ: the share of the Full-KV mass on the current Q windows that the compressed decode credits them.

    Interval r = the decode steps ``[r·Ω, (r+1)·Ω)`` between events r and r + 1 (r = 0..R-2), during which
    the Q set ``tiers[r] == Q`` does not change. ``scores_post`` [R, L, NW]: each window's cache score right
    after event r; ``scores_pre`` [R-1, L, NW]: right before event r + 1 routes. With the cumulative ranking
    a Q window's score grows by exactly the mass the compressed decode credits it, so per (r, l, w in Q_r)
    ``credited = scores_pre[r] - scores_post[r]`` and ``full = sum_{g in interval r} mass[g, l, w]``.

    - ``rq`` = sum min(credited, full) / sum full, pooled over intervals, layers and windows: the share of
      the Full-KV mass that reaches the Q windows (at most 1; a window credited more than its Full-KV mass
      counts its Full-KV mass).
    - ``rq_ratio`` = sum credited / sum full: can exceed 1, because the compressed softmax renormalizes over
      fewer keys (the evicted windows' mass lands on the kept ones, Q included).

    Both NaN when Q is always empty. Returns {"rq", "rq_ratio", "credited", "full"}.
    """
    credited = capped = full = 0.0
    for r in range(scores_pre.shape[0]):
        s, e = r * omega, min((r + 1) * omega, mass.shape[0])
        sel = tiers[r] == Q  # [L, NW]
        if not sel.any() or s >= e:
            continue
        got = (scores_pre[r] - scores_post[r])[sel]
        want = mass[s:e].sum(axis=0)[sel]
        credited += float(got.sum())
        capped += float(np.minimum(got, want).sum())
        full += float(want.sum())
    ok = full > 0
    return {
        "rq": capped / full if ok else float("nan"),
        "rq_ratio": credited / full if ok else float("nan"),
        "credited": credited,
        "full": full,
    }


def transition_matrix(tiers: np.ndarray, lag: int) -> tuple[np.ndarray, np.ndarray]:
    """Lag-δ tier transitions between {F, Q, E}, pooled over layers, windows and event pairs (r, r + δ).

    A window counts for the pair when it is routed (F, Q or E) at event r (it then stays routed).
    Returns (probabilities [3, 3], row-normalized, NaN rows for a tier never seen at r; counts [3, 3] int),
    rows = tier at r, columns = tier at r + δ, in the order F, Q, E.
    """
    if lag < 1:
        raise ValueError(f"lag must be >= 1, got {lag}")
    a, b = tiers[:-lag], tiers[lag:]
    counts = np.zeros((3, 3), np.int64)
    for i in range(3):
        for j in range(3):
            counts[i, j] = int(np.sum((a == i) & (b == j)))
    rows = counts.sum(axis=1, keepdims=True)
    probs = np.where(rows > 0, counts / np.maximum(rows, 1), np.nan)
    return probs, counts
