"""Options that several subcommands share: precision and threads (`--dtype`, `--no-prepack`, `--threads`) and
row-exact verification (`--exact-verify`). What they resolve to is `eagle3_hf.utils.precision`'s."""

from __future__ import annotations

from typing import Any

from eagle3_hf.utils.precision import DTYPE_CHOICES

__all__ = ["add_exact_verify_argument", "add_precision_arguments", "exact_verify_setting"]


def add_precision_arguments(parser: Any, what: str = "decoding") -> None:
    """The `--dtype`, `--no-prepack` and `--threads` options that the decoding commands share."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=f"precision of {what}; auto: bf16 where the hardware has native bf16 matmul, else fp32",
    )
    parser.add_argument("--no-prepack", action="store_true", help="keep bf16 CPU weights unpacked (see PackedLinear)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


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
