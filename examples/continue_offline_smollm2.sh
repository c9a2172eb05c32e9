#!/usr/bin/env bash
# Continue the shipped SmolLM2-135M-Instruct draft on offline target features.
#
# The frozen target's forward is ~40% of an online training step on a CPU (0.74 s of ~1.95 s for 2 x 384 tokens in
# bf16). Computing its features once and reading them back every epoch removes that cost from every later step.
# The features keep the target's 64 largest logits per token over its full vocabulary (with their ids), so they
# serve the shipped draft's vocabulary or any other. Disk: ~3.8 KB per token in bf16 (1,728 tap values, 64 logits,
# 64 int32 ids), about 2.5 GiB for 3,051 conversations at <= 384 tokens; the size is printed (and checked) before
# writing. Folders written by older versions (draft-vocabulary logits) are refused: these are new folders.
# Every step resumes where it stopped.
set -euo pipefail
OUT=${OUT:-work_data}
DRAFT=${DRAFT:-eagle3_hf/drafts/smollm2-135m-instruct}

# 0. The regenerated answers committed in examples/data: smollm2_sharegpt_regen.tar.gz (2,052 ShareGPT) and
#    smollm2_alpaca_regen.tar.gz (999 Alpaca) are the data the draft was first trained on; the later
#    smollm2_sharegpt_regen_<k>.tar.gz archives hold ShareGPT conversations regenerated after them.
for name in sharegpt alpaca; do
  if [ ! -d "$OUT/regen_$name" ]; then
    mkdir -p "$OUT"
    for archive in examples/data/smollm2_"${name}"_regen*.tar.gz; do tar xzf "$archive" -C "$OUT"; done
  fi
done
# The shard files of the later archives, as paths under $OUT.
MORE=$(for archive in examples/data/smollm2_sharegpt_regen_*.tar.gz; do tar tzf "$archive"; done | grep '\.jsonl$' |
  sed "s|^|$OUT/|")

# 1. Target features, once (the target runs in bf16, as in online bf16 training): the first data set in one folder,
#    the later conversations in another, so that adding data never recomputes the older features. Both leave out the
#    held-out conversations (2%, by a hash of their id); a third folder holds those, for evaluation while training.
FIRST=$(tar tzf examples/data/smollm2_sharegpt_regen.tar.gz | grep '\.jsonl$' | sed "s|^|$OUT/|")
# shellcheck disable=SC2086  # the shard lists are meant to split into one argument per file
eagle3-hf features --target smollm2 --data $FIRST "$OUT/regen_alpaca" --output "$OUT/features_top64_all" \
  --logits-top-k 64 --max-length 384 --shard-size 128 --batch-size 4 --dtype bfloat16 --storage-dtype bfloat16
# shellcheck disable=SC2086
eagle3-hf features --target smollm2 --data $MORE --output "$OUT/features_top64_more" \
  --logits-top-k 64 --max-length 384 --shard-size 128 --batch-size 4 --dtype bfloat16 --storage-dtype bfloat16
# shellcheck disable=SC2086
eagle3-hf features --target smollm2 --data $FIRST "$OUT/regen_alpaca" $MORE --output "$OUT/features_top64_heldout" \
  --split held-out --logits-top-k 64 --max-length 384 --batch-size 4 --dtype bfloat16 --storage-dtype bfloat16

# 1b. The draft vocabulary counted on all the training conversations; `auto` prints the held-out coverage of
#     4,096-32,768 ids and takes the smallest covering 95% of the target's tokens.
# shellcheck disable=SC2086
eagle3-hf vocab --target smollm2 --data $FIRST "$OUT/regen_alpaca" $MORE --output "$OUT/vocab_auto.safetensors" \
  --max-length 384 --overwrite-output-dir

# 2. Continue the draft from its saved weights on both folders, moved to that vocabulary (tokens it shares with the
#    shipped draft's keep their head rows, new ones start at zero, so the draft first drafts what it drafted). One
#    run, one cosine schedule with warmup over --max-steps: --resume continues it; starting it again would restart
#    the schedule. The new folder is named twice, so its conversations are drawn twice as often as the ones the
#    draft has already seen. Every 500 steps it is evaluated on the held-out conversations (eval_acc_j,
#    eval_coverage, eval_sim_accept_len).
eagle3-hf train --target smollm2 --features "$OUT/features_top64_all" "$OUT/features_top64_more" \
  "$OUT/features_top64_more" \
  --output "$OUT/draft_offline" \
  --init-draft "$DRAFT" --vocab "$OUT/vocab_auto.safetensors" --eval-features "$OUT/features_top64_heldout" \
  --eval-steps 500 --max-steps "${STEPS:-2000}" --ttt-length 7 --batch-size 2 --learning-rate 3e-4 \
  --dtype bfloat16 --save-steps 100 --logging-steps 50 --resume

# 3. The one evaluation (full-vocabulary accuracy by TTT step, coverage, simulated acceptance length) on the held-out
#    conversations and on MT-bench turn 1 answered by the target; --record keeps it for the draft's model card.
tar xzf examples/data/smollm2_mtbench_turn1_regen.tar.gz -C "$OUT"
# shellcheck disable=SC2086
eagle3-hf evaluate --target smollm2 --draft "$OUT/draft_offline" --data $FIRST "$OUT/regen_alpaca" $MORE \
  --max-length 384 --record "held-out regenerated ShareGPT and Alpaca" --json "$OUT/eval_heldout.json" --overwrite-output-dir
eagle3-hf evaluate --target smollm2 --draft "$OUT/draft_offline" --data "$OUT/regen_mtbench" --split all \
  --record "MT-bench turn 1 (80 questions, the target's answers)" --json "$OUT/eval_mtbench.json" --overwrite-output-dir

# 4. Measure it against plain generate and prompt lookup on 10 MT-bench prompts.
eagle3-hf bench --target smollm2 --draft "$OUT/draft_offline" --num-prompts 10 --max-new-tokens 128 \
  --json "$OUT/bench_offline.json" --plot "$OUT/acceptance_offline.png" --overwrite-output-dir
