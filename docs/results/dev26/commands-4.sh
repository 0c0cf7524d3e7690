#!/usr/bin/env bash
# development cells at 4K, β = 0.1, question-aware (seed 1000, 10 per task), code of ad53034 plus the crot-k3v4
# format name; `r3` is the vehicle for the default's q_frac with another Q ranking or ledger format
set -x
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multikey_2,niah_multivalue,vt
D="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 4096 --budgets 0.1 --no-progress"
$D --methods r3 --set r3.quant=crot-k4v3 --set r3.q_rank=score --set r3.q_frac=0.85 --out runs/dev26/aware4k-b01-score85
$D --methods r3 --set r3.quant=crot-k3v4 --set r3.q_rank=blend --set r3.q_frac=0.85 --out runs/dev26/aware4k-b01-k3v4
$D --methods r3 --set r3.quant=crot-k4v4 --set r3.q_rank=blend --set r3.q_frac=0.85 --out runs/dev26/aware4k-b01-k4v4
# where the answers sit after the prefill, default against R2 (the development samples of the cells above)
python bench/answer_tiers.py --tasks niah_single_2,niah_multikey_2,niah_multivalue --length 4096 --budget 0.1 \
  --methods "qevict;r2" --samples 10 --seed 1000 > docs/results/dev26/answer-tiers-4k-b01.md
# the default with the p-norm ranking (sum over the observation queries of each window's mass cubed) at 4K,
# then at 2K in both modes
$D --methods r3 --set r3.quant=crot-k4v3 --set r3.q_rank=blend --set r3.q_frac=0.85 --set r3.ranking=pnorm --out runs/dev26/aware4k-b01-pnorm
D2="qevict eval ruler --tasks $T --samples 10 --max-new-tokens 48 --batch 10 --seed 1000 --lengths 2048 --no-progress"
P="--methods r3 --set r3.quant=crot-k4v3 --set r3.q_rank=blend --set r3.q_frac=0.85 --set r3.ranking=pnorm"
$D2 --budgets 0.2 --question-agnostic $P --out runs/dev26/qa2k-pnorm
$D2 --budgets 0.2,0.1 $P --out runs/dev26/aware2k-pnorm
# where the answers sit question-agnostic (the context prefilled before its question), 2K, β = 0.2
python bench/answer_tiers.py --tasks niah_single_2,niah_multikey_2,niah_multivalue --length 2048 --budget 0.2 \
  --methods "qevict;r2" --samples 10 --seed 1000 --question-agnostic > docs/results/dev26/answer-tiers-qa2k-b02.md
