#!/usr/bin/env bash
# The GPU check: the device-parametrised generation, modeling and training tests on CUDA (fp32, fp16, bf16 where the
# GPU has it), then `eagle3-hf bench --device cuda` over 4 prompts, in under 10 minutes. On a machine without a CUDA
# GPU it runs the same tests' CPU half and prints what it would do on CUDA. Never a CI step: run it by hand.
#
#   scripts/gpu_check.sh                                         # from anywhere; uses `python` on PATH
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 scripts/gpu_check.sh
#
# Settings (environment): PYTHON, the interpreter whose environment holds eagle3-hf's dependencies and pytest;
# TORCH_INDEX_URL, the pip index of the CUDA torch build to install when the GPU is there but the installed torch
# cannot use it (a mirror or a local wheel folder works too: it is passed to pip as --index-url); and the time limits
# in seconds INSTALL_TIMEOUT, TESTS_TIMEOUT, BENCH_TIMEOUT (their defaults sum to 10 minutes).
# bench reads the SmolLM2 target and its shipped draft from this environment (nothing is downloaded for them).
# Exit code: 0 when every step passed, else the first failing step's.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu126}"
INSTALL_TIMEOUT="${INSTALL_TIMEOUT:-300}"
TESTS_TIMEOUT="${TESTS_TIMEOUT:-180}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}"
# This checkout's package, whatever an installed copy says.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The tests that take the `device` / `device_dtype` fixtures (tests/conftest.py), and two that exist only on CUDA.
TESTS=(
  tests/test_generation.py::test_greedy_matches_plain_generate
  tests/test_generation.py::test_half_precision_tokens_are_the_targets_greedy_choices_on_cuda
  tests/test_sync_count.py::test_a_cycle_transfers_a_bounded_number_of_times
  tests/test_sync_count.py::test_a_cycle_never_synchronises_outside_its_reads_on_cuda
  tests/test_modeling.py::test_from_target_builds_a_working_draft
  tests/test_trainer.py::test_training_lowers_the_loss_and_raises_acc0
)
BENCH=("$PYTHON" -m eagle3_hf.cli bench --device cuda --repeats 1 --num-prompts 4)

torch_has_cuda() {
  "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null
}

gpu_present() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

say() { printf '\n== %s\n' "$*"; }

"$PYTHON" -c "import eagle3_hf, pytest, torch" || {
  echo "gpu_check: $PYTHON cannot import eagle3_hf, pytest and torch; install the package's dependencies first." >&2
  exit 2
}

if ! gpu_present && ! torch_has_cuda; then
  say "No CUDA GPU here: the CPU half (the same tests on the CPU, in fp32)"
  timeout "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q "${TESTS[@]}" -k "cpu"
  cat <<EOF

== On a machine with a CUDA GPU this script would:
1. install a CUDA build of torch when the installed one cannot use the GPU:
   $PYTHON -m pip install --upgrade torch --index-url $TORCH_INDEX_URL   (at most ${INSTALL_TIMEOUT} s)
2. run the tests above on CUDA, at most ${TESTS_TIMEOUT} s:
   $PYTHON -m pytest -q ${TESTS[*]} -k cuda
   - greedy EAGLE-3 output identical to plain greedy decoding, 5 families x 5 tree shapes, fp32;
   - each emitted token the target's greedy choice up to rounding, 5 families, fp16 and bf16 (if supported);
   - a decoding cycle's transfers bounded (rows 1/4/8, trees of 30 and 60 nodes), and no synchronisation in a
     cycle but its counted reads (torch.cuda.set_sync_debug_mode("error"));
   - a draft's forward and cached step on the device in fp32, fp16 and bf16;
   - 80 training steps lowering the loss and raising acc_0, in fp32 and with fp16 / bf16 mixed precision;
3. benchmark SmolLM2-135M-Instruct with its shipped draft on CUDA, at most ${BENCH_TIMEOUT} s:
   ${BENCH[*]}
EOF
  exit 0
fi

if ! torch_has_cuda; then
  say "A GPU is here but this torch cannot use it: installing torch from $TORCH_INDEX_URL"
  timeout "$INSTALL_TIMEOUT" "$PYTHON" -m pip install --upgrade torch --index-url "$TORCH_INDEX_URL"
  torch_has_cuda || {
    echo "gpu_check: torch from $TORCH_INDEX_URL still cannot use the GPU (driver too old for that CUDA build?)." >&2
    exit 1
  }
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'on', torch.cuda.get_device_name(0),
      '(bf16:', torch.cuda.is_bf16_supported(), ')')"

say "The device tests on CUDA (fp32, fp16, bf16 where supported)"
timeout "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q "${TESTS[@]}" -k "cuda"

say "bench on CUDA: 4 prompts, 1 repeat"
timeout "$BENCH_TIMEOUT" "${BENCH[@]}"
