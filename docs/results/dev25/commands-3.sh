#!/usr/bin/env bash
# development cells at 4K, β = 0.1, question-aware (seed 1000, 10 per task); `r3` is the vehicle for the
# default's format and Q ranking at a lower q_frac (0.6 in the first command, 0.3 in the second)
set -x
cd /work/main
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
D=".venv/bin/qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 4096 --budgets 0.1 --no-progress"
$D --methods r2,qevict,r3 --set r3.quant=crot-k4v3 --set r3.q_rank=blend --set r3.q_frac=0.6 --out runs/dev25/aware4k-b01
$D --methods r3,qevict-crot --set r3.quant=crot-k4v3 --set r3.q_rank=blend --set r3.q_frac=0.3 --out runs/dev25/aware4k-b01-b
