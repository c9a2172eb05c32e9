#!/usr/bin/env bash
# Issue #46 item 8: EAGLE-3 vs the EAGLE-3.1 flags (--fc-norm --norm-output), and the forward KL loss vs the
# acceptance-targeting LK loss, from the same data and the same starting point (a fresh draft, seed 0, target-derived
# init) at equal conversations (STEPS steps of 2), one thread per run so that the four arms cost the same CPU time.
# Each arm is evaluated the package's one way (teacher-forced step 0 and simulated acceptance on all 80 MT-bench
# first turns answered by the target) and by bench's EAGLE-3 chain (depth-1 acceptance and tau on 10 MT-bench
# prompts; speed is not read from it). Finished steps are skipped, so the script resumes where it stopped.
set -euo pipefail
OUT=${OUT:-work_data}
STEPS=${STEPS:-400}
DATA="$OUT/comparison_data/regen_sharegpt"
if [ ! -d "$DATA" ]; then
  mkdir -p "$OUT/comparison_data" && tar xzf examples/data/smollm2_sharegpt_regen.tar.gz -C "$OUT/comparison_data"
fi
if [ ! -d "$OUT/regen_mtbench" ]; then
  tar xzf examples/data/smollm2_mtbench_turn1_regen.tar.gz -C "$OUT"
fi
export OMP_NUM_THREADS=1

arm() {  # name, extra train flags...
  local name=$1; shift
  local dir="$OUT/comparison/$name"
  if [ ! -f "$dir/config.json" ]; then
    eagle3-hf train --target smollm2 --data "$DATA" --output "$dir" --max-steps "$STEPS" --batch-size 2 \
      --max-length 256 --draft-vocab-size 8192 --learning-rate 5e-4 --dtype bfloat16 --logging-steps 25 \
      --save-steps 100 --seed 0 --resume "$@"
  fi
  if [ ! -f "$dir/eval_mtbench.json" ]; then
    eagle3-hf evaluate --target smollm2 --draft "$dir" --data "$OUT/regen_mtbench" --split all \
      --record "MT-bench turn 1" --json "$dir/eval_mtbench.json" --overwrite-output-dir
  fi
  if [ ! -f "$dir/bench.json" ]; then
    eagle3-hf bench --target smollm2 --draft "$dir" --methods eagle3_chain --num-prompts 10 \
      --max-new-tokens 128 --repeats 1 --threads 1 --json "$dir/bench.json" --overwrite-output-dir
  fi
}

arm eagle3_forward_kl --loss forward_kl
arm eagle3_lk --loss lk
arm eagle31_forward_kl --loss forward_kl --fc-norm --norm-output
arm eagle31_lk --loss lk --fc-norm --norm-output
