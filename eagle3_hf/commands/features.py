"""`eagle3-hf features`: precompute target features for offline training (`eagle3_hf.training.features`)."""

from __future__ import annotations

import argparse

from eagle3_hf.commands import say

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
    parser.add_argument("--device", default="cpu")


def run_cli(args: argparse.Namespace) -> int:
    if args.max_length < 3:
        raise ValueError(f"--max-length must be >= 3 (the draft predicts tokens two ahead), got {args.max_length}.")
    import torch

    from eagle3_hf.targets import check_device, load_target, load_tokenised_data
    from eagle3_hf.training.features import precompute_features
    from eagle3_hf.training.vocab import build_draft_vocab, load_draft_vocab

    check_device(args.device)
    layer_ids = None
    if args.layer_ids:
        try:
            layer_ids = [int(i) for i in args.layer_ids.split(",")]
        except ValueError:
            raise ValueError(
                f"--layer-ids must be three comma-separated integers, got {args.layer_ids!r}."
            ) from None
    _, dataset, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations)
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    t2d = None
    if args.vocab:
        t2d = load_draft_vocab(args.vocab).t2d
    elif args.draft_vocab_size:
        vocab = build_draft_vocab(dataset, target.config.get_text_config().vocab_size, args.draft_vocab_size)
        say(f"Draft vocabulary: {args.draft_vocab_size} ids covering {100 * vocab.coverage:.2f}% of "
            "supervised tokens.")  # fmt: skip
        t2d = vocab.t2d
    shards = precompute_features(
        target, dataset, args.output, layer_ids=layer_ids, shard_size=args.shard_size, t2d=t2d,
        dtype=getattr(torch, args.storage_dtype), batch_size=args.batch_size,
    )  # fmt: skip
    say(f"{len(shards)} shards in {args.output}")
    return 0
