"""`eagle3-hf features`: precompute target features for offline training (`eagle3_hf.training.features`)."""

from __future__ import annotations

import argparse
import sys

import torch

from eagle3_hf.targets import load_target, load_tokenised_data
from eagle3_hf.training.features import DEFAULT_TOP_K, precompute_features
from eagle3_hf.training.split import DEFAULT_HELD_OUT_FRACTION, SPLITS, split_filter

DTYPES = ["float32", "bfloat16", "float16"]


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help='target model: a folder, a .gguf file, or "smollm2"')
    parser.add_argument("--data", required=True, nargs="+",
                        help="conversations: ShareGPT/messages/Alpaca JSON(L) or folders of shards; several are joined")
    parser.add_argument("--output", required=True, help="folder for the feature shards (resumable)")
    parser.add_argument("--logits-top-k", type=int, default=DEFAULT_TOP_K,
                        help="target logits kept per token (the largest, over the full vocabulary, with their ids); "
                        "they serve any draft vocabulary")  # fmt: skip
    parser.add_argument("--split", choices=SPLITS, default="train",
                        help="train: leave out the held-out conversations (by id hash); held-out: only those (for "
                        "`train --eval-features`); all: every one")  # fmt: skip
    parser.add_argument("--held-out-fraction", type=float, default=DEFAULT_HELD_OUT_FRACTION)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--layer-ids", default=None, help="three comma-separated output_hidden_states indices "
                        "(default 2,L//2,L-3)")  # fmt: skip
    parser.add_argument("--storage-dtype", default="bfloat16", choices=DTYPES, help="dtype on disk")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the target runs in")
    parser.add_argument("--device", default="cpu")


def run_cli(args: argparse.Namespace) -> int:
    try:
        layer_ids = None
        if args.layer_ids:
            try:
                layer_ids = [int(i) for i in args.layer_ids.split(",")]
            except ValueError:
                raise ValueError(
                    f"--layer-ids must be three comma-separated integers, got {args.layer_ids!r}."
                ) from None
        select = split_filter(args.split, args.held_out_fraction)
        _, dataset, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations, select)
        target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
        shards = precompute_features(
            target, dataset, args.output, layer_ids=layer_ids, shard_size=args.shard_size, top_k=args.logits_top_k,
            dtype=getattr(torch, args.storage_dtype), batch_size=args.batch_size,
        )  # fmt: skip
    except ValueError as err:
        print(f"eagle3-hf features: error: {err}", file=sys.stderr)
        return 2
    print(f"{len(shards)} shards in {args.output}")
    return 0
