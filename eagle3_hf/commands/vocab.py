"""`eagle3-hf vocab`: build the draft vocabulary (d2t/t2d) from tokenised data (`eagle3_hf.training.vocab`).

The vocabulary is counted on every training conversation; the held-out ones (chosen by id hash,
`eagle3_hf.training.split`) measure how much of the target's output each candidate size covers, and ``auto`` picks
the smallest size that covers ``--min-coverage`` of it.
"""

from __future__ import annotations

import argparse

from eagle3_hf.commands import add_thinking_argument, say
from eagle3_hf.commands.options import add_target_argument
from eagle3_hf.training.arguments import DEFAULT_HELD_OUT_FRACTION, DEFAULT_MIN_COVERAGE


def draft_vocab_size_arg(value: str) -> int | str:
    """argparse type of ``--draft-vocab-size``: a positive integer or ``auto``."""
    if value == "auto":
        return value
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return size


def add_vocab_size_arguments(parser: argparse.ArgumentParser, default: int | str | None) -> None:
    """``--draft-vocab-size``, ``--min-coverage`` and ``--held-out-fraction``."""
    parser.add_argument(
        "--draft-vocab-size",
        type=draft_vocab_size_arg,
        default=default,
        help="draft head size, or 'auto': the smallest of 4096/8192/16384/32768 whose held-out coverage of the "
        "target's tokens reaches --min-coverage",
    )
    parser.add_argument(
        "--min-coverage",
        type=float,
        default=DEFAULT_MIN_COVERAGE,
        help="held-out coverage --draft-vocab-size auto must reach",
    )
    parser.add_argument(
        "--held-out-fraction",
        type=float,
        default=DEFAULT_HELD_OUT_FRACTION,
        help="share of conversations (by id hash) held out to measure coverage",
    )


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser, default=None, required=True, use="its tokenizer and vocabulary")
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="conversations: ShareGPT/messages/Alpaca JSON(L) or folders of shards; several are joined",
    )
    parser.add_argument("--output", required=True, help="safetensors file to write (d2t, t2d, counts)")
    add_vocab_size_arguments(parser, default="auto")
    parser.add_argument(
        "--max-length", type=int, default=2048, help="tokens per conversation counted (longer: truncated)"
    )
    add_thinking_argument(parser)
    parser.add_argument("--max-conversations", type=int, default=None, help="read at most this many (default: all)")
    parser.add_argument("--overwrite-output-dir", action="store_true", help="replace an existing --output file")


def run_cli(args: argparse.Namespace) -> int:
    from eagle3_hf.utils.outputs import check_output_file, staged_file

    check_output_file(args.output, args.overwrite_output_dir, "--output")
    from transformers import AutoConfig

    from eagle3_hf.targets import load_tokenizer, resolve_target
    from eagle3_hf.training.tokenise import tokenise_data
    from eagle3_hf.training.vocab import save_draft_vocab, select_draft_vocab

    tokenizer = load_tokenizer(args.target)
    dataset, _ = tokenise_data(
        tokenizer, args.data, args.max_length, args.max_conversations, enable_thinking=args.enable_thinking
    )
    # The model's vocabulary (what t2d must cover) can be larger than the tokenizer's: read it from the config.
    directory, gguf_file = resolve_target(args.target)
    config = AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    choice = select_draft_vocab(
        dataset,
        config.get_text_config().vocab_size,
        args.draft_vocab_size,
        args.min_coverage,
        args.held_out_fraction,
    )
    vocab = choice.vocab
    with staged_file(args.output) as temporary:
        save_draft_vocab(temporary, vocab)
    say(choice.table())
    say(
        f"Draft vocabulary of {vocab.draft_vocab_size} ids written to {args.output}: it covers "
        f"{100 * vocab.coverage:.2f}% "
        f"of the training conversations' supervised tokens ({vocab.num_seen} distinct ids seen, "
        f"{vocab.num_padded} padded)."
    )
    return 0
