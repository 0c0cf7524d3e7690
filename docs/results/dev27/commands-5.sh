#!/usr/bin/env bash
# development cells (seed 1000, 10 per task, 60 per cell), question-aware 4K β = 0.1 first, then 2K in both
# modes; `r3` is the vehicle for the default (crot-k4v3, q_rank blend, q_frac 0.85) with one setting changed
set -x
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
D="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 4096 --budgets 0.1 --no-progress"
D2="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 2048 --no-progress"
V="--methods r3 --set r3.quant=crot-k4v3 --set r3.q_rank=blend --set r3.q_frac=0.85"
# spill 16 tokens (two windows after a window's start) for F and Q
$D $V --set r3.spill=16 --out runs/dev27/aware4k-b01-spill16
$D2 --budgets 0.2 --question-agnostic $V --set r3.spill=16 --out runs/dev27/qa2k-spill16
$D2 --budgets 0.2,0.1 $V --set r3.spill=16 --out runs/dev27/aware2k-spill16
# F ranked with the largest head's observation mass instead of the head mean
$D $V --set r3.ranking=headmax --out runs/dev27/aware4k-b01-headmax
# spill 16 for F only, the Q tier's key spilled 8 as before (q_spill)
$D $V --set r3.spill=16 --set r3.q_spill=8 --out runs/dev27/aware4k-b01-fspill16
$D2 --budgets 0.2 --question-agnostic $V --set r3.spill=16 --set r3.q_spill=8 --out runs/dev27/qa2k-fspill16
$D2 --budgets 0.2,0.1 $V --set r3.spill=16 --set r3.q_spill=8 --out runs/dev27/aware2k-fspill16
# R2 with the longer spill (does the eviction ablation gain from it too?)
$D --methods r2 --set r2.spill=16 --out runs/dev27/aware4k-b01-r2-spill16
# held out (the README's seeds, 20 per task, 120 per cell), run after the choice above, not used to make it
R="qevict eval ruler --tasks $T --samples 20 --max-new-tokens 48 --batch 10 --no-progress"
$R --lengths 2048 --budgets 0.2,0.1 $V --set r3.spill=16 --set r3.q_spill=8 --out runs/dev27/ruler2k-fspill16
$R --lengths 4096 --budgets 0.1 $V --set r3.spill=16 --set r3.q_spill=8 --out runs/dev27/ruler4k-b01-fspill16
