"""`eagle3-hf features`: precompute target features for offline training (`eagle3_hf.training.features`)."""

from __future__ import annotations

import argparse

from eagle3_hf.commands import add_thinking_argument, say
from eagle3_hf.commands.options import add_target_argument
from eagle3_hf.training.arguments import DEFAULT_HELD_OUT_FRACTION, DEFAULT_TOP_K, SPLITS

DTYPES = ["float32", "bfloat16", "float16"]


def add_storage_arguments(parser: argparse.ArgumentParser) -> None:
    """What a features folder stores (`--logits-top-k`, `--layer-ids`, `--storage-dtype`) and which conversations
    are held out (`--held-out-fraction`): shared by `features` and `regenerate --save-features`."""
    parser.add_argument(
        "--logits-top-k",
        type=int,
        default=DEFAULT_TOP_K,
        help="target logits kept per token (the largest, over the full vocabulary, with their ids); "
        "they serve any draft vocabulary",
    )
    parser.add_argument(
        "--held-out-fraction",
        type=float,
        default=DEFAULT_HELD_OUT_FRACTION,
        help="share of conversations (by id hash) held out; must match training's",
    )
    parser.add_argument(
        "--layer-ids", default=None, help="three comma-separated output_hidden_states indices (default 2,L//2,L-3)"
    )
    parser.add_argument("--storage-dtype", default="bfloat16", choices=DTYPES, help="dtype of the features on disk")


def parse_layer_ids(text: str | None) -> list[int] | None:
    """`--layer-ids` "2,4,5" -> [2, 4, 5]; None stays None (the default taps)."""
    if not text:
        return None
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise ValueError(f"--layer-ids must be three comma-separated integers, got {text!r}.") from None


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser, default=None, required=True)
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="conversations: ShareGPT/messages/Alpaca JSON(L) or folders of shards; several are joined",
    )
    parser.add_argument("--output", required=True, help="folder for the feature shards (resumable)")
    add_storage_arguments(parser)
    parser.add_argument(
        "--split",
        choices=SPLITS,
        default="train",
        help="train: leave out the held-out conversations (by id hash); held-out: only those (for "
        "`train --eval-features`); all: every one",
    )
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (longer: truncated)")
    add_thinking_argument(parser)
    parser.add_argument("--max-conversations", type=int, default=None, help="read at most this many (default: all)")
    parser.add_argument(
        "--shard-size", type=int, default=256, help="conversations per shard (the most work an interruption can lose)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="conversations per target forward (those of similar lengths together, so little is padding)",
    )
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype the target runs in")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, ...; under torchrun each process takes its local device (cuda:LOCAL_RANK)",
    )
    parser.add_argument(
        "--device-map",
        default=None,
        help='"auto": spread the target over the devices of the '
        "machine (accelerate big-model inference), for targets one device cannot hold",
    )


def run_cli(args: argparse.Namespace) -> int:
    if args.max_length < 3:
        raise ValueError(f"--max-length must be >= 3 (the draft predicts tokens two ahead), got {args.max_length}.")
    import torch

    from eagle3_hf.targets import check_device, load_target, load_tokenizer
    from eagle3_hf.training.distributed import check_device_map, init_distributed_from_launcher, process_device
    from eagle3_hf.training.features import precompute_features
    from eagle3_hf.training.split import split_filter
    from eagle3_hf.training.tokenise import tokenise_data
    from eagle3_hf.utils.precision import emulated_bf16_warning

    check_device(args.device)
    if warning := emulated_bf16_warning(args.dtype, args.device):
        say(f"Warning: {warning}")
    layer_ids = parse_layer_ids(args.layer_ids)
    select = split_filter(args.split, args.held_out_fraction)
    tokenizer = load_tokenizer(args.target)
    dataset, _ = tokenise_data(
        tokenizer, args.data, args.max_length, args.max_conversations, select, enable_thinking=args.enable_thinking
    )
    init_distributed_from_launcher()  # under torchrun / accelerate launch each process writes its share of shards
    target = load_target(
        args.target,
        dtype=getattr(torch, args.dtype),
        device=process_device(args.device),
        device_map=check_device_map(args.device_map),
    )
    shards = precompute_features(
        target,
        dataset,
        args.output,
        layer_ids=layer_ids,
        shard_size=args.shard_size,
        top_k=args.logits_top_k,
        dtype=getattr(torch, args.storage_dtype),
        batch_size=args.batch_size,
        enable_thinking=args.enable_thinking,
    )
    say(f"{len(shards)} shards in {args.output}")
    return 0
