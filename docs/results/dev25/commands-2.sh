#!/usr/bin/env bash
set -x
cd /work/main
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
D=".venv/bin/qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 2048 --no-progress"
S="--set qevict-nospill.spill=8 --set qevict-nospill.quant=crot-k4v3 --set qevict-nospill.q_rank=blend --set qevict-nospill.q_frac=0.9 --set qevict-all.ranking=cumulative --set qevict-all.quant=crot-k4v3 --set qevict-all.q_rank=blend --set qevict-all.q_frac=0.95"
$D --budgets 0.2 --question-agnostic --methods qevict-nospill,qevict-all $S --out runs/dev25/qa-2
$D --budgets 0.2,0.1 --methods qevict-nospill,qevict-all $S --out runs/dev25/aware-2
