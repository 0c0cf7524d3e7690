#!/usr/bin/env bash
# N = 4 questions on one ~1.6K-token context (docs/results/ask/context.txt): one `qevict ask` against four
# `qevict generate --question-agnostic`, wall time of each process (start-up, model load and compilation included)
set -euo pipefail
cd "$(dirname "$0")"
QEVICT=${QEVICT:-qevict}
mapfile -t QS < questions.txt
args=()
for q in "${QS[@]}"; do args+=(--question "$q"); done
start=$(date +%s.%N)
$QEVICT ask --context-file context.txt "${args[@]}" --max-new-tokens 32 --json > cli-ask.jsonl
end=$(date +%s.%N)
echo "qevict ask, 4 questions: $(echo "$end - $start" | bc) s"
: > cli-generate.jsonl
start=$(date +%s.%N)
for q in "${QS[@]}"; do
  $QEVICT generate --prompt-file context.txt --question "$q" --question-agnostic --method qevict-gated \
    --max-new-tokens 32 --json >> cli-generate.jsonl
done
end=$(date +%s.%N)
echo "4 x qevict generate --question-agnostic: $(echo "$end - $start" | bc) s"
