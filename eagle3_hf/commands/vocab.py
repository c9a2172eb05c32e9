"""`eagle3-hf vocab`: build the draft vocabulary (d2t/t2d) from tokenised data (`eagle3_hf.training.vocab`)."""

from __future__ import annotations

import argparse

from eagle3_hf.commands import say


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help='target (tokenizer and vocabulary): a folder, .gguf, "smollm2"')
    parser.add_argument("--data", required=True, nargs="+",
                        help="conversations: ShareGPT/messages/Alpaca JSON(L) or folders of shards; several are joined")
    parser.add_argument("--output", required=True, help="safetensors file to write (d2t, t2d, counts)")
    parser.add_argument("--draft-vocab-size", type=int, required=True)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--overwrite-output-dir", action="store_true", help="replace an existing --output file")


def run_cli(args: argparse.Namespace) -> int:
    from eagle3_hf.outputs import check_output_file, staged_file

    if args.draft_vocab_size < 1:
        raise ValueError(f"--draft-vocab-size must be >= 1, got {args.draft_vocab_size}.")
    check_output_file(args.output, args.overwrite_output_dir, "--output")
    from transformers import AutoConfig

    from eagle3_hf.targets import load_tokenised_data, resolve_target
    from eagle3_hf.training.vocab import build_draft_vocab, save_draft_vocab

    _, dataset, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations)
    # The model's vocabulary (what t2d must cover) can be larger than the tokenizer's: read it from the config.
    directory, gguf_file = resolve_target(args.target)
    config = AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    vocab = build_draft_vocab(dataset, config.get_text_config().vocab_size, args.draft_vocab_size)
    with staged_file(args.output) as temporary:
        save_draft_vocab(temporary, vocab)
    say(
        f"Draft vocabulary of {vocab.draft_vocab_size} ids written to {args.output}: it covers "
        f"{100 * vocab.coverage:.2f}% "
        f"of supervised tokens ({vocab.num_seen} distinct ids seen, {vocab.num_padded} padded)."
    )
    return 0
