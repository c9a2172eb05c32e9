"""`eagle3-hf regenerate`: re-answer the training prompts with the target (`eagle3_hf.training.regenerate`)."""

from __future__ import annotations

import argparse

from eagle3_hf.commands import add_thinking_argument, say
from eagle3_hf.commands.features import add_storage_arguments, parse_layer_ids
from eagle3_hf.commands.options import TARGET_HELP


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help=TARGET_HELP)
    parser.add_argument("--data", required=True, help="conversations: ShareGPT/messages/Alpaca JSON or JSONL")
    parser.add_argument("--output", required=True, help="folder for the regenerated JSONL shards (resumable)")
    parser.add_argument("--max-conversations", type=int, default=None, help="read at most this many conversations")
    parser.add_argument("--skip-conversations", type=int, default=0, help="skip this many conversations first")
    parser.add_argument("--max-rounds", type=int, default=None, help="keep only the first N user turns of each")
    parser.add_argument(
        "--dedupe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="answer each distinct sequence of prompts once: drop conversations whose prompts repeat an earlier "
        "one's or open a longer one's (after --max-rounds)",
    )
    parser.add_argument(
        "--exclude-prompts",
        nargs="+",
        default=[],
        metavar="FILE",
        help="evaluation prompts to keep out of the answers: MT-bench question.jsonl files or conversation files; "
        "a conversation with a user turn equal to one of them (case and whitespace aside) is dropped",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="prompts answered together")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="most new tokens of each answer")
    parser.add_argument(
        "--max-prompt-length",
        type=int,
        default=2048,
        help="a conversation stops at the first turn whose prompt is longer (tokens)",
    )
    parser.add_argument(
        "--shard-size", type=int, default=256, help="conversations per shard (the most work an interruption can lose)"
    )
    parser.add_argument("--do-sample", action="store_true", help="sample answers instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (with --do-sample)")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype the target runs in"
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps, ...")
    parser.add_argument("--seed", type=int, default=0, help="random seed (sampling)")
    add_thinking_argument(parser)
    saving = parser.add_argument_group(
        "features saved while answering (read by `train --features`; equal to what `eagle3-hf features` computes "
        "from the answers, without a second forward pass)"
    )
    saving.add_argument(
        "--save-features",
        default=None,
        metavar="DIR",
        help="folder for the target's features of the training split's answers (resumable with the answers)",
    )
    saving.add_argument(
        "--save-eval-features",
        default=None,
        metavar="DIR",
        help="folder for those of the held-out split (for `train --eval-features`)",
    )
    saving.add_argument(
        "--features-max-length", type=int, default=2048, help="tokens per conversation stored (longer: cut)"
    )
    add_storage_arguments(saving)


def run_cli(args: argparse.Namespace) -> int:
    import torch

    from eagle3_hf.targets import check_device, load_target, load_tokenizer
    from eagle3_hf.training.manifest import check_manifest
    from eagle3_hf.training.prompt_selection import dedupe_prompts, exclude_prompts, read_evaluation_prompts
    from eagle3_hf.training.regenerate import (
        MANIFEST_NAME,
        data_fingerprint,
        regenerate_manifest,
        regenerate_responses,
        select_conversations,
    )
    from eagle3_hf.training.regenerate_features import SaveFeatures
    from eagle3_hf.utils.precision import emulated_bf16_warning

    check_device(args.device)
    save_features = None
    if args.save_features or args.save_eval_features:
        save_features = SaveFeatures(
            args.save_features,
            args.save_eval_features,
            held_out_fraction=args.held_out_fraction,
            max_length=args.features_max_length,
            layer_ids=parse_layer_ids(args.layer_ids),
            top_k=args.logits_top_k,
            dtype=getattr(torch, args.storage_dtype),
            batch_size=args.batch_size,
        )
    if warning := emulated_bf16_warning(args.dtype, args.device):
        say(f"Warning: {warning}")
    conversations = select_conversations(args.data, args.skip_conversations, args.max_conversations, args.max_rounds)
    if args.exclude_prompts:
        conversations, dropped = exclude_prompts(conversations, read_evaluation_prompts(args.exclude_prompts))
        say(f"left out {dropped} conversations that ask an evaluation prompt")
    if args.dedupe:
        conversations, dropped = dedupe_prompts(conversations)
        say(f"left out {dropped} conversations whose prompts another one asks already")
    # The data set is known by its first conversation, whatever --skip-conversations leaves out.
    fingerprint = data_fingerprint(select_conversations(args.data, 0, 1, args.max_rounds), args.max_rounds)
    manifest = regenerate_manifest(
        fingerprint,
        args.max_new_tokens,
        args.do_sample,
        args.temperature,
        args.max_prompt_length,
        args.seed,
        args.enable_thinking,
    )
    check_manifest(args.output, MANIFEST_NAME, manifest, "answers")  # before the target is loaded
    model = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    tokenizer = load_tokenizer(args.target)
    shards = regenerate_responses(
        model,
        tokenizer,
        conversations,
        args.output,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        shard_size=args.shard_size,
        max_prompt_length=args.max_prompt_length,
        seed=args.seed,
        fingerprint=fingerprint,
        enable_thinking=args.enable_thinking,
        save_features=save_features,
    )
    say(f"{len(shards)} shards in {args.output}")
    for folder in (args.save_features, args.save_eval_features):
        if folder:
            say(f"features of their answers in {folder}")
    return 0
