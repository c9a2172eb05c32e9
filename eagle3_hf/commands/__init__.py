"""One module per `eagle3-hf` subcommand: parse its options, load the target (and draft), call the subpackage.

This is the top of the data flow: the only code besides `bench/` that loads targets by name and so may import
`modeling`, `generation` and `training` together. Each module exposes `add_cli_arguments(parser)` and
`run_cli(args) -> int` (`train` builds its own parser: `build_parser`/`parse_cli`); `eagle3_hf.cli` dispatches to them.
Modules import torch and transformers inside `run_cli` only, so that `--help` is instant.

This file holds what every subcommand shares and that imports nothing heavy: the parser class whose errors are one
line, `--config` files, and printing from the main process only.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "THINKING_HELP",
    "CommandParser",
    "OneLineErrors",
    "ShowDefaults",
    "add_thinking_argument",
    "apply_config",
    "is_main_process",
    "load_config_file",
    "say",
    "split_config",
]

THINKING_HELP = (
    "the chat template's thinking switch (Qwen3-style enable_thinking), passed to it for every prompt and "
    "conversation: give the same one to regenerate, train and bench (they warn when it differs from what the data "
    "was made with); left out: the template's default. A template without the switch ignores it, with a warning"
)


class OneLineErrors:
    """Mixin for `argparse.ArgumentParser` subclasses: a usage error is one line and exit code 2 (no usage dump)."""

    prog: str

    def error(self, message: str) -> NoReturn:  # argparse's hook for every usage error
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")  # type: ignore[attr-defined]


class ShowDefaults(argparse.HelpFormatter):
    """`--help` shows each option's default: appended as ``(default: X)`` unless the help already says it in words
    (help that mentions "default") or there is nothing to show (None, a flag's False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:  # argparse's hook for one option's help
        text = action.help or ""
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


class CommandParser(OneLineErrors, argparse.ArgumentParser):
    """The parser of a subcommand: one-line usage errors, and defaults shown in `--help`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", ShowDefaults)
        super().__init__(*args, **kwargs)


def add_thinking_argument(parser: argparse.ArgumentParser) -> None:
    """`--enable-thinking/--no-enable-thinking` (dest ``enable_thinking``: True, False, or None when neither)."""
    parser.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None, help=THINKING_HELP)


def is_main_process() -> bool:
    """False on every process but the first under `torchrun` / `accelerate launch` (they set RANK)."""
    return os.environ.get("RANK", "0") == "0"


def say(*parts: Any, **kwargs: Any) -> None:
    """`print`, from the main process only (under torchrun every process runs the command)."""
    if is_main_process():
        print(*parts, **kwargs)


def load_config_file(path: str) -> dict[str, Any]:
    """Read a `--config` file: a JSON (or YAML) mapping of option name -> value."""
    if not os.path.isfile(path):
        raise ValueError(f"--config {path!r}: no such file.")
    text = Path(path).read_text(encoding="utf-8")
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except ImportError as err:
        raise ValueError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or use JSON.") from err
    except Exception as err:  # json.JSONDecodeError, yaml.YAMLError: say which file, and where
        raise ValueError(
            f"--config {path} is not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {err}"
        ) from err
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of option names to values, got {type(data).__name__}.")
    return data


def apply_config(parser: argparse.ArgumentParser, values: dict[str, Any], path: str) -> None:
    """Make a config file's values the parser's defaults, so that flags given on the command line still win.

    Keys are option names with or without dashes (`learning-rate`, `learning_rate`, aliases such as `output`); an
    option the file supplies is no longer required on the command line.
    """
    by_name: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse keeps no public list of its options
        if action.dest in ("help", argparse.SUPPRESS):
            continue
        names = [s.lstrip("-") for s in action.option_strings] or [action.dest]
        for name in names:
            by_name[name.replace("-", "_")] = action
    unknown = sorted(k for k in values if k.replace("-", "_") not in by_name)
    if unknown:
        parser.error(f"unknown option(s) in {path}: {', '.join(unknown)}")
    defaults = {}
    for key, value in values.items():
        action = by_name[key.replace("-", "_")]
        if action.nargs == 0 and isinstance(value, str):  # a flag (store_true): "false" must not read as true
            value = _config_bool(parser, value, key, path)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and action.type not in (None, str):
            value = str(value)  # argparse converts string defaults with the option's type (and checks choices)
        if action.choices is not None:
            converted = action.type(value) if action.type is not None and isinstance(value, str) else value
            if converted not in action.choices:
                parser.error(f"{path}: {key}={value!r} is not one of {list(action.choices)}")
        defaults[action.dest] = value
        action.required = False
        if not action.option_strings and action.nargs is None:
            action.nargs = "?"  # a positional the file supplies may be left out
    parser.set_defaults(**defaults)


def _config_bool(parser: argparse.ArgumentParser, value: str, key: str, path: str) -> bool:
    """A flag's value written as a string in a config file, read as the command line reads a boolean."""
    words = {"true": True, "yes": True, "1": True, "on": True, "false": False, "no": False, "0": False, "off": False}
    if value.strip().lower() not in words:
        parser.error(f"{path}: {key}={value!r} is not a boolean; expected true or false")
    return words[value.strip().lower()]


def split_config(argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """`(--config FILE or None, the other arguments)`."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(list(argv))
    return known.config, rest
