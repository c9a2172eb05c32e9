"""`eagle3-hf convert`: rewrite a draft checkpoint in another layout (`eagle3_hf.modeling.checkpoints`).

    eagle3-hf convert SRC DST --to {native,speculators,eagle} [--target PATH_OR_NAME] [--include-embedding]
"""

from __future__ import annotations

import argparse
import sys

from eagle3_hf.modeling.checkpoints import load_draft
from eagle3_hf.modeling.layouts import (
    EAGLE,
    LAYOUTS,
    NATIVE,
    SPECULATORS,
    resolve_include_embedding,
    save_eagle,
    save_speculators,
)
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.targets import load_target


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="draft checkpoint: a folder or Hub id in any supported layout (detected)")
    parser.add_argument("dst", help="output folder")
    parser.add_argument(
        "--to", choices=LAYOUTS, default=NATIVE,
        help="layout to write: native (ours), speculators (vLLM speculators) or eagle (official SafeAILab/SpecForge)",
    )  # fmt: skip
    parser.add_argument(
        "--target", default=None,
        help="target model (short name such as 'smollm2', or a folder): checks the draft against it and supplies "
             "its embedding when the checkpoint has none",
    )  # fmt: skip
    parser.add_argument(
        "--include-embedding", action="store_true",
        help="write the token embedding; the official layout omits it otherwise (native and speculators write it "
             "whenever it is known)",
    )  # fmt: skip


def run_cli(args: argparse.Namespace) -> int:
    try:
        target = None
        if args.target:
            target = load_target(args.target)
        # dtype "auto": keep the checkpoint's dtype so that the conversion is bit for bit.
        draft = load_draft(Eagle3DraftModel, args.src, target=target, dtype="auto")
        include = True if args.include_embedding else None
        if args.to == SPECULATORS:
            save_speculators(draft, args.dst, include_embedding=include)
        elif args.to == EAGLE:
            save_eagle(draft, args.dst, include_embedding=bool(include))
        else:
            resolve_include_embedding(draft, include)
            draft.save_pretrained(args.dst)
    except ValueError as err:
        print(f"eagle3-hf convert: error: {err}", file=sys.stderr)
        return 2
    print(f"Wrote {args.to} draft to {args.dst}")
    return 0
