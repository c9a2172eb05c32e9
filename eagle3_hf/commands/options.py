"""Options that several subcommands share: the target (`--target`, described the same way everywhere), precision and
threads (`--dtype`, `--no-prepack`, `--threads`) and row-exact verification (`--exact-verify`). What they resolve to
is `eagle3_hf.target_names`' and `eagle3_hf.utils.precision`'s."""

from __future__ import annotations

from typing import Any

from eagle3_hf.utils.precision import DTYPE_CHOICES

__all__ = [
    "TARGET_HELP",
    "add_exact_verify_argument",
    "add_precision_arguments",
    "add_target_argument",
    "exact_verify_setting",
]

# What `--target` takes, in every subcommand (`eagle3_hf.target_names.resolve_target` reads it).
TARGET_HELP = (
    'target model: "smollm2" (SmolLM2-135M-Instruct, installed with the data packages), a folder (config.json or '
    "one .gguf file), a .gguf file, or a Hub id org/name"
)


def add_target_argument(parser: Any, default: str | None = "smollm2", required: bool = False, use: str = "") -> None:
    """`--target`, with `TARGET_HELP` and, after it, what this subcommand uses the target for (`use`)."""
    tail = f"; {use}" if use else ""
    shown = f" (default: {default})" if default is not None and not required else ""
    parser.add_argument("--target", default=default, required=required, help=TARGET_HELP + tail + shown)


def add_precision_arguments(
    parser: Any, what: str = "decoding", threads: str = "torch threads (default: all cores)"
) -> None:
    """The `--dtype`, `--no-prepack` and `--threads` options that the decoding commands share (`threads`: the
    help of `--threads`)."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=f"precision of {what}; auto: bf16 where the hardware has native bf16 matmul, else fp32",
    )
    parser.add_argument("--no-prepack", action="store_true", help="keep bf16 CPU weights unpacked (see PackedLinear)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=threads,
    )


def add_exact_verify_argument(parser: Any) -> None:
    """`--exact-verify {auto,on,off}` (and its old spelling `--no-exact-verify`), shared by `generate` and `bench`."""
    parser.add_argument(
        "--exact-verify",
        choices=("auto", "on", "off"),
        default="auto",
        help="row-exact tree verification (bf16 output token-identical to plain decoding where the hardware's "
        "kernels allow it): auto runs it where the row-invariance probe proves it bit for bit on this CPU and verifies "
        "in one tree-masked call elsewhere; on / off force it (default: %(default)s)",
    )
    parser.add_argument(
        "--no-exact-verify",
        dest="exact_verify",
        action="store_const",
        const="off",
        help="the same as --exact-verify off",
    )


def exact_verify_setting(args: Any) -> bool | str:
    """The `exact_verify` value for `generate()` from the parsed `--exact-verify` option."""
    return {"auto": "auto", "on": True, "off": False}[args.exact_verify]
