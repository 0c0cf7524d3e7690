#!/usr/bin/env bash
# Gating the Q tier's discount by where each head's best historical match is (q_bias_gate). Development cells
# (seed 1000, 10 per task, 60 per cell, six tasks) and fidelity (the 3 passages of every fidelity row); each is
# the default `qevict` with q_logit_bias=-1, q_biased_mass=false (qevict-discount's) and the gate. The gate-0 rows
# (fid4k-gate0, qa2k-gate0, aware4k-b01-gate0) ran on fab226f with the gate's arithmetic behind an environment
# switch in merge_tiers (bias where F's max logit > Q's max logit), before the option existed, so their
# sweep.json does not name it; the rest on 65580a7 with the option. Records in docs/results/dev29/.
set -x
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
S="--set qevict.q_logit_bias=-1 --set qevict.q_biased_mass=false"
F="qevict eval fidelity --lengths 4096 --targets 64 --methods qevict --budgets 0.1,0.2 --samples 3"
D="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000"
$F $S --set qevict.q_bias_gate=0 --out runs/s44/fid4k-gate0
$D --lengths 2048 --budgets 0.2 --question-agnostic --methods qevict $S --set qevict.q_bias_gate=0 --out runs/s44/qa2k-gate0
$D --lengths 4096 --budgets 0.1 --methods qevict $S --set qevict.q_bias_gate=0 --out runs/s44/aware4k-b01-gate0
# a side probe: 4-bit values at the default's q_frac (10% more bytes per Q window, fewer Q windows)
$F --set qevict.quant=crot-k4v4 --out runs/s44/fid4k-k4v4
$F $S --set qevict.q_bias_gate=1 --out runs/s44/fid4k-gate1
$D --lengths 4096 --budgets 0.1 --methods qevict $S --set qevict.q_bias_gate=1 --out runs/s44/aware4k-b01-gate1
# held out (the README's seeds, 20 per task, 120 per cell), gate 0, run after the choice above
R="qevict eval ruler --tasks $T --samples 20 --max-new-tokens 48 --batch 10"
C="--methods qevict $S --set qevict.q_bias_gate=0"
$R --lengths 2048 --budgets 0.2 --question-agnostic $C --out runs/s44/ruler2k-qa-gate
$R --lengths 4096 --budgets 0.1 $C --out runs/s44/ruler4k-b01-gate
$R --lengths 4096 --budgets 0.1 --methods qevict $S --set qevict.q_bias_gate=1 --out runs/s44/ruler4k-b01-gate1
# the remaining held-out cells for gate 0 (the next session, code 5e6f9c5: the same arithmetic; records
# docs/results/ruler2k-gate, ruler4k-b02-gate, ruler4k-qa-gate, qwen4k-mk2-gate); `qevict-gated` names these options
$R --lengths 2048 --budgets 0.2,0.1 $C --out runs/s45/ruler2k-gate
$R --lengths 4096 --budgets 0.2 $C --out runs/s45/ruler4k-b02-gate
$R --lengths 4096 --budgets 0.2 --question-agnostic $C --out runs/s45/ruler4k-qa-gate
Q="qevict eval ruler --model qwen2.5-coder-0.5b-instruct --tasks niah_multikey_2 --samples 20 --max-new-tokens 48 --batch 10 --lengths 4096"
$Q --budgets 0.1,0.05 $C --out runs/s45/qwen4k-mk2-gate
# the session after (code 953e4bd; bench header from the next commit): Qwen question-agnostic (record
# docs/results/qwen4k-mk2-qa-b02-gate), the decode bench at 8K (docs/results/decode8k-gated*.txt), and the per-head
# gate decisions (docs/results/gate-heads/commands.sh)
$Q --budgets 0.2 --question-agnostic --methods qevict-gated --out runs/s46/qwen4k-mk2-qa-b02-gate
python bench/decode_cpu.py --contexts 8000 --batches 1,4 --no-reference --method qevict-gated
python bench/decode_cpu.py --contexts 8000 --batches 1,4 --no-reference  # then again with --method qevict-gated, back to back
# gate 0.5, development only (the same session; records docs/results/dev29/fid4k-gate05, aware4k-b01-gate05)
qevict eval fidelity --lengths 4096 --targets 64 --methods qevict-gated --budgets 0.1,0.2 --samples 3 --set qevict-gated.q_bias_gate=0.5 --out runs/s46/fid4k-gate05
$D --lengths 4096 --budgets 0.1 --methods qevict-gated --set qevict-gated.q_bias_gate=0.5 --out runs/s46/aware4k-b01-gate05
