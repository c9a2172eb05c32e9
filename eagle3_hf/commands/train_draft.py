"""The draft an `eagle3-hf train` run trains: fresh, continued (`--init-draft`) or resumed (`--resume`).

A fresh draft takes its architecture from the command line (`--num-hidden-layers`, `--target-layer-ids`, `--fc-norm`,
`--norm-output`, `--norm-before-fc`); a continued one from the saved draft, which such an option may only restate (or,
for `--norm-output` and `--target-layer-ids`, choose the reading of an official/SpecForge checkpoint that states them
ambiguously); a resumed one from its checkpoint's own ``config.json``, whatever the command line leaves out, so that
the run goes on with the draft it was training (`train_checks.resume_checkpoint` refuses an option that contradicts
it). The checkpoint's weights and vocabulary then replace anything set here.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from eagle3_hf.commands import say
from eagle3_hf.commands.train_checks import ARCHITECTURE_FLAGS, read_checkpoint_config

__all__ = ["LOW_COVERAGE", "build_draft", "fresh_draft_vocab"]

LOW_COVERAGE = 0.5  # a draft vocabulary covering less of the supervised tokens gets a warning


def build_draft(args: argparse.Namespace, target: Any, vocab_rows: Any, checkpoint: str | None = None) -> Any:
    """The draft to train on `target`: resumed from `checkpoint`'s config, continued from `--init-draft` (remapped,
    grown if asked), or fresh (its vocabulary counted on `vocab_rows`, target-derived init).

    `vocab_rows` is the offline features, or every tokenised conversation (`train._data`)."""
    saved = read_checkpoint_config(checkpoint) if checkpoint is not None else {}
    if saved:
        return _resumed(args, target, saved)
    if args.init_draft:
        return _continued(args, target, vocab_rows)
    return _fresh(args, target, vocab_rows, resuming=checkpoint is not None)


def _architecture(args: argparse.Namespace) -> dict[str, Any]:
    """The architecture options given on the command line (those left out are None)."""
    given = {flag: getattr(args, flag) for flag in ARCHITECTURE_FLAGS if getattr(args, flag) is not None}
    if args.target_layer_ids is not None:
        given["target_layer_ids"] = list(args.target_layer_ids)
    if args.num_hidden_layers is not None:
        given["num_hidden_layers"] = args.num_hidden_layers
    return given


def _resumed(args: argparse.Namespace, target: Any, saved: dict[str, Any]) -> Any:
    """The draft of a checkpoint's ``config.json``, for `target` (whose embedding it takes): every field it records,
    the target's where it records none."""
    from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel
    from eagle3_hf.modeling.checkpoints import read_training_info

    fields = set(inspect.signature(Eagle3DraftConfig.__init__).parameters) - {"self", "kwargs"}
    draft = Eagle3DraftModel.from_target(target, **{k: v for k, v in saved.items() if k in fields}).float()
    if args.init_draft:  # its training steps count on in the card (`train.run_cli`)
        draft.training_info = read_training_info(args.init_draft)
    return draft


def _continued(args: argparse.Namespace, target: Any, vocab_rows: Any) -> Any:
    """`--init-draft`, loaded for `target`: remapped to another vocabulary and grown when asked."""
    import torch

    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.modeling.depth import grow_draft_layers
    from eagle3_hf.modeling.target_init import remap_draft_vocab

    # --norm-output / --target-layer-ids choose how an official/SpecForge checkpoint is read (and must agree with
    # any other, which the loader checks).
    reading = {k: v for k, v in _architecture(args).items() if k in ("norm_output", "target_layer_ids")}
    draft = Eagle3DraftModel.from_pretrained(args.init_draft, target=target, dtype=torch.float32, **reading)
    for flag in ("fc_norm", "norm_before_fc"):
        given, own = getattr(args, flag), getattr(draft.config, flag)
        if given is not None and given != own:
            option = "--" + flag.replace("_", "-")
            raise ValueError(
                f"{option} {str(given).lower()} contradicts --init-draft {args.init_draft}, whose draft "
                f"has {flag}={own}: a trained draft keeps its architecture; leave {option} out to "
                "continue it, or train a fresh draft."
            )
    vocab_size = target.config.get_text_config().vocab_size
    if args.vocab or args.draft_vocab_size not in (None, draft.config.draft_vocab_size):
        vocab = fresh_draft_vocab(args, vocab_rows, vocab_size)
        d2t, t2d = (
            (vocab.d2t, vocab.t2d)
            if vocab is not None
            else (torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool))
        )
        shared = remap_draft_vocab(draft, d2t, t2d)
        say(f"Remapped the draft to {d2t.numel()} ids: {shared} kept their head rows.")
    depth, own = args.num_hidden_layers, draft.config.num_hidden_layers
    if depth is not None and depth < own:
        raise ValueError(
            f"--num-hidden-layers {depth} is below the depth of --init-draft {args.init_draft} "
            f"({own} decoder layers): a draft can grow, never shrink."
        )
    if depth is not None and depth > own:
        draft = grow_draft_layers(draft, depth)
        say(f"Grew the draft from {own} to {depth} decoder layers (the new ones start as the identity).")
    return draft


