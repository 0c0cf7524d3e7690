#!/usr/bin/env bash
# development cells (seed 1000, 10 per task, 60 per cell), question-aware 4K β = 0.1 and question-agnostic 2K
# β = 0.2; `r3` is the vehicle for the default (crot-k4v3, q_rank blend, q_frac 0.85) with one setting changed.
# The first three cells ran with the discount as an environment switch in merge_tiers before the option existed
# (the same arithmetic: the Q partial's max logit shifted, the masses of the discounted softmax); the rest with
# the options q_logit_bias / q_biased_mass. Held-out records: docs/results/ruler4k-b01-qbias, ruler2k-qbias.
set -x
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
D="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 4096 --budgets 0.1 --no-progress"
D2="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 2048 --no-progress"
V="--methods r3 --set r3.quant=crot-k4v3 --set r3.q_rank=blend --set r3.q_frac=0.85"
$D $V --set r3.q_logit_bias=-1 --out runs/dev28/aware4k-b01-qb1
$D2 --budgets 0.2 --question-agnostic $V --set r3.q_logit_bias=-1 --out runs/dev28/qa2k-qb1
$D $V --set r3.q_logit_bias=-2 --out runs/dev28/aware4k-b01-qb2
$D2 --budgets 0.2 --question-agnostic $V --set r3.q_logit_bias=-1 --set r3.q_biased_mass=false --out runs/dev28/qa2k-qb1raw
$D $V --set r3.q_logit_bias=-1 --set r3.q_biased_mass=false --out runs/dev28/aware4k-b01-qb1raw
# held out (the README's seeds, 20 per task, 120 per cell), run after the choice above, not used to make it
R="qevict eval ruler --tasks $T --samples 20 --max-new-tokens 48 --batch 10 --no-progress"
C="--methods qevict --set qevict.q_logit_bias=-1 --set qevict.q_biased_mass=false"
$R --lengths 4096 --budgets 0.1 $C --out runs/dev28/ruler4k-b01-qbias
$R --lengths 2048 --budgets 0.2,0.1 $C --out runs/dev28/ruler2k-qbias
# the remaining held-out cells (the next session, the same code), after which the discount became a named method
# (`qevict-discount`), not the default (docs/results.md, "The discount held out in every cell")
$R --lengths 2048 --budgets 0.2 --question-agnostic $C --out runs/s43/ruler2k-qa-qbias
$R --lengths 4096 --budgets 0.2 $C --out runs/s43/ruler4k-b02-qbias
$R --lengths 4096 --budgets 0.2 --question-agnostic $C --out runs/s43/ruler4k-qa-qbias
S="--set qevict.q_logit_bias=-1 --set qevict.q_biased_mass=false"
qevict eval fidelity --lengths 4096 --targets 64 --methods qevict --budgets 0.1,0.2 --samples 3 $S --out runs/s43/fid4k-qbias
qevict eval fidelity --lengths 4096 --targets 64 --methods qevict --budgets 0.1,0.2 --samples 3 --set qevict.q_logit_bias=-0.5 --set qevict.q_biased_mass=false --out runs/s43/fid4k-qbias05
Q="qevict eval ruler --model qwen2.5-coder-0.5b-instruct --tasks niah_multikey_2 --samples 20 --max-new-tokens 48 --batch 10 --lengths 4096"
$Q --budgets 0.1,0.05 --methods qevict $S --out runs/s43/qwen4k-mk2-qbias
$Q --budgets 0.2 --question-agnostic --methods qevict $S --out runs/s43/qwen4k-mk2-qa-b02-qbias
python bench/decode_cpu.py --contexts 8000 --batches 1,4 --no-reference --method qevict,q_logit_bias=-1,q_biased_mass=false
