"""Summarise gate_stats.py's records: the share of query heads whose Q discount is on (F's max logit leads Q's)
in the first 8 answer steps, overall, per layer, and on the samples where the gate and the ungated discount
(qevict-discount's record on the same samples) disagree.

usage: python gate_analyse.py LEADS.npz GATED_RESULTS.jsonl DISCOUNT_RESULTS.jsonl BUDGET
"""

import json
import sys
from pathlib import Path

import numpy as np

L = 30  # SmolLM2-135M layers
ROWS = 10  # the eval's batch
FIRST = 8  # answer steps summarised
DEEP = 11  # the first "deep" layer
path, gated_path, discount_path, budget = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
leads = np.load(path)["leads"]  # [calls, B, Hkv, G]: calls = batches x steps x layers, in order
rows = [json.loads(x) for x in Path(gated_path).read_text().splitlines()]
discount = {
    (r["task"], r["sample"]): r["score"]
    for r in map(json.loads, Path(discount_path).read_text().splitlines())
    if r["budget"] == budget
}
n_batches = len(rows) // ROWS
steps = leads.shape[0] // (L * n_batches)
assert leads.shape[0] == n_batches * steps * L, leads.shape
x = leads.reshape(n_batches, steps, L, *leads.shape[1:])[:, :FIRST]  # [nb, 8, L, B, Hkv, G]
on = (x > 0).astype(float)
print(f"{path}: {n_batches} batches x {steps} steps x {L} layers; beta {budget}; {len(rows)} samples")
print(
    f"  discount on (first {FIRST} answer steps, every head): {on.mean():.3f}; median lead m_F - m_Q {np.median(x):+.3f}"
)
print(
    f"  layers 0-{DEEP - 1}: {on[:, :, :DEEP].mean():.3f}; layers {DEEP}-{L - 1}: {on[:, :, DEEP:].mean():.3f}"
)
print("  per layer:", " ".join(f"{v:.2f}" for v in on.mean(axis=(0, 1, 3, 4, 5))))
deep = on[:, :, DEEP:].mean(axis=(1, 2, 4, 5)).reshape(-1)  # [samples], rows in record order
gated = np.array([r["score"] for r in rows])
other = np.array([discount[(r["task"], r["sample"])] for r in rows])
print(f"  right: gated {int((gated > 50).sum())}, ungated discount {int((other > 50).sum())} of {len(rows)}")
for name, sel in (("gated < discount", gated < other), ("gated > discount", gated > other)):
    print(f"  {name}: n={int(sel.sum())}, layers {DEEP}+ discount on:", np.round(deep[sel], 2).tolist())