def _fresh(args: argparse.Namespace, target: Any, vocab_rows: Any, resuming: bool) -> Any:
    """A fresh draft of the command line's architecture. When `resuming` (a checkpoint without a config.json: a PEFT
    adapter's), only its shape counts: the checkpoint's weights and vocabulary replace anything set here."""
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.modeling.target_init import init_head_from_target, init_layer_from_target

    vocab_size = target.config.get_text_config().vocab_size
    vocab = None if resuming else fresh_draft_vocab(args, vocab_rows, vocab_size)
    size = args.draft_vocab_size if resuming else vocab.draft_vocab_size if vocab is not None else None
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=size, **_architecture(args)).float()
    if resuming:
        return draft
    if vocab is not None:
        draft.set_draft_vocab(vocab.d2t, vocab.t2d)  # before the head copy: it picks the rows by these ids
    if args.init_from_target:
        say(f"Target-derived init: {', '.join(init_head_from_target(draft, target)) or 'nothing'} copied.")
    if args.init_layer_from_target:
        say(f"Target-derived init: {', '.join(init_layer_from_target(draft, target)) or 'nothing'} copied.")
    return draft


def fresh_draft_vocab(args: argparse.Namespace, dataset: Any, target_vocab_size: int) -> Any:
    """The vocabulary of a fresh draft: `--vocab`, or counted on the training data; None for the whole vocabulary."""
    from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
    from eagle3_hf.training.vocab import build_draft_vocab, load_draft_vocab, select_draft_vocab

    if args.vocab:
        vocab = load_draft_vocab(args.vocab)
        if args.draft_vocab_size not in (None, vocab.draft_vocab_size):
            raise ValueError(
                f"--vocab {args.vocab} holds {vocab.draft_vocab_size} ids but --draft-vocab-size is "
                f"{args.draft_vocab_size}; give one of them."
            )
        return vocab
    if args.draft_vocab_size is None or args.draft_vocab_size == target_vocab_size:
        return None
    if isinstance(dataset, OfflineFeatureDataset):
        if args.draft_vocab_size == "auto":
            raise ValueError(
                "--draft-vocab-size auto measures coverage on held-out conversations, which offline features do not "
                "hold: run `eagle3-hf vocab --draft-vocab-size auto` on the conversations and pass --vocab FILE."
            )
        vocab = build_draft_vocab(dataset.token_rows(), target_vocab_size, args.draft_vocab_size)
    else:
        choice = select_draft_vocab(
            dataset, target_vocab_size, args.draft_vocab_size, args.min_coverage, args.held_out_fraction
        )
        say(choice.table())
        vocab = choice.vocab
    say(
        f"Draft vocabulary: {vocab.draft_vocab_size} of {vocab.target_vocab_size} ids, covering "
        f"{100 * vocab.coverage:.2f}% of the training data's supervised tokens."
    )
    if vocab.coverage < LOW_COVERAGE:  # most target tokens would be out of the draft's reach: likely a typo
        say(
            f"Warning: --draft-vocab-size {vocab.draft_vocab_size} covers under {LOW_COVERAGE:.0%} of the supervised "
            "tokens, so the draft can propose few of the target's tokens; --draft-vocab-size auto picks one by "
            "coverage."
        )
    return vocab
