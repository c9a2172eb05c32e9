"""Train EAGLE-3 drafts with `transformers.Trainer`: TTT loss, online/offline target features, acceptance metrics.

`Eagle3Trainer` trains the draft (optionally PEFT-wrapped); the frozen target (online features) lives on the trainer,
outside the optimizer, the accelerate wrapping and the checkpoints. Checkpoints and `save_model` hold the draft in
its native layout (`Eagle3DraftModel.from_pretrained` reloads it), or the adapter for a PEFT draft.

Logged next to the loss (averaged over the logging interval, summed across processes): ``acc_0..acc_{K-1}`` (share
of supervised positions where the draft's top token is the target's top token over its FULL vocabulary at TTT step
j; positions the draft vocabulary cannot hold count as misses), ``coverage`` (share of supervised positions whose
target top token the draft vocabulary holds, step 0), ``loss_0..loss_{K-1}`` and
``sim_accept_len = 1 + sum_j prod_{i<=j} acc_i``, the chain acceptance length those accuracies imply.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import PreTrainedModel, Trainer, TrainingArguments

from eagle3_hf.modeling.model_card import CARD_NAME, build_model_card
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.training.arguments import Eagle3TrainingOptions
from eagle3_hf.training.checkpointing import WholeCheckpoints
from eagle3_hf.training.collator import FEATURE_KEYS, Eagle3DataCollator
from eagle3_hf.training.distributed import (
    check_fsdp_plugin,
    enable_cpu_fsdp,
    fsdp_mesh,
    refuse_deepspeed,
    reshard,
    shard_frozen_target,
)
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.features import _base_draft, online_features
from eagle3_hf.training.head_loss import ttt_head_kwargs
from eagle3_hf.training.ttt import TTTOutput, simulated_acceptance_length, ttt_forward, ttt_loss
from eagle3_hf.training.vocab import DraftVocab, build_draft_vocab

logger = logging.getLogger(__name__)

__all__ = [
    "Eagle3DataCollator",
    "Eagle3Trainer",
    "Eagle3TrainingArguments",
    "install_draft_vocab",
]


@dataclass
class Eagle3TrainingArguments(Eagle3TrainingOptions, TrainingArguments):
    """`TrainingArguments` plus the EAGLE-3 settings of `Eagle3TrainingOptions` (``ttt_length``, ``ttt_decay``,
    ``feature_mode``, ``logits_top_k``, ``draft_vocab_size``, ``max_length``, ``build_draft_vocab``, ``loss``).

    `remove_unused_columns` defaults to False (the batches carry ``loss_mask`` and features the draft's forward does
    not name).
    """

    remove_unused_columns: bool = field(default=False, metadata={"help": "keep loss_mask and feature columns"})
    # DDP would look for unused weights from the last TTT step's outputs and miss the head, which runs after it.
    ddp_find_unused_parameters: bool | None = field(default=False, metadata={"help": "must be False (DDP)"})

    def __post_init__(self) -> None:
        if self.ddp_find_unused_parameters:
            raise ValueError(
                "ddp_find_unused_parameters must be False: the draft uses all its weights at every step, and its "
                "head runs after the TTT steps' forwards, where DDP would not find it."
            )
        self.check_eagle3_options()  # before TrainingArguments' own set-up, which may touch devices
        super().__post_init__()


def install_draft_vocab(draft: nn.Module, dataset: Dataset | Any) -> DraftVocab:
    """Build the draft vocabulary from `dataset`'s supervised tokens (``loss_mask == 1``) and install it in `draft`.

    Returns the `DraftVocab` (its ``coverage`` is the share of supervised tokens the draft can propose).
    """
    base = _base_draft(draft)
    vocab = build_draft_vocab(dataset, base.config.vocab_size, base.config.draft_vocab_size)
    base.set_draft_vocab(vocab.d2t, vocab.t2d)
    logger.info(
        "Draft vocabulary: %d of %d target ids, covering %.2f%% of supervised tokens (%d ids seen, %d padded).",
        vocab.draft_vocab_size,
        vocab.target_vocab_size,
        100 * vocab.coverage,
        vocab.num_seen,
        vocab.num_padded,
    )
    return vocab


class Eagle3Trainer(WholeCheckpoints, Trainer):
    r"""`Trainer` for EAGLE-3 drafts: features (online from `target`, or offline in the batch) -> TTT -> loss.

    Distributed training runs one process per device (`accelerate launch`, `torchrun`; several machines too):

    * **DDP** (the default): the draft is replicated, each TTT step is a call of DDP's forward (the draft's own), so
      that gradients are averaged; an online target is replicated too.
    * **FSDP2** (``fsdp="full_shard auto_wrap"`` or ``"shard_grad_op auto_wrap"`` in the arguments, or an
      accelerate config with ``fsdp_version: 2``): accelerate shards the draft (its decoder layers, embedding and
      head are units of their own) and each TTT step calls the draft, its layers and its head, so that their hooks
      gather the weights and reduce-scatter the gradients; an online target is sharded layer by layer for forward passes only
      (`shard_frozen_target`, unless it was sharded at load time with `load_target(..., shard=True)`), so each
      process holds ``1/world_size`` of it. On CPU processes (gloo), where accelerate leaves its FSDP plugin off,
      the trainer switches it on. Checkpoints: ``fsdp_config["state_dict_type"]`` ``"FULL_STATE_DICT"`` (default;
      the gathered weights in ``pytorch_model_fsdp.bin``) or ``"SHARDED_STATE_DICT"`` (torch.distributed.checkpoint
      folders), with the optimizer state alike; training resumes from either. Every checkpoint and `save_model`
      also hold the gathered draft in its native layout, which `Eagle3DraftModel.from_pretrained` loads in one
      process. bf16 and ``gradient_checkpointing`` work under FSDP. A checkpoint is written whole or not at all
      (`WholeCheckpoints`).

    Refused with a `ValueError`: DeepSpeed (every ZeRO stage), FSDP1 (``fsdp_version: 1``), FSDP's
    ``cpu_ram_efficient_loading`` (it leaves weights loaded with `from_pretrained` empty on all processes but the
    first), FSDP's own ``activation_checkpointing`` (use ``gradient_checkpointing``), a PEFT draft under FSDP, and
    `torch.nn.DataParallel` (several GPUs in one process).

    Args:
        model: the draft (`Eagle3DraftModel`, or a `peft.PeftModel` around one).
        args: `Eagle3TrainingArguments`.
        target: the frozen target (online mode): put in eval mode, without gradients, on the training device (or
            sharded, under FSDP); it is not handed to the optimizer or the checkpoints. A PEFT-wrapped target works
            (tested under DDP, not under FSDP).
        other arguments: as for `Trainer`; the default collator is `Eagle3DataCollator`.

    Example:

    ```python
    >>> args = Eagle3TrainingArguments("out", max_steps=100, per_device_train_batch_size=2)  # doctest: +SKIP
    >>> trainer = Eagle3Trainer(draft, args, target=target, train_dataset=dataset)  # doctest: +SKIP
    >>> trainer.train(); trainer.save_model("out")  # doctest: +SKIP
    ```
    """

    # compute_loss returns a per-micro-batch mean, so the Trainer must divide it by the accumulation steps.
    loss_is_scaled_for_ga = False

    def __init__(
        self,
        model: nn.Module,
        args: Eagle3TrainingArguments,
        target: PreTrainedModel | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, Eagle3TrainingArguments):
            raise ValueError(f"args must be Eagle3TrainingArguments, got {type(args).__name__}.")
        draft = _base_draft(model)
        if not isinstance(draft, Eagle3DraftModel):
            raise ValueError(
                f"model must be an Eagle3DraftModel (or a PEFT model around one), got {type(draft).__name__}."
            )
        if args.draft_vocab_size is not None and args.draft_vocab_size != draft.config.draft_vocab_size:
            raise ValueError(
                f"args.draft_vocab_size={args.draft_vocab_size} but the draft's head predicts "
                f"{draft.config.draft_vocab_size} tokens."
            )
        if args.feature_mode == "online":
            if target is None:
                raise ValueError("feature_mode='online' needs the frozen target: pass target=... .")
            draft.config.check_target_config(target.config)
            target.requires_grad_(False)
            target.eval()
        refuse_deepspeed(bool(args.deepspeed))
        if args.n_gpu > 1:
            raise ValueError(
                "Eagle3Trainer does not support torch.nn.DataParallel; launch one process per GPU with "
                "`accelerate launch` or `torchrun` instead."
            )
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None:
                self._check_dataset(draft, dataset, args, name)
        if data_collator is None:
            pad = draft.config.pad_token_id if draft.config.pad_token_id is not None else 0
            data_collator = Eagle3DataCollator(pad_token_id=pad, max_length=args.max_length, packing=args.packing)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            **kwargs,
        )
        # Our compute_loss takes no loss kwargs; this keeps the Trainer from counting label tokens for it.
        self.model_accepts_loss_kwargs = False
        self._check_distributed(model)
        if target is not None and self.is_fsdp_enabled:
            target = shard_frozen_target(target, mesh=fsdp_mesh(self.accelerator))  # shards on this rank's device
        elif target is not None:
            target = target.to(self.args.device)
        self.target = target
        self._metric_sums: dict[str, torch.Tensor] = {}
        # CPU seconds spent in train() (logged as cpu_s): this process's start, and the resumed run's earlier total.
        self._cpu_at_start = time.process_time()
        self._cpu_earlier: float | None = None

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, with the FSDP plugin also switched on for CPU processes (`enable_cpu_fsdp`)."""
        super().create_accelerator_and_postprocess()
        self.is_fsdp_enabled = self.is_fsdp_enabled or enable_cpu_fsdp(self.accelerator, self.args.fsdp_plugin_args)

    def _check_distributed(self, model: nn.Module) -> None:
        """Refuse the distributed set-ups that are not supported, naming the setting to change."""
        if self.is_deepspeed_enabled:
            refuse_deepspeed(True)
        if not self.is_fsdp_enabled:
            return
        check_fsdp_plugin(self.accelerator.state.fsdp_plugin)
        if model is not _base_draft(model):
            raise ValueError("A PEFT-wrapped draft is not supported under FSDP; train it under DDP.")

    @staticmethod
    def _check_dataset(draft: Eagle3DraftModel, dataset: Any, args: Eagle3TrainingArguments, name: str) -> None:
        if args.feature_mode == "offline":
            row = dataset[0]
            missing = [k for k in FEATURE_KEYS if k not in row]
            if missing:
                raise ValueError(
                    f"feature_mode='offline' needs rows with {list(FEATURE_KEYS)}; {name} rows lack {missing} "
                    "(use OfflineFeatureDataset, or feature_mode='online' with the target)."
                )
        if isinstance(dataset, OfflineFeatureDataset):
            num_layers = draft.config.target_num_hidden_layers
            if num_layers is not None and dataset.layer_ids != draft.config.resolved_target_layer_ids(num_layers):
                raise ValueError(
                    f"The features in {dataset.folder!r} tap layers {dataset.layer_ids}, the draft reads "
                    f"{draft.config.resolved_target_layer_ids(num_layers)}."
                )
            placeholder = draft.config.uses_draft_vocab and not draft.d2t.any()
            if name == "train_dataset" and placeholder and args.build_draft_vocab:
                install_draft_vocab(draft, dataset.token_rows())  # count the features' tokens
        elif (
            name == "train_dataset"
            and args.build_draft_vocab
            and draft.config.uses_draft_vocab
            and not draft.d2t.any()
            and isinstance(dataset, Dataset)
            and {"input_ids", "loss_mask"} <= set(dataset.column_names)
        ):
            install_draft_vocab(draft, dataset)

    # --------------------------------------------------------------------------------------------------------------
    # loss
    def _ttt(self, model: nn.Module, draft: Eagle3DraftModel, **batch: torch.Tensor) -> TTTOutput:
        with self.accelerator.autocast():  # the head's compute dtype; the draft's forward may carry accelerate's too
            states = ttt_forward(
                model,
                batch["input_ids"],
                batch["target_hidden_states"],
                batch["attention_mask"],
                self.args.ttt_length,
                return_hidden=True,
                position_ids=batch.get("position_ids"),
            )
            device = states[0].device.type
            compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        heads = ttt_head_kwargs(draft.lm_head, self.accelerator.autocast, compute_dtype, self.args.loss)
        return ttt_loss(
            states,
            batch["target_top_logits"],
            batch["loss_mask"],
            draft.t2d,
            self.args.ttt_decay,
            target_ids=batch["target_top_ids"],
            position_ids=batch.get("position_ids"),
            **heads,
        )

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, TTTOutput]:
        draft = _base_draft(self.accelerator.unwrap_model(model))
        batch = {k: inputs[k] for k in ("input_ids", "attention_mask", "loss_mask", "position_ids") if k in inputs}
        if self.args.feature_mode == "online":
            batch["target_hidden_states"], batch["target_top_logits"], batch["target_top_ids"] = online_features(
                self.target,
                draft,
                batch["input_ids"],
                batch["attention_mask"],
                self.args.logits_top_k,
                position_ids=batch.get("position_ids"),
            )
            reshard(self.target)  # a sharded target keeps no gathered weights between batches
        else:
            missing = [k for k in FEATURE_KEYS if k not in inputs]
            if missing:
                raise ValueError(f"feature_mode='offline' but the batch lacks {missing}; it has {sorted(inputs)}.")
            batch.update({k: inputs[k] for k in FEATURE_KEYS})
        out = self._ttt(model, draft, **batch)  # each TTT step calls `model`: DDP's or FSDP2's hooks run around it
        self._accumulate(out, "train" if model.training else "eval")
        return (out.loss, out) if return_outputs else out.loss

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the draft in its native layout (`Eagle3DraftModel.from_pretrained` reloads it), or a PEFT adapter.

        Under FSDP the draft's full state dict is gathered (a collective: every process must call this) and written
        by the main process, whatever the FSDP ``state_dict_type``; checkpoints hold it next to FSDP's own model
        and optimizer state, from which training resumes.
        """
        if not self.is_fsdp_enabled:
            super().save_model(output_dir, _internal_call)
            return
        state_dict = self.accelerator.get_state_dict(self.model)
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[torch.Tensor, None, None]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # --------------------------------------------------------------------------------------------------------------
    # metrics
    def _accumulate(self, out: TTTOutput, mode: str) -> None:
        k = out.step_losses.numel()
        row = torch.cat(
            [
                out.step_losses.float(),
                out.step_correct.float(),
                out.step_supervised.float(),
                out.step_in_vocab.float(),
                out.step_losses.new_ones(1, dtype=torch.float32),
            ]
        )
        if mode not in self._metric_sums or self._metric_sums[mode].numel() != 4 * k + 1:
            self._metric_sums[mode] = torch.zeros_like(row)
        self._metric_sums[mode] += row.detach()

    def _pop_metrics(self, mode: str, prefix: str) -> dict[str, float]:
        sums = self.accelerator.reduce(self._metric_sums.pop(mode), reduction="sum").cpu()
        k = (sums.numel() - 1) // 4
        losses, correct, supervised, in_vocab = sums[:k], sums[k : 2 * k], sums[2 * k : 3 * k], sums[3 * k : 4 * k]
        batches = sums[-1]
        acc = correct / supervised.clamp(min=1)
        metrics = {f"{prefix}acc_{j}": round(float(acc[j]), 4) for j in range(k)}
        metrics[f"{prefix}coverage"] = round(float(in_vocab[0] / supervised[0].clamp(min=1)), 4)
        metrics.update({f"{prefix}loss_{j}": round(float(losses[j] / batches.clamp(min=1)), 4) for j in range(k)})
        metrics[f"{prefix}sim_accept_len"] = round(simulated_acceptance_length(acc), 4)
        return metrics

    def create_model_card(self, **kwargs: Any) -> None:
        """Write the draft's own model card (`eagle3_hf.modeling.model_card`) into `args.output_dir`.

        `Trainer.push_to_hub` calls this; the stock card would describe a fine-tuned language model.
        """
        if not self.is_world_process_zero():
            return
        draft = _base_draft(self.accelerator.unwrap_model(self.model))
        info = {"steps": self.state.global_step, "ttt_length": self.args.ttt_length, **(draft.training_info or {})}
        build_model_card(draft.config, info).save(os.path.join(self.args.output_dir, CARD_NAME))

    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._cpu_at_start = time.process_time()
        self._cpu_earlier = None  # read at the first log: a resumed run's log history is loaded inside train()
        return super().train(*args, **kwargs)

    def _cpu_seconds(self) -> float:
        """This process's CPU seconds in `train()`, summed over a resumed run's earlier parts (from the logs the
        checkpoint carries): the x axis of learning curves against CPU-hours."""
        if self._cpu_earlier is None:
            self._cpu_earlier = next((log["cpu_s"] for log in reversed(self.state.log_history) if "cpu_s" in log), 0.0)
        return self._cpu_earlier + time.process_time() - self._cpu_at_start

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the TTT metrics accumulated since the last log (gathered across processes), the CPU seconds spent
        training (`cpu_s`), and log."""
        logs["cpu_s"] = round(self._cpu_seconds(), 1)
        if "loss" in logs and "train" in self._metric_sums:
            logs.update(self._pop_metrics("train", ""))
        if "eval_loss" in logs and "eval" in self._metric_sums:
            logs.update(self._pop_metrics("eval", "eval_"))
        super().log(logs, start_time)
