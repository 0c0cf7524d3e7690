#!/usr/bin/env bash
set -x
cd /work/main
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
D=".venv/bin/qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 2048 --no-progress"
S="--set qevict-crot.q_rank=score --set r3.quant=crot-k4v3 --set r3.q_rank=keynorm --set qevict-rot.quant=crot-k4v3 --set qevict-rot.q_rank=blend --set qevict-nopromo.promotion=True --set qevict-nopromo.quant=crot-k4v3 --set qevict-nopromo.q_rank=keynorm --set qevict-nopromo.q_frac=0.85 --set qevict-nospill.spill=8 --set qevict-nospill.quant=crot-k4v3 --set qevict-nospill.q_rank=blend --set qevict-nospill.q_frac=0.85"
$D --budgets 0.2 --question-agnostic --methods full,qevict-crot,r3,qevict-rot,qevict-nopromo,qevict-nospill $S --out runs/dev25/qa-1
$D --budgets 0.2,0.1 --methods r3,qevict-rot,qevict-nopromo,qevict-nospill $S --out runs/dev25/aware-1
