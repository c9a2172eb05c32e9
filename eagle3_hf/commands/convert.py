"""`eagle3-hf convert`: rewrite a draft checkpoint in another layout (`eagle3_hf.modeling.checkpoints`).

    eagle3-hf convert SRC DST --to {native,speculators,eagle} [--target PATH_OR_NAME] [--target-id ORG/NAME]
        [--verifier-path DIR] [--include-embedding] [--overwrite-output-dir]

Every layout writes the token embedding bit for bit as the target has it, in the target's dtype (with `--target`), or
as the checkpoint stored it. DST is written to a temporary sibling folder and renamed into place once complete; an
existing non-empty DST is replaced only with `--overwrite-output-dir`, and never when it is SRC (or holds it).
"""

from __future__ import annotations

import argparse
import sys

from eagle3_hf.commands import say
from eagle3_hf.commands.options import add_target_argument

LAYOUTS = ("native", "speculators", "eagle")  # eagle3_hf.modeling.layouts.LAYOUTS, spelt out so --help stays light


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="draft checkpoint: a folder or Hub id in any supported layout (detected)")
    parser.add_argument("dst", help="output folder (missing or empty, or --overwrite-output-dir)")
    parser.add_argument(
        "--to",
        choices=LAYOUTS,
        default="native",
        help="layout to write: native (ours), speculators (vLLM speculators) or eagle (official SafeAILab/SpecForge)",
    )
    add_target_argument(
        parser,
        default=None,
        use="checks the draft against it and supplies its embedding (bit for bit, in the target's precision) and "
        "architectures; needed for speculators when the checkpoint has no embedding",
    )
    parser.add_argument(
        "--target-id",
        default=None,
        help="the target's Hub id (org/name) to record, e.g. in the speculators config's verifier (default: what "
        "the draft records, or the id of a known short name)",
    )
    parser.add_argument(
        "--verifier-path",
        default=None,
        metavar="DIR",
        help="speculators only: record this local folder (the target saved by transformers: config.json and "
        "weights) as the verifier instead of a Hub id, so that speculators loads it offline",
    )
    parser.add_argument(
        "--include-embedding",
        action="store_true",
        help="write the token embedding; the official layout omits it otherwise (native and speculators write it "
        "whenever it is known)",
    )
    parser.add_argument("--overwrite-output-dir", action="store_true", help="replace an existing non-empty DST")


def _check_names(args: argparse.Namespace) -> None:
    """Refuse a bad --target-id / --verifier-path before anything loads."""
    from eagle3_hf.utils.hub import is_hub_id

    if args.target_id is not None and not is_hub_id(args.target_id):
        raise ValueError(
            f"--target-id {args.target_id!r} is not a Hub id; expected 'org/name' (to record a local folder as the "
            "speculators verifier, pass --verifier-path DIR)."
        )
    if args.verifier_path is None:
        return
    if args.to != "speculators":
        raise ValueError(
            f"--verifier-path names the speculators verifier: it needs --to speculators, got --to {args.to}."
        )
    if args.target_id is not None:
        raise ValueError("--verifier-path and --target-id both name the verifier; pass one of them.")


def _recorded(name: str) -> str:
    """How the verifier a speculators export records will be found."""
    from eagle3_hf.utils.hub import is_hub_id

    if is_hub_id(name):
        return (
            f"Recorded the verifier as the Hub id {name!r}: speculators fetches it from the Hub (to load it "
            "offline, pass --verifier-path DIR with a local copy of the target)."
        )
    return f"Recorded the verifier as the local folder {name!r}: speculators loads it from there, offline."


def run_cli(args: argparse.Namespace) -> int:
    from eagle3_hf.draft_names import check_checkpoint_name
    from eagle3_hf.utils.outputs import check_output_dir, staged_dir

    check_checkpoint_name(args.src, "SRC")  # before the target loads, and before DST is looked at
    check_output_dir(args.dst, args.overwrite_output_dir, "DST", source=args.src)
    _check_names(args)
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.modeling.identity import local_verifier
    from eagle3_hf.modeling.layouts import EAGLE, SPECULATORS, resolve_include_embedding, save_eagle, save_speculators
    from eagle3_hf.targets import load_target, resolve_target, target_hub_id

    target = None
    if args.target:
        resolve_target(args.target)
        target = load_target(args.target, dtype="auto")  # its own precision: the exported embedding keeps it
    # dtype "auto": keep the checkpoint's dtype so that the conversion is bit for bit.
    draft = Eagle3DraftModel.from_pretrained(args.src, target=target, dtype="auto")
    if target is not None and draft.config.hidden_size == draft.config.target_hidden_size:
        # Write the target's own embedding: a copy the checkpoint holds was checked equal, but may be a cast one.
        draft.load_target_embedding(target)
    recorded = draft.config.target_name_or_path
    target_id = args.target_id or (target_hub_id(recorded) if recorded else None)
    if target_id:
        draft.config.target_name_or_path = target_id
    verifier = local_verifier(args.verifier_path, draft.config) if args.verifier_path is not None else None
    include = True if args.include_embedding else None
    with staged_dir(args.dst) as folder:
        if args.to == SPECULATORS:
            verifier = save_speculators(draft, folder, include_embedding=include, target_id=verifier)
        elif args.to == EAGLE:
            save_eagle(draft, folder, include_embedding=bool(include))
        else:
            draft.save_pretrained(folder, include_embedding=resolve_include_embedding(draft, include))
    say(f"Wrote the {args.to} draft to {args.dst}")
    if args.to == SPECULATORS:
        say(_recorded(verifier))
    if args.to == EAGLE and not args.include_embedding:
        # The layout's consumers take a missing embedding from the target, but `speculators convert` fills it with
        # zeros and nothing complains: say so while the user can still add it.
        print(
            "eagle3-hf convert: warning: wrote no token embedding (the official layout leaves it out); a tool "
            "converting this checkpoint onward must supply the target's, or it may load zeros in its place: pass "
            "--include-embedding to write it",
            file=sys.stderr,
        )
    return 0
