"""The checks `eagle3-hf train` makes before it loads or deletes anything, and the checkpoint a resumed run continues.

A mistake in an option costs a second here, not the minute of loading the target and the data, and it fails before
`--overwrite-output-dir` removes a checkpoint. `--resume` never trains afresh over a finished draft and skips a
checkpoint whose writing was interrupted (naming it) for the newest complete one; `--resume-from-checkpoint DIR`
names the checkpoint itself. Either way the run continues the draft the checkpoint holds: its architecture comes from
the checkpoint's config.json (`train_draft`), and an option, `--vocab` or `--loss` that contradicts it is refused,
naming both values.
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
    "check_against_checkpoint",
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
    resumed_here = args.resume_from_checkpoint is not None and _inside(args.resume_from_checkpoint, args.output_dir)
    if resumed_here and args.overwrite_output_dir:
        raise ValueError(
            f"--resume-from-checkpoint {args.resume_from_checkpoint} lies in --output-dir, whose checkpoints "
            "--overwrite-output-dir removes: pick one."
        )
    check_output_dir(
        args.output_dir, args.overwrite_output_dir or args.resume or resumed_here, "--output-dir", resumable=True
    )


def _inside(path: str, folder: str) -> bool:
    """Whether `path` lies in `folder` (a checkpoint of the run in --output-dir continues that run)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def resume_checkpoint(args: argparse.Namespace) -> str | None:
    """The checkpoint a run continues from: `--resume-from-checkpoint` (with or without `--resume`), else the newest
    complete one in `--output-dir` for `--resume` (None: nothing to resume, start afresh). Either way it is checked
    the same: the draft's shape options (`SHAPE_OPTIONS`) are taken from its config.json when they were left out,
    and `ValueError` names both values where an option, `--vocab` or `--loss` contradicts it, or where resuming
    would lose work or cannot work."""
    from eagle3_hf.training.checkpointing import find_resume_checkpoint, set_aside

    output_dir, checkpoint = args.output_dir, args.resume_from_checkpoint
    flag = "--resume-from-checkpoint" if checkpoint is not None else "--resume"
    if checkpoint is not None:
        if not os.path.isdir(checkpoint):
            raise ValueError(f"--resume-from-checkpoint {checkpoint!r}: no such folder (a checkpoint-N of a run).")
        check_against_checkpoint(args, checkpoint, flag)
        return checkpoint
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
    check_against_checkpoint(args, checkpoint, flag)
    return checkpoint


def check_against_checkpoint(args: argparse.Namespace, checkpoint: str, flag: str) -> None:
    """The one check every resume runs: each option that shapes the draft, `--vocab` and `--loss` against what
    `checkpoint` holds (an option left out takes the checkpoint's value); then a warning where `--max-steps` moves
    the end of the learning-rate schedule the checkpoint is on."""
    config = read_checkpoint_config(checkpoint)
    for key, option in SHAPE_OPTIONS.items():
        given, saved = getattr(args, key), config.get(key)
        if saved is None:
            continue
        if given not in (None, "auto") and given != saved:
            _refuse(flag, checkpoint, f"a draft with {key}={saved}", f"{option} is {_as_given(given)}", option)
        setattr(args, key, saved)  # left out (or "auto"): the checkpoint's own
    if args.vocab and config:  # a PEFT adapter's checkpoint (no config.json) holds the base draft's vocabulary
        _check_vocab(args.vocab, checkpoint, flag)
    saved_loss = _read_json(os.path.join(checkpoint, "training_info.json")).get("loss")
    if saved_loss is not None and saved_loss != args.loss:
        _refuse(flag, checkpoint, f"a draft trained with --loss {saved_loss}", f"this run's --loss is {args.loss}", "")
    _warn_schedule(args, checkpoint)
    say(f"Resuming from {checkpoint}.")


def _refuse(flag: str, checkpoint: str, holds: str, given: str, option: str) -> None:
    keep = f"leave {option} out" if option else "give the checkpoint's value"
    raise ValueError(
        f"{flag}: {checkpoint} holds {holds}, but {given}; {keep} to continue that run (its checkpoint is the "
        "run's), or train a new one in another --output-dir."
    )


def _check_vocab(vocab_path: str, checkpoint: str, flag: str) -> None:
    """`--vocab` against the draft vocabulary the checkpoint's weights hold (its ``d2t``)."""
    import torch

    from eagle3_hf.training.vocab import load_draft_vocab

    given, saved = load_draft_vocab(vocab_path), load_draft_vocab(checkpoint)
    if given.draft_vocab_size != saved.draft_vocab_size:
        _refuse(
            flag,
            checkpoint,
            f"a draft vocabulary of {saved.draft_vocab_size} ids",
            f"--vocab {vocab_path} holds {given.draft_vocab_size}",
            "--vocab",
        )
    if not torch.equal(given.d2t, saved.d2t):
        first = int((given.d2t != saved.d2t).nonzero()[0])
        _refuse(
            flag,
            checkpoint,
            f"a draft vocabulary whose id {first} is target id {first + int(saved.d2t[first])}",
            f"in --vocab {vocab_path} it is target id {first + int(given.d2t[first])}",
            "--vocab",
        )


def _warn_schedule(args: argparse.Namespace, checkpoint: str) -> None:
    """Say what the Trainer does when `--max-steps` differs from the run the checkpoint belongs to: it restores that
    run's scheduler, so the first resumed step runs at the rate the old schedule had reached (0 where a cosine or
    linear decay had ended) and the later ones follow the schedule stretched over the new --max-steps."""
    state = _read_json(os.path.join(checkpoint, "trainer_state.json"))
    saved_max, step = state.get("max_steps"), state.get("global_step")
    schedule = str(getattr(args, "lr_scheduler_type", "linear")).split(".")[-1].lower()
    if not saved_max or step is None or args.max_steps in (-1, saved_max) or schedule.startswith("constant"):
        return
    rates = [log["learning_rate"] for log in state.get("log_history", []) if "learning_rate" in log]
    ended = f"ended its {schedule} schedule" if step >= saved_max else f"is at step {step} of a {schedule} schedule"
    rate = f" ({rates[-1]:g} at its last log)" if rates else ""
    say(
        f"Warning: {checkpoint} {ended} of {saved_max} steps, and this run goes to --max-steps {args.max_steps}: the "
        f"Trainer restores that schedule, so step {step + 1} runs at the rate it had reached{rate} and steps from "
        f"{step + 2} follow the {schedule} schedule over {args.max_steps} steps from there, not a fresh one. To "
        f"train the draft further on a schedule of its own, pass --init-draft with the finished draft's folder and "
        "another --output-dir."
    )


def _as_given(value: object) -> str:
    """An option's value as the command line spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _read_json(path: str) -> dict:
    """A JSON object a checkpoint holds (empty where it has none or it is unreadable: nothing is then checked)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def read_checkpoint_config(checkpoint: str) -> dict:
    """A training checkpoint's ``config.json`` (the draft it holds); empty for a PEFT adapter's, which has none."""
    path = os.path.join(checkpoint, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}  # a PEFT adapter checkpoint: its shape is the base draft's
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"resuming: {path} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"resuming: {path} must hold a JSON object, got {type(config).__name__}.")
    return config
