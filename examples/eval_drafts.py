"""Held-out training-time-test accuracy of several drafts, side by side.

Each draft is run for `--ttt-length` steps on its own states (as when drafting) over held-out conversations, with
`Eagle3Trainer.evaluate`; acc_j is the share of supervised tokens where step j's top token is the target's. This
measures many more tokens than a 10-prompt benchmark, so small differences between drafts (the ablations of
examples/ablations_smollm2.sh) stand out from noise. Keep the held-out data out of every draft's training data.

Usage:
    python examples/eval_drafts.py --target smollm2 --data work_data/regen_alpaca --max-conversations 300 \
        work_data/ablations/fused_ttt7_all work_data/ablations/fused_ttt1_all ...
"""

import argparse
import json
import tempfile

import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.targets import load_target, load_tokenised_data
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments


def evaluate(draft_dir: str, target, dataset, ttt_length: int, batch_size: int, bf16: bool) -> dict[str, float]:
    draft = Eagle3DraftModel.from_pretrained(draft_dir, target=target, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as out:
        args = Eagle3TrainingArguments(
            out, ttt_length=ttt_length, per_device_eval_batch_size=batch_size, report_to="none", bf16=bf16,
            use_cpu=not torch.cuda.is_available(),
        )  # fmt: skip
        trainer = Eagle3Trainer(draft, args, target=target, eval_dataset=dataset)
        return trainer.evaluate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", help="draft folders")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", required=True, nargs="+", help="held-out conversations")
    parser.add_argument("--max-conversations", type=int, default=300)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--json", default=None, help="write {draft: metrics} here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype)
    _, dataset, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations)
    results = {d: evaluate(d, target, dataset, args.ttt_length, args.batch_size, dtype == torch.bfloat16)
               for d in args.drafts}  # fmt: skip
    steps = range(args.ttt_length)
    print("| draft | " + " | ".join(f"acc_{j}" for j in steps) + " | simulated acceptance length |")
    print("|---|" + "---|" * (args.ttt_length + 1))
    for d, m in results.items():
        accs = " | ".join(f"{m[f'eval_acc_{j}']:.3f}" for j in steps)
        print(f"| {d} | {accs} | {m['eval_sim_accept_len']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
