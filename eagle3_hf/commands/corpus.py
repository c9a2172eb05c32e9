"""`eagle3-hf corpus`: index the target's earlier answers for the context lookup (`eagle3_hf.generation.corpus_index`).

    eagle3-hf corpus --target smollm2 --data regen_sharegpt regen_alpaca --output corpus.safetensors

Reads `eagle3-hf regenerate` output folders (or any conversation files), tokenises their assistant answers as training
does (`eagle3_hf.training.corpus`), leaves out every conversation that asks an evaluation prompt (by default the
MT-bench questions `eagle3-hf bench` uses) and writes the index as one safetensors file (written as
``corpus.safetensors`` in a draft's folder, it is that draft's corpus).
"""

from __future__ import annotations

import argparse
import os

from eagle3_hf.commands import add_thinking_argument, say
from eagle3_hf.commands.options import add_target_argument

MT_BENCH = "mt-bench"  # stands for the MT-bench questions the benchmark reads by default


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_argument(parser, default=None, required=True, use="the one that wrote the answers (its tokenizer)")
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        help="`eagle3-hf regenerate` output folders (or conversation files) whose answers are indexed",
    )
    parser.add_argument(
        "--output",
        required=True,
        help="safetensors file to write (corpus.safetensors in a draft folder: the draft's corpus)",
    )
    parser.add_argument(
        "--exclude-prompts",
        nargs="*",
        default=[MT_BENCH],
        metavar="FILE",
        help=f"evaluation prompts whose conversations are left out (a user turn equal to one, case and whitespace "
        f"aside): MT-bench question.jsonl files or conversation files, {MT_BENCH!r} for the MT-bench questions "
        f"`eagle3-hf bench` uses (default: {MT_BENCH}); the option with no file leaves nothing out",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=64,
        help="longest match a query can find, in tokens (the index is sorted this deep)",
    )
    parser.add_argument("--num-proc", type=int, default=None, help="processes that tokenise (default: this one)")
    add_thinking_argument(parser)
    parser.add_argument("--overwrite-output-dir", action="store_true", help="replace an existing --output file")


def check_arguments(args: argparse.Namespace) -> list[str]:
    """Refuse what is wrong before torch loads; return the evaluation prompt files to read."""
    from eagle3_hf.modeling.shipped import default_prompts_path
    from eagle3_hf.utils.hub import is_hub_id
    from eagle3_hf.utils.outputs import check_output_file

    if args.depth < 1:
        raise ValueError(f"--depth must be >= 1, got {args.depth}.")
    if args.num_proc is not None and args.num_proc < 1:
        raise ValueError(f"--num-proc must be >= 1, got {args.num_proc}.")
    check_output_file(args.output, args.overwrite_output_dir, "--output")
    for path in args.data:
        if not os.path.exists(path) and not is_hub_id(path):
            raise ValueError(f"--data {path!r}: no such file or folder (expected `eagle3-hf regenerate` output).")
    prompt_files = [default_prompts_path() if p == MT_BENCH else p for p in args.exclude_prompts]
    for path in prompt_files:
        if not os.path.exists(path):
            raise ValueError(f"--exclude-prompts {path!r}: no such file or folder.")
    return prompt_files


def run_cli(args: argparse.Namespace) -> int:
    prompt_files = check_arguments(args)
    import time

    from eagle3_hf.generation.corpus_index import CorpusIndex
    from eagle3_hf.targets import load_tokenizer, target_hub_id
    from eagle3_hf.training.corpus import corpus_documents
    from eagle3_hf.training.prompt_selection import read_evaluation_prompts
    from eagle3_hf.utils.outputs import staged_file

    prompts = read_evaluation_prompts(prompt_files) if prompt_files else set()
    if not prompt_files:
        say(
            "Warning: no evaluation prompts left out (--exclude-prompts with no file); a benchmark on prompts whose "
            "answers are in the corpus measures recall, not speed-up."
        )
    tokenizer = load_tokenizer(args.target)
    start = time.perf_counter()
    documents, stats = corpus_documents(
        tokenizer, args.data, exclude=prompts, num_proc=args.num_proc, enable_thinking=args.enable_thinking
    )
    tokenised = time.perf_counter() - start
    metadata = {
        "target": args.target,
        "target_hub_id": target_hub_id(args.target),
        "data": [os.path.basename(os.path.normpath(p)) for p in args.data],
        "exclude_prompts": [os.path.basename(p) for p in prompt_files],
        **stats.to_dict(),
    }
    start = time.perf_counter()
    index = CorpusIndex.build(documents, vocab_size=len(tokenizer), depth=args.depth, metadata=metadata)
    built = time.perf_counter() - start
    with staged_file(args.output) as temporary:
        index.save(temporary)
    say(
        f"left out {stats.conversations_excluded} of {stats.conversations_read} conversations that ask an "
        f"evaluation prompt"
    )
    say(
        f"Corpus of {index.num_tokens} tokens in {index.num_documents} answers written to {args.output}: "
        f"{index.nbytes} bytes ({index.nbytes / index.num_tokens:.1f} per token); tokenised in {tokenised:.1f} s, "
        f"built in {built:.2f} s."
    )
    return 0
