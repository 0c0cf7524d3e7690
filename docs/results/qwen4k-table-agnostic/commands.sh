#!/usr/bin/env bash
# Issue 50's Qwen table at 4K, README seed (0), 20 samples per cell; resumable (rerun the same command).
set -u
cd "$(dirname "$0")/.."
Q="--model qwen2.5-coder-0.5b-instruct --tasks niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt --lengths 4096 --samples 20 --batch 10 --max-new-tokens 48"
.venv/bin/qevict eval ruler $Q --budgets 0.2,0.1 --methods full,snapkv,r2,qevict,qevict-gated,qevict-keynorm --question-agnostic --out runs/qwen4k-agnostic
.venv/bin/qevict eval ruler $Q --budgets 0.1,0.05 --methods full,streamingllm,snapkv,adakv,r2,qevict,qevict-int2,qevict-gated --out runs/qwen4k-aware
