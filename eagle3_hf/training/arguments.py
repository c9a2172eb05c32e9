"""The EAGLE-3 training options, apart from `transformers.TrainingArguments` so that reading them is cheap.

`Eagle3TrainingArguments` (trainer.py) is `TrainingArguments` plus these fields. They live in their own dataclass,
which imports nothing heavy, so that `eagle3-hf train --help` can list them without importing transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "DEFAULT_HELD_OUT_FRACTION",
    "DEFAULT_MIN_COVERAGE",
    "DEFAULT_TOP_K",
    "LOSSES",
    "SPLITS",
    "Eagle3TrainingOptions",
    "check_loss",
]

# Defaults shared by the training modules and the command line, kept here so that reading them imports nothing.
DEFAULT_TOP_K = 64  # target logits kept per position (online features, offline shards)
DEFAULT_MIN_COVERAGE = 0.95  # held-out coverage `--draft-vocab-size auto` must reach
DEFAULT_HELD_OUT_FRACTION = 0.02  # share of conversations (by id hash) training leaves out
SPLITS = ("train", "held-out", "all")
LOSSES = ("forward_kl", "tv", "lk")  # the objectives of `eagle3_hf.training.losses`


@dataclass
class Eagle3TrainingOptions:
    """The EAGLE-3 settings of `Eagle3TrainingArguments`.

    Args:
        ttt_length: TTT steps K per position (step j predicts the token j+2 ahead of its feature).
        ttt_decay: weight of step j in the loss is ``ttt_decay**j``.
        feature_mode: "online" (run the frozen target every step) or "offline" (batches carry precomputed
            ``target_hidden_states`` / ``target_top_logits`` / ``target_top_ids``, e.g. from `OfflineFeatureDataset`).
        logits_top_k: online features keep the target's `logits_top_k` largest logits per position, as offline
            features do (`eagle3-hf features --logits-top-k`); the soft label is their softmax over the draft
            vocabulary's ids. Offline batches carry their own.
        draft_vocab_size: expected size of the draft head; checked against the draft when given.
        max_length: longer rows are cut by the default collator.
        build_draft_vocab: when the draft still has the placeholder vocabulary (``d2t`` all zero, i.e. ids
            ``0..Vd-1``), build it from the training data's supervised tokens before training.
        packing: pack the batch's conversations into rows of at most `max_length` tokens
            (`eagle3_hf.training.collator`): positions restart per conversation, attention and loss stay within each.
        loss: the objective of each step against the target's soft label (`eagle3_hf.training.losses`):
            ``"forward_kl"`` (EAGLE-3's soft cross entropy, the default), ``"tv"`` (total variation) or ``"lk"``
            (negative log acceptance).

    ``metric_for_best_model`` (a `TrainingArguments` field) may name any evaluation metric the trainer logs (``loss``,
    ``sim_accept_len``, ``coverage``, ``acc_j``, ``loss_j``, with or without ``eval_``); ``sim_accept_len`` and the
    accuracies select the checkpoint with the highest value (``greater_is_better`` is set to True for them).
    """

    ttt_length: int = field(default=7, metadata={"help": "TTT steps per position (step j predicts j+2 ahead)"})
    ttt_decay: float = field(default=0.8, metadata={"help": "loss weight of TTT step j is ttt_decay**j"})
    feature_mode: str = field(default="online", metadata={"help": "'online' or 'offline' target features"})
    logits_top_k: int = field(
        default=DEFAULT_TOP_K,
        metadata={
            "help": "target logits per token the soft labels are built from (online; offline features carry their own)"
        },
    )
    draft_vocab_size: int | None = field(
        default=None,
        metadata={
            "help": "size of the draft's head; None: the target's vocabulary (the train command also takes "
            "'auto': the smallest of 4096/8192/16384/32768 reaching --min-coverage held out)"
        },
    )
    max_length: int | None = field(default=2048, metadata={"help": "tokens per conversation (longer ones are cut)"})
    build_draft_vocab: bool = field(
        default=True, metadata={"help": "build a placeholder draft vocabulary from the training data"}
    )
    packing: bool = field(
        default=False,
        metadata={
            "help": "pack each batch's conversations into rows of up to --max-length tokens, each attending "
            "within itself (fewer padded positions; the loss is the padded batch's)"
        },
    )
    loss: Literal["forward_kl", "tv", "lk"] = field(
        default="forward_kl",
        metadata={
            "help": "objective of each TTT step: forward_kl (soft cross entropy, EAGLE-3's), tv (total "
            "variation) or lk (-log acceptance, arXiv 2602.23881)"
        },
    )

    def check_eagle3_options(self) -> None:
        """Raise `ValueError` naming the first option whose value cannot train a draft."""
        if not isinstance(self.ttt_length, int) or self.ttt_length < 1:
            raise ValueError(f"ttt_length must be a positive integer, got {self.ttt_length!r}.")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay must be in (0, 1], got {self.ttt_decay!r}.")
        if self.feature_mode not in ("online", "offline"):
            raise ValueError(f"feature_mode must be 'online' or 'offline', got {self.feature_mode!r}.")
        if not isinstance(self.logits_top_k, int) or self.logits_top_k < 1:
            raise ValueError(f"logits_top_k must be a positive integer, got {self.logits_top_k!r}.")
        if self.max_length is not None and self.max_length < 3:
            raise ValueError(
                f"max_length must be None or >= 3 (the draft predicts the token two ahead of each position), got "
                f"{self.max_length!r}."
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be None or >= 1, got {self.draft_vocab_size!r}.")
        check_loss(self.loss)
        self._check_best_model_metric()

    def _check_best_model_metric(self) -> None:
        """Refuse a ``metric_for_best_model`` the evaluation never logs (Trainer would fail at the first evaluation,
        after training steps were spent); the acceptance metrics are better when higher."""
        metric = getattr(self, "metric_for_best_model", None)  # a TrainingArguments field, absent on the bare options
        if metric is None:
            return
        name = metric.removeprefix("eval_")
        steps = range(self.ttt_length)
        known = ["loss", "sim_accept_len", "coverage", *(f"acc_{j}" for j in steps), *(f"loss_{j}" for j in steps)]
        if name not in known:
            raise ValueError(f"metric_for_best_model must be one of the evaluation metrics {known}; got {metric!r}.")
        if name == "sim_accept_len" or name.startswith(("acc_", "coverage")):
            if getattr(self, "greater_is_better", None) is False:
                raise ValueError(
                    f"metric_for_best_model={metric!r} is better when higher; greater_is_better=False "
                    "would keep the worst checkpoint."
                )
            self.greater_is_better = True


def check_loss(loss: object) -> str:
    """Return `loss` if it names one of `LOSSES` (`eagle3_hf.training.losses`), else raise `ValueError` naming it."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}; got {loss!r}.")
    return loss  # type: ignore[return-value]
