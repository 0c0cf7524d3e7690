#!/usr/bin/env bash
# Issue 50's Qwen table at 4K, README seed (0), 20 samples per cell; resumable (rerun the same command).
# Run from the repository root with runs/qwen4k-agnostic a copy of this folder (runs/ is not committed).
# The question-agnostic methods of issue 49 (kvzip, qevict-kvzip, r2-kvzip; expected-attention, qevict-ea,
# r2-ea) join the first sweep: a rerun with the longer --methods adds only what is missing.
set -u
cd "$(git rev-parse --show-toplevel)"
Q="--model qwen2.5-coder-0.5b-instruct --tasks niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt --lengths 4096 --samples 20 --batch 10 --max-new-tokens 48"
.venv/bin/qevict eval ruler $Q --budgets 0.2,0.1 --methods full,snapkv,r2,qevict,qevict-gated,qevict-keynorm,kvzip,qevict-kvzip,r2-kvzip,expected-attention,qevict-ea,r2-ea --question-agnostic --out runs/qwen4k-agnostic
.venv/bin/qevict eval ruler $Q --budgets 0.1,0.05 --methods full,streamingllm,snapkv,adakv,r2,qevict,qevict-int2,qevict-gated --out runs/qwen4k-aware
