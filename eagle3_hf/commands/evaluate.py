"""`eagle3-hf evaluate`: full-vocabulary TTT accuracy of drafts on conversations training never saw
(`eagle3_hf.training.evaluation`).

    eagle3-hf evaluate --target smollm2 --draft DIR [DIR ...] --data work_data/regen_sharegpt   # held-out split
    eagle3-hf evaluate --target smollm2 --draft DIR --data work_data/regen_mtbench --split all   # MT-bench turn 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from eagle3_hf.bench.cards import EVALUATION_NAME, format_evaluation_table
from eagle3_hf.commands import add_thinking_argument, say
from eagle3_hf.commands.options import add_target_argument
from eagle3_hf.training.arguments import DEFAULT_HELD_OUT_FRACTION


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser)
    parser.add_argument("--draft", nargs="+", default=[None], help="draft folders (default: the shipped draft)")
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="conversations answered by the target: JSON(L) or folders of shards (such as "
        "regen_mtbench/ from examples/data/smollm2_mtbench_turn1_regen.tar.gz)",
    )
    parser.add_argument(
        "--split",
        choices=("held-out", "all"),
        default="held-out",
        help="held-out: only the conversations training leaves out (by id hash); all: every one "
        "(data no draft was trained on, such as MT-bench)",
    )
    parser.add_argument(
        "--held-out-fraction",
        type=float,
        default=DEFAULT_HELD_OUT_FRACTION,
        help="share of conversations (by id hash) training held out (as in training)",
    )
    parser.add_argument("--max-conversations", type=int, default=None, help="evaluate at most this many")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (longer: cut)")
    add_thinking_argument(parser)
    parser.add_argument("--ttt-length", type=int, default=7, help="draft steps unrolled per position (each scored)")
    parser.add_argument("--batch-size", type=int, default=4, help="conversations per forward")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the target and the draft (a GGUF target computes in float32 anyway)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps")
    parser.add_argument("--json", default=None, help="write {draft: metrics} here")
    parser.add_argument("--overwrite-output-dir", action="store_true", help="replace an existing --json file")
    parser.add_argument(
        "--record",
        default=None,
        metavar="LABEL",
        help=f"also keep the metrics in each draft folder's {EVALUATION_NAME} under LABEL (e.g. "
        "'MT-bench turn 1'); its model card shows them",
    )


def run_cli(args: argparse.Namespace) -> int:
    from eagle3_hf.utils.outputs import check_output_file, staged_file

    if args.json:
        check_output_file(args.json, args.overwrite_output_dir, "--json")
    import torch

    from eagle3_hf.draft_names import load_draft_for
    from eagle3_hf.modeling.shipped import shipped_draft_path
    from eagle3_hf.targets import load_target, load_tokenizer
    from eagle3_hf.training.evaluation import evaluate_draft
    from eagle3_hf.training.split import split_filter
    from eagle3_hf.training.tokenise import tokenise_data
    from eagle3_hf.utils.precision import emulated_bf16_warning

    try:
        select = split_filter(args.split, args.held_out_fraction)
        tokenizer = load_tokenizer(args.target)
        dataset, _ = tokenise_data(
            tokenizer, args.data, args.max_length, args.max_conversations, select, enable_thinking=args.enable_thinking
        )
        if warning := emulated_bf16_warning(args.dtype, args.device):
            say(f"Warning: {warning}")
        dtype = getattr(torch, args.dtype)
        target = load_target(args.target, dtype=dtype, device=args.device)
        results = {}
        for path in args.draft:
            draft = load_draft_for(args.target, target, path).to(device=args.device, dtype=dtype)
            metrics = evaluate_draft(draft, target, dataset, args.ttt_length, args.batch_size, progress=True)
            results[path or "shipped"] = {**metrics, "data": list(args.data), "split": args.split}
            if args.record:
                _record(path or shipped_draft_path(args.target), args.record, results[path or "shipped"])
    except ValueError as err:
        print(f"eagle3-hf evaluate: error: {err}", file=sys.stderr)
        return 2
    print(format_evaluation_table(results, first_column="draft"))
    if args.json:
        with staged_file(args.json) as temporary, open(temporary, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


def _record(draft_dir: str, label: str, metrics: dict) -> None:
    """Merge `metrics` into the draft folder's evaluation file under `label`."""
    path = os.path.join(draft_dir, EVALUATION_NAME)
    recorded = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            recorded = json.load(f)
    recorded[label] = metrics
    with open(path, "w", encoding="utf-8") as f:
        json.dump(recorded, f, indent=2)
