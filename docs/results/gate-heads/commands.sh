#!/usr/bin/env bash
# qevict-gated's per-head gate decisions on the held-out niah_multikey_1 / niah_single_2 samples at 4K (20 each,
# the README's seeds), code of 953e4bd. gate_stats.py reruns `qevict eval ruler` with a host callback in
# merge_tiers (a diagnostic: a host round trip per layer and step); its predictions equal the held-out records'
# (docs/results/ruler4k-b02-gate, ruler4k-b01-gate) on all 80 samples. The lead arrays (runs/s46/*.npz, 1.8 MB
# each) are not kept; summary.txt is gate_analyse.py's output.
set -x
A="ruler --tasks niah_multikey_1,niah_single_2 --samples 20 --max-new-tokens 48 --batch 10 --no-progress --lengths 4096 --methods qevict-gated"
python docs/results/gate-heads/gate_stats.py runs/s46/gate_stats_b02.npz -- $A --budgets 0.2 --out runs/s46/gate-stats-b02
python docs/results/gate-heads/gate_stats.py runs/s46/gate_stats_b01.npz -- $A --budgets 0.1 --out runs/s46/gate-stats-b01
for b in 2 1; do
  python docs/results/gate-heads/gate_analyse.py runs/s46/gate_stats_b0$b.npz runs/s46/gate-stats-b0$b/results.jsonl \
    docs/results/ruler4k-b0$b-qbias/results.jsonl 0.$b
done > docs/results/gate-heads/summary.txt
