#!/usr/bin/env bash
# The paper's three mechanism claims at this project's scale, on SmolLM2-135M-Instruct:
#   (a) TTT keeps acceptance flat with depth; without it (--ttt-length 1) acceptance falls off,
#   (b) acceptance rises with training data (three data sizes, same number of steps),
#   (c) fused low/mid/high taps beat the top layer alone.
# Every run trains from scratch with the same small budget (STEPS steps of 2 conversations cut to 256 tokens,
# 8,192-token draft vocabulary) on the regenerated ShareGPT answers of examples/train_smollm2.sh, then measures
# the EAGLE-3 chain (fixed depth 6) on 10 MT-bench turn-1 prompts x 128 new tokens. Finished runs are skipped,
# so the script resumes where it stopped.
set -euo pipefail
OUT=${OUT:-work_data}
STEPS=${STEPS:-500}
# Exactly the 2,052 conversations of the first committed archive (later archives add more; the results in
# scripts/research/results/ablations used these).
DATA="$OUT/ablation_data/regen_sharegpt"
if [ ! -d "$DATA" ]; then
  mkdir -p "$OUT/ablation_data" && tar xzf examples/data/smollm2_sharegpt_regen.tar.gz -C "$OUT/ablation_data"
fi

run() {  # name, extra train flags...
  local name=$1; shift
  local dir="$OUT/ablations/$name"
  if [ ! -f "$dir/config.json" ]; then
    eagle3-hf train --target smollm2 --data "$DATA" --output "$dir" --max-steps "$STEPS" --batch-size 2 \
      --max-length 256 --draft-vocab-size 8192 --learning-rate 5e-4 --dtype bfloat16 --logging-steps 50 \
      --save-steps 100 --resume "$@"
  fi
  if [ ! -f "$dir/bench.json" ]; then
    eagle3-hf bench --target smollm2 --draft "$dir" --methods eagle3_chain --num-prompts 10 \
      --max-new-tokens 128 --json "$dir/bench.json"
  fi
}

run fused_ttt7_all --ttt-length 7                                       # the baseline of (a), (b), (c)
run fused_ttt1_all --ttt-length 1                                       # (a) no training-time test
run top_ttt7_all --ttt-length 7 --target-layer-ids 30,30,30             # (c) the top layer only
run fused_ttt7_128 --ttt-length 7 --max-conversations 128               # (b) 1/16 of the data
run fused_ttt7_512 --ttt-length 7 --max-conversations 512               # (b) 1/4 of the data

python scripts/research/ablation_table.py "$OUT/ablations"
