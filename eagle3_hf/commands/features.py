"""`eagle3-hf features`: precompute target features for offline training (`eagle3_hf.training.features`)."""

from __future__ import annotations

import argparse
import sys

import torch

from eagle3_hf.targets import load_target, load_tokenised_data
from eagle3_hf.training.distributed import check_device_map, init_distributed_from_launcher, process_device
from eagle3_hf.training.features import precompute_features
from eagle3_hf.training.vocab import build_draft_vocab, load_draft_vocab

DTYPES = ["float32", "bfloat16", "float16"]


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help='target model: a folder, a .gguf file, or "smollm2"')
    parser.add_argument("--data", required=True, nargs="+",
                        help="conversations: ShareGPT/messages/Alpaca JSON(L) or folders of shards; several are joined")
    parser.add_argument("--output", required=True, help="folder for the feature shards (resumable)")
    vocab = parser.add_mutually_exclusive_group()
    vocab.add_argument("--draft-vocab-size", type=int, default=None, help="build a draft vocabulary of this size")
    vocab.add_argument("--vocab", default=None, help="draft vocabulary: a file written by `eagle3-hf vocab`, or a "
                       "saved draft folder (to continue that draft with `train --init-draft`)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--layer-ids", default=None, help="three comma-separated output_hidden_states indices "
                        "(default 2,L//2,L-3)")  # fmt: skip
    parser.add_argument("--storage-dtype", default="bfloat16", choices=DTYPES, help="dtype on disk")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the target runs in")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, ...; under torchrun each process takes its local "
                        "device (cuda:LOCAL_RANK)")  # fmt: skip
    parser.add_argument("--device-map", default=None, help='"auto": spread the target over the devices of the '
                        "machine (accelerate big-model inference), for targets one device cannot hold")  # fmt: skip


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
        _, dataset, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations)
        init_distributed_from_launcher()  # under torchrun / accelerate launch each process writes its share of shards
        target = load_target(args.target, dtype=getattr(torch, args.dtype), device=process_device(args.device),
                             device_map=check_device_map(args.device_map))  # fmt: skip
        t2d = None
        if args.vocab:
            t2d = load_draft_vocab(args.vocab).t2d
        elif args.draft_vocab_size:
            vocab = build_draft_vocab(dataset, target.config.get_text_config().vocab_size, args.draft_vocab_size)
            print(f"Draft vocabulary: {args.draft_vocab_size} ids covering {100 * vocab.coverage:.2f}% of "
                  "supervised tokens.")  # fmt: skip
            t2d = vocab.t2d
        shards = precompute_features(
            target, dataset, args.output, layer_ids=layer_ids, shard_size=args.shard_size, t2d=t2d,
            dtype=getattr(torch, args.storage_dtype), batch_size=args.batch_size,
        )  # fmt: skip
    except ValueError as err:
        print(f"eagle3-hf features: error: {err}", file=sys.stderr)
        return 2
    print(f"{len(shards)} shards in {args.output}")
    return 0
