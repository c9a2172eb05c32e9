"""The checks `eagle3-hf train` makes before it loads or deletes anything, and the checkpoint `--resume` continues.

A mistake in an option costs a second here, not the minute of loading the target and the data, and it fails before
`--overwrite-output-dir` removes a checkpoint. `--resume` never trains afresh over a finished draft, skips a
checkpoint whose writing was interrupted (naming it) for the newest complete one, and continues the draft the
checkpoint holds: its architecture comes from the checkpoint's config.json (`train_draft`), and an option that
contradicts it is refused, naming both values.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from eagle3_hf.commands import is_main_process, say
from eagle3_hf.utils.hub import is_hub_id

__all__ = [
    "ARCHITECTURE_FLAGS",
    "SHAPE_OPTIONS",
    "check_train_arguments",
    "parse_layer_ids",
    "read_checkpoint_config",
    "resume_checkpoint",
]

# What a finished run leaves at the top of its output folder.
FINISHED_DRAFT_NAMES = ("model.safetensors", "adapter_model.safetensors")
# The draft's norm flags `train` sets (`--fc-norm`, ...): None where the command line leaves them out.
ARCHITECTURE_FLAGS = ("fc_norm", "norm_output", "norm_before_fc")
# The options that shape the draft, by the config.json field each sets: `--resume` takes the checkpoint's, and refuses
# one given otherwise.
SHAPE_OPTIONS = {
    "draft_vocab_size": "--draft-vocab-size",
    "num_hidden_layers": "--num-hidden-layers",
    "target_layer_ids": "--target-layer-ids",
    **{flag: "--" + flag.replace("_", "-") for flag in ARCHITECTURE_FLAGS},
}


def parse_layer_ids(text: str | list[int] | None) -> list[int] | None:
    """`--target-layer-ids` ("2,16,29", or a list from a config file) as three integers; None where left out."""
    if text is None:
        return None
    try:
        ids = [int(i) for i in (text.split(",") if isinstance(text, str) else text)]
    except (TypeError, ValueError) as err:
        raise ValueError(f"--target-layer-ids must be comma-separated integers, got {text!r}.") from err
    if len(ids) != 3 or min(ids) < 0:
        raise ValueError(f"--target-layer-ids must name three output_hidden_states ids (low,mid,high), got {text!r}.")
    return ids


def check_train_arguments(args: argparse.Namespace) -> None:
    """Every check that needs no model and no data: bad input fails in a second, before anything is written."""
    from eagle3_hf.utils.outputs import check_output_dir

    if (args.data is None) == (args.features is None):
        raise ValueError("Give exactly one of --data (conversations, online features) or --features (offline).")
    if not args.output_dir:
        raise ValueError("--output-dir (or --output) is required: the folder for checkpoints and the draft.")
    if args.max_steps == 0 or args.max_steps < -1:
        raise ValueError(
            f"--max-steps must be a positive number of steps (or -1 to train --num-train-epochs "
            f"epochs), got {args.max_steps}."
        )
    if args.max_steps == -1 and args.num_train_epochs <= 0:
        raise ValueError(f"--num-train-epochs must be > 0 when --max-steps is not given, got {args.num_train_epochs}.")
    if not math.isfinite(args.learning_rate) or args.learning_rate < 0:
        raise ValueError(f"--learning-rate must be a finite number >= 0, got {args.learning_rate}.")
    if args.features is not None and getattr(args, "enable_thinking", None) is not None:
        flag = "--enable-thinking" if args.enable_thinking else "--no-enable-thinking"
        raise ValueError(
            f"{flag} sets how train renders --data conversations; offline --features were rendered by "
            f"`eagle3-hf features` (its features.json records how): give {flag} there."
        )
    if args.tokenize_num_proc is not None and args.tokenize_num_proc < 1:
        raise ValueError(f"--tokenize-num-proc must be >= 1 (processes), got {args.tokenize_num_proc}.")
    if args.save_total_limit is not None and args.save_total_limit < 0:
        raise ValueError(f"--save-total-limit must be >= 0 (0 keeps every checkpoint), got {args.save_total_limit}.")
    if args.warmup_steps < 0 or (args.warmup_steps >= 1 and args.warmup_steps != int(args.warmup_steps)):
        raise ValueError(
            f"--warmup-steps (--warmup-ratio) must be a share of the steps in [0, 1) or a whole number "
            f"of steps, got {args.warmup_steps}."
        )
    if args.resume and args.overwrite_output_dir:
        raise ValueError("--resume continues the run in --output-dir, --overwrite-output-dir starts afresh: pick one.")
    if args.eval_steps and args.features is not None and not args.eval_features:
        raise ValueError("--eval-steps with --features needs --eval-features (features of held-out conversations).")
    args.target_layer_ids = parse_layer_ids(args.target_layer_ids)
    if args.fc_norm and args.norm_before_fc:
        from eagle3_hf.modeling.layout_fields import NORM_PAIR

        raise ValueError(f"--fc-norm with --norm-before-fc trains a draft no server runs: {NORM_PAIR}; pick one.")
    if args.num_hidden_layers is not None and args.num_hidden_layers < 1:
        raise ValueError(f"--num-hidden-layers must be >= 1 (the draft's layers), got {args.num_hidden_layers}.")
    if args.dtype != "float32" and (args.bf16 or args.fp16):
        raise ValueError(f"--dtype {args.dtype} sets the mixed precision itself; leave out --bf16/--fp16.")
    if args.init_draft and not os.path.isdir(args.init_draft) and not is_hub_id(args.init_draft):
        raise ValueError(f"--init-draft {args.init_draft!r}: no such folder, and not a Hub id org/name.")
    if args.vocab and not os.path.isfile(args.vocab):
        raise ValueError(f"--vocab {args.vocab!r}: no such file (write one with `eagle3-hf vocab`).")
    check_output_dir(args.output_dir, args.overwrite_output_dir or args.resume, "--output-dir", resumable=True)


def resume_checkpoint(args: argparse.Namespace) -> str | None:
    """The checkpoint `--resume` continues from (None: nothing to resume, start afresh), with the draft's shape
    options (`SHAPE_OPTIONS`) taken from its config.json when they were left out; `ValueError` where one contradicts
    it (naming both values), or where resuming would lose work or cannot work."""
    from eagle3_hf.training.checkpointing import find_resume_checkpoint, set_aside

    output_dir = args.output_dir
    checkpoint, skipped = find_resume_checkpoint(output_dir)
    for path, reason in skipped:
        if is_main_process():  # one process renames; the others skip it as incomplete or no longer see it
            say(f"Skipping {path}: {reason} (its writing was interrupted); moved it aside to {set_aside(path)}.")
    if checkpoint is None:
        finished = [n for n in FINISHED_DRAFT_NAMES if os.path.isfile(os.path.join(output_dir, n))]
        if finished:
            raise ValueError(
                f"--resume: {output_dir!r} holds a finished draft ({finished[0]}) but no complete checkpoint to "
                f"continue from; to train that draft further pass --init-draft {output_dir} with another "
                "--output-dir, or --overwrite-output-dir to train afresh over it."
            )
        say(f"No checkpoint in {output_dir}: starting afresh.")
        return None
    config = read_checkpoint_config(checkpoint)
    for key, option in SHAPE_OPTIONS.items():
        given, saved = getattr(args, key), config.get(key)
        if saved is None:
            continue
        if given not in (None, "auto") and given != saved:
            raise ValueError(
                f"--resume: {checkpoint} holds a draft with {key}={saved}, but {option} is "
                f"{_as_given(given)}; leave {option} out to continue that run (its config.json is the "
                "run's), or train a new one in another --output-dir."
            )
        setattr(args, key, saved)  # left out (or "auto"): the checkpoint's own
    say(f"Resuming from {checkpoint}.")
    return checkpoint


def _as_given(value: object) -> str:
    """An option's value as the command line spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def read_checkpoint_config(checkpoint: str) -> dict:
    """A training checkpoint's ``config.json`` (the draft it holds); empty for a PEFT adapter's, which has none."""
    path = os.path.join(checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}  # a PEFT adapter checkpoint: its shape is the base draft's
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--resume: {path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"--resume: {path} must hold a JSON object, got {type(config).__name__}.")
    return config
