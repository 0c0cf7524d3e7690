#!/usr/bin/env bash
# Issue 49's SmolLM2 comparison at 2K, question-agnostic, beta 0.2, README seed 0, 20 samples per task; resumable
# (rerun the same command). Run from the repository root with runs/ruler2k-qa-scorers a copy of this folder.
set -u
cd "$(git rev-parse --show-toplevel)"
T=niah_multivalue,niah_multikey_2,vt,niah_multikey_1,niah_single_2,niah_single_1
.venv/bin/qevict eval ruler --tasks $T --lengths 2048 --samples 20 --batch 10 --max-new-tokens 48 --budgets 0.2 \
  --question-agnostic --methods full,r2,qevict,qevict-gated,kvzip,qevict-kvzip,r2-kvzip,expected-attention,qevict-ea,r2-ea \
  --out runs/ruler2k-qa-scorers
