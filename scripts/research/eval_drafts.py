"""Held-out training-time-test accuracy of several drafts, side by side (`eagle3-hf evaluate` as a script).

Each draft runs `--ttt-length` steps on its own states (as when drafting) over conversations no draft was trained on,
with `eagle3_hf.training.evaluation.evaluate_draft`: acc_j is the share of supervised tokens where step j's top token
is the target's top token over its full vocabulary (tokens the draft vocabulary cannot hold count as misses), beside
the vocabulary's coverage and the simulated acceptance length. This measures many more tokens than a 10-prompt
benchmark, so small differences between drafts (the ablations of scripts/research/ablations_smollm2.sh) stand out.

Usage (the held-out split of the regenerated data, then MT-bench turn 1 answered by the target):
    python scripts/research/eval_drafts.py --target smollm2 --data work_data/regen_sharegpt work_data/regen_alpaca \
        work_data/ablations/fused_ttt7_all work_data/ablations/fused_ttt1_all ...
    python scripts/research/eval_drafts.py --target smollm2 --data work_data/regen_mtbench --split all DRAFT ...
"""

import argparse
import json

import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.bench.cards import format_evaluation_table
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.training.evaluation import evaluate_draft
from eagle3_hf.training.split import split_filter
from eagle3_hf.training.tokenise import tokenise_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafts", nargs="+", help="draft folders")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--data", required=True, nargs="+", help="conversations answered by the target")
    parser.add_argument("--split", default="held-out", choices=["held-out", "all"])
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--max-length", type=int, default=384)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--json", default=None, help="write {draft: metrics} here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype)
    tokenizer = load_tokenizer(args.target)
    dataset, _ = tokenise_data(tokenizer, args.data, args.max_length, args.max_conversations, split_filter(args.split))
    results = {}
    for path in args.drafts:
        draft = Eagle3DraftModel.from_pretrained(path, target=target, dtype=dtype)
        results[path] = evaluate_draft(draft, target, dataset, args.ttt_length, args.batch_size, progress=True)
    print(format_evaluation_table(results, first_column="draft"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
