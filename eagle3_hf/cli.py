"""`eagle3-hf` command line: one subcommand per step of the data flow.

Each subcommand has a module in `eagle3_hf.commands` (`bench`: `eagle3_hf.benchmark`); the module exposes
`add_cli_arguments(parser)` and `run_cli(args) -> int`. Every subcommand accepts
`--config FILE` (JSON or YAML mapping of option names to values; command-line flags win).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "regenerate": ("eagle3_hf.commands.regenerate", "re-answer training prompts with the target model"),
    "vocab": ("eagle3_hf.commands.vocab", "build the draft vocabulary (d2t/t2d) from tokenised data"),
    "features": ("eagle3_hf.commands.features", "precompute target features (offline training) to safetensors shards"),
    "train": ("eagle3_hf.commands.train", "train an EAGLE-3 draft with Trainer.train() and the TTT loss"),
    "evaluate": ("eagle3_hf.commands.evaluate", "full-vocabulary TTT accuracy of drafts on held-out conversations"),
    "generate": ("eagle3_hf.commands.generate", "generate with a target and its EAGLE-3 draft"),
    "bench": ("eagle3_hf.benchmark", "benchmark EAGLE-3 against the fastest plain decoding (fp32 and bf16)"),
    "convert": ("eagle3_hf.commands.convert", "convert a draft checkpoint between native, speculators and official layouts"),
}


def load_config_file(path: str) -> dict[str, Any]:
    """Read a `--config` file: a JSON (or YAML, when PyYAML is installed) mapping of option -> value."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as err:
            raise ValueError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or use JSON.") from err
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of option names to values, got {type(data).__name__}.")
    return {key.replace("-", "_"): value for key, value in data.items()}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand's own options are added only when it runs (cheap `--help`)."""
    parser = argparse.ArgumentParser(prog="eagle3-hf", description="EAGLE-3 speculative decoding for transformers.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def build_subparser(command: str) -> argparse.ArgumentParser:
    module_name, help_text = SUBCOMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"eagle3-hf {command}", description=help_text)
    parser.add_argument("--config", default=None, help="JSON/YAML file of option values (flags given here win)")
    importlib.import_module(module_name).add_cli_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = build_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        top.error(f"unknown command {command!r}; choose from {', '.join(SUBCOMMANDS)}")
    parser = build_subparser(command)
    args = parser.parse_args(rest)
    if args.config:
        # Re-parse with the file's values as defaults so explicit flags still win.
        values = load_config_file(args.config)
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - known)
        if unknown:
            parser.error(f"unknown option(s) in {args.config}: {', '.join(unknown)}")
        parser.set_defaults(**values)
        args = parser.parse_args(rest)
    module = importlib.import_module(SUBCOMMANDS[command][0])
    try:
        return int(module.run_cli(args) or 0)
    except (ValueError, ImportError, FileNotFoundError) as err:
        # Bad input (a wrong path, a missing data package, a mismatched draft): one clear line, no traceback.
        print(f"eagle3-hf {command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
