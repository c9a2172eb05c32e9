"""Trainer checkpoints written whole or not at all, and the checkpoint a resumed run continues from.

`transformers.Trainer` writes a checkpoint's files one after another into ``checkpoint-N/`` (weights, optimizer,
scheduler, RNG states, ``trainer_state.json`` last), so a run stopped meanwhile (Ctrl-C, a killed job) left a folder
that resuming picked and then failed on. `WholeCheckpoints` makes the Trainer write each checkpoint under a hidden
staging folder of the output folder and renames it to ``checkpoint-N`` once every process has written its part.
`find_resume_checkpoint` still checks what it picks (a folder may come from an older version or another tool) and
skips an incomplete checkpoint for the newest complete one; `set_aside` moves the skipped one out of the way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from eagle3_hf.utils.atomic import replace_path

__all__ = [
    "STAGING_NAME",
    "RemoveCheckpointsOnTrainBegin",
    "WholeCheckpoints",
    "find_resume_checkpoint",
    "incomplete_reason",
    "list_checkpoints",
    "set_aside",
]

STAGING_NAME = f".{PREFIX_CHECKPOINT_DIR}-staging.tmp"  # the same name on every process (FSDP writes on all)
TRAINER_STATE_NAME = "trainer_state.json"
# A checkpoint holds the draft in one of these (native weights, a sharded index, or a PEFT adapter).
WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
_CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


def list_checkpoints(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders in `output_dir`, newest (highest step) first."""
    if not os.path.isdir(output_dir):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(output_dir) if (m := _CHECKPOINT.fullmatch(name))]
    return [
        os.path.join(output_dir, name)
        for _, name in sorted(found, reverse=True)
        if os.path.isdir(os.path.join(output_dir, name))
    ]


def incomplete_reason(checkpoint: str) -> str | None:
    """Why `checkpoint` cannot be resumed from (its writing was interrupted), or None when it is complete."""
    state = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME}"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"its {TRAINER_STATE_NAME} is not valid JSON"
    if not any(os.path.isfile(os.path.join(checkpoint, name)) for name in WEIGHT_NAMES):
        return f"it holds none of {', '.join(WEIGHT_NAMES)}"
    return None


def find_resume_checkpoint(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(the newest complete checkpoint in `output_dir` or None, (path, reason) for each newer incomplete one)."""
    skipped = []
    for checkpoint in list_checkpoints(output_dir):
        reason = incomplete_reason(checkpoint)
        if reason is None:
            return checkpoint, skipped
        skipped.append((checkpoint, reason))
    return None, skipped


def set_aside(checkpoint: str) -> str:
    """Rename an incomplete checkpoint to a hidden ``.checkpoint-N.XXXX.incomplete`` (kept for inspection) and
    return the new path: left in place, it would count as the newest checkpoint when older ones are rotated out."""
    parent, name = os.path.split(checkpoint)
    aside = tempfile.mkdtemp(prefix=f".{name}.", suffix=".incomplete", dir=parent)
    os.replace(checkpoint, aside)  # a folder may be renamed over an empty one
    return aside


class WholeCheckpoints:
    """Mixin for a `transformers.Trainer` (before it in the bases): each checkpoint is written into
    ``OUTPUT_DIR/.checkpoint-staging.tmp/checkpoint-N`` and renamed to ``OUTPUT_DIR/checkpoint-N`` when complete;
    older checkpoints are rotated (``save_total_limit``) and the checkpoint pushed (``push_to_hub``) only then."""

    _checkpoint_staging: str | None = None

    def _get_output_dir(self, trial: Any) -> str:
        # While a checkpoint is written, the Trainer's own saving code writes it under the staging folder.
        return self._checkpoint_staging or super()._get_output_dir(trial)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer: Any = self
        args, state = trainer.args, trainer.state
        run_dir = super()._get_output_dir(trial)  # type: ignore[misc]
        staging = os.path.join(run_dir, STAGING_NAME)
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if args.should_save and os.path.isdir(staging):
            shutil.rmtree(staging)  # left by a run stopped while it saved
        trainer.accelerator.wait_for_everyone()
        push, args.push_to_hub = args.push_to_hub, False  # an upload must not read a folder about to be renamed
        self._checkpoint_staging = staging
        try:
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
        finally:
            self._checkpoint_staging = None
            args.push_to_hub = push
        trainer.accelerator.wait_for_everyone()  # every process has written its part
        final = os.path.join(run_dir, name)
        if args.should_save:
            best = state.best_model_checkpoint
            if best and os.path.dirname(best) == staging:  # the Trainer recorded the path it wrote to
                state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
                state.save_to_json(os.path.join(staging, name, TRAINER_STATE_NAME))
            replace_path(os.path.join(staging, name), final)
            shutil.rmtree(staging, ignore_errors=True)
            rotate_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint, use_mtime=True)
        trainer.accelerator.wait_for_everyone()  # the checkpoint is in place when any process goes on
        if push:
            trainer._push_from_checkpoint(final)


class RemoveCheckpointsOnTrainBegin(TrainerCallback):
    """``--overwrite-output-dir``: remove the earlier run's checkpoints (else a later ``--resume`` would pick one)
    only once training begins, i.e. once the data, the models and the optimizer have been set up, so that a mistake
    in any option deletes nothing."""

    def __init__(self, output_dir: str, report: Callable[[str], None]) -> None:
        self.output_dir = output_dir
        self.report = report

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        old = list_checkpoints(self.output_dir)
        for path in old + [os.path.join(self.output_dir, STAGING_NAME)]:
            shutil.rmtree(path, ignore_errors=True)
        if old:
            self.report(f"--overwrite-output-dir: removed {len(old)} earlier checkpoint(s) from {self.output_dir}.")
