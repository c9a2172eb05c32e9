"""`eagle3-hf` command line: one subcommand per step of the data flow.

Each subcommand has a module in `eagle3_hf.commands`, which exposes `add_cli_arguments(parser)` and
`run_cli(args) -> int` (or, for `train`, its own `parse_cli`). Every subcommand accepts `--config FILE` (a JSON or
YAML mapping of option names to values, required options included; flags given on the command line win).

Errors a user can fix (a wrong path or value, a missing package, a mismatched draft) print one line
`eagle3-hf COMMAND: error: ...` and exit with code 2; `--debug` shows the traceback instead. Nothing here imports
torch or transformers: the subcommands do, when they run, so that `--help` and `--version` are instant, and what can
be checked without them (the subcommand's name, `--target`, each command's ranges) is checked first.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

from eagle3_hf import __version__
from eagle3_hf.commands import CommandParser, apply_config, load_config_file, split_config

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "regenerate": ("eagle3_hf.commands.regenerate", "re-answer training prompts with the target model"),
    "corpus": ("eagle3_hf.commands.corpus", "index the target's regenerated answers for the context lookup"),
    "vocab": ("eagle3_hf.commands.vocab", "build the draft vocabulary (d2t/t2d) from tokenised data"),
    "features": ("eagle3_hf.commands.features", "precompute target features (offline training) to safetensors shards"),
    "train": ("eagle3_hf.commands.train", "train an EAGLE-3 draft with Trainer.train() and the TTT loss"),
    "evaluate": ("eagle3_hf.commands.evaluate", "full-vocabulary TTT accuracy of drafts on held-out conversations"),
    "generate": ("eagle3_hf.commands.generate", "generate with a target and its EAGLE-3 draft"),
    "bench": ("eagle3_hf.commands.bench", "benchmark EAGLE-3 against the fastest plain decoding (fp32 and bf16)"),
    "convert": (
        "eagle3_hf.commands.convert",
        "convert a draft checkpoint between native, speculators and official layouts",
    ),
}
# Errors that come from what the user typed or has installed: one line, exit code 2.
USER_ERRORS = (ValueError, ImportError, OSError)
DEBUG_FLAG = "--debug"


def version_line() -> str:
    """`eagle3-hf X (transformers Y, torch Z)`, read from the installed metadata without importing them."""
    found = []
    for name in ("transformers", "torch"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return f"eagle3-hf {__version__} ({', '.join(found)})"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand's own options are added only when it runs (cheap `--help`)."""
    parser = CommandParser(
        prog="eagle3-hf",
        description="EAGLE-3 speculative decoding for transformers.",
        epilog=f"Run `eagle3-hf COMMAND --help` for a command's options. {DEBUG_FLAG} (anywhere) shows the traceback "
        "of an error instead of one line.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def build_subparser(command: str) -> argparse.ArgumentParser:
    module_name, help_text = SUBCOMMANDS[command]
    parser = CommandParser(prog=f"eagle3-hf {command}", description=help_text)
    parser.add_argument("--config", default=None, help="JSON/YAML file of option values (flags given here win)")
    importlib.import_module(module_name).add_cli_arguments(parser)
    return parser


def parse_command(command: str, argv: Sequence[str]) -> argparse.Namespace:
    """Parse a subcommand's arguments, `--config` file included."""
    module = importlib.import_module(SUBCOMMANDS[command][0])
    if hasattr(module, "parse_cli"):  # `train`: an HfArgumentParser over TrainingArguments
        return module.parse_cli(argv)
    config, rest = split_config(argv)
    parser = build_subparser(command)
    if config is not None:
        apply_config(parser, load_config_file(config), config)
    return parser.parse_args(rest)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `eagle3-hf` command line; returns its exit code.

    Without `argv` this is the program (the `eagle3-hf` script, `python -m eagle3_hf.cli`, a `torchrun` or
    `accelerate launch` worker): the process group a command joined is then torn down before returning, after every
    process has finished (see `end_distributed`). With `argv` (a caller running several commands in one process)
    the group is left to the caller, which may run another command in it.
    """
    program = argv is None
    code = 1
    try:
        code = _run(list(sys.argv[1:] if argv is None else argv))
        return code
    finally:
        if program:
            _end_distributed(finished=code == 0)


def _end_distributed(finished: bool) -> None:
    # Only a command that imported torch.distributed can have joined a group; --help and --version never load torch.
    if "torch.distributed" in sys.modules:
        from eagle3_hf.training.distributed import end_distributed

        end_distributed(finished)


def check_target_name(args: argparse.Namespace) -> None:
    """Refuse a `--target` that names nothing (with the closest short name, where one is close) before the command
    runs: the commands import torch and transformers first, which takes seconds, and a typo deserves an answer at
    once. `eagle3_hf.target_names` imports neither."""
    from eagle3_hf.target_names import resolve_target

    target = getattr(args, "target", None)
    if isinstance(target, str) and target:
        resolve_target(target)


def _run(argv: list[str]) -> int:
    debug = DEBUG_FLAG in argv
    argv = [a for a in argv if a != DEBUG_FLAG]
    top = build_parser()
    if not argv or argv[0].startswith("-"):
        if not argv:
            top.print_help()
            return 2
        top.parse_args(argv)  # --help, --version, or an error
        return 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        close = difflib.get_close_matches(command, SUBCOMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        top.error(f"unknown command {command!r}; {hint}choose from {', '.join(SUBCOMMANDS)}")
    try:
        args = parse_command(command, rest)
        check_target_name(args)
        module = importlib.import_module(SUBCOMMANDS[command][0])
        return int(module.run_cli(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"eagle3-hf {command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"eagle3-hf {command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug rather than bad input: still one line, and how to see more
        if debug:
            raise
        print(
            f"eagle3-hf {command}: error: {type(err).__name__}: {_one_line(err)} (run again with {DEBUG_FLAG} "
            "for the traceback)",
            file=sys.stderr,
        )
        return 1


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
