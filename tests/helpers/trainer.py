"""Drafts and training arguments for the trainer's tests."""

import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.training.trainer import Eagle3TrainingArguments


def new_draft(target, vocab=48):
    torch.manual_seed(0)  # the same initial weights in every run a test compares
    return Eagle3DraftModel.from_target(target, draft_vocab_size=vocab)


def make_args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        ttt_length=3,
        report_to="none",
        save_strategy="no",
        logging_steps=2,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return Eagle3TrainingArguments(**values)
