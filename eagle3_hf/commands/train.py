"""`eagle3-hf train`: train a draft with `Eagle3Trainer` and the TTT loss (`eagle3_hf.training.trainer`)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from transformers.trainer_utils import get_last_checkpoint, set_seed

from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.targets import load_target, load_tokenised_data
from eagle3_hf.training.distributed import check_fsdp_loading, init_distributed_from_launcher
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments, install_draft_vocab


def add_cli_arguments(parser: Any) -> None:
    parser.add_argument("--target", required=True, help='target model: a folder, a .gguf file, or "smollm2"')
    parser.add_argument("--data", default=None, nargs="+", help="conversations: ShareGPT/messages/Alpaca JSON or "
                        "JSONL, or folders of regenerated shard_*.jsonl; several are joined (online features)")  # fmt: skip
    parser.add_argument("--features", nargs="+", default=None,
                        help="folders written by `eagle3-hf features` (offline features); several are joined")  # fmt: skip
    parser.add_argument("--output", required=True, help="folder for checkpoints, the final draft, trainer_state.json")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--ttt-decay", type=float, default=0.8)
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="draft head size (default: target vocab)")
    parser.add_argument("--max-length", type=int, default=2048, help="tokens per conversation (longer ones are cut)")
    parser.add_argument("--max-conversations", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--warmup-ratio", type=float, default=0.015, help="share of steps of linear warmup")
    parser.add_argument("--batch-size", type=int, default=1, help="per-device batch size")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--save-steps", type=int, default=500)
    parser.add_argument("--save-total-limit", type=int, default=2,
                        help="checkpoints kept in --output (older ones are deleted; 0 keeps all)")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--init-draft", default=None, help="continue training this saved draft (keeps its vocabulary)")
    parser.add_argument(
        "--target-layer-ids", default=None,
        help="three comma-separated output_hidden_states ids to tap (low,mid,high; default 2,L//2,L-3); e.g. the "
        "same id three times for a top-layer-only ablation",
    )
    parser.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output, if any")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="target dtype and mixed precision of the draft (its master weights stay float32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fsdp", nargs="?", const=True, default=None,
                        help='FSDP2 under torchrun/accelerate launch, e.g. "full_shard auto_wrap" '
                        "(TrainingArguments.fsdp); the frozen target is sharded as it loads")  # fmt: skip
    parser.add_argument("--fsdp-config", default=None, help="JSON file: TrainingArguments.fsdp_config, e.g. "
                        '{"state_dict_type": "SHARDED_STATE_DICT"}')  # fmt: skip


def _run_train(args: Any) -> int:
    if (args.data is None) == (args.features is None):
        raise ValueError("Give exactly one of --data (conversations, online features) or --features (offline).")
    if args.save_total_limit < 0:
        raise ValueError(f"--save-total-limit must be >= 0 (0 keeps every checkpoint), got {args.save_total_limit}.")
    if not 0.0 <= args.warmup_ratio < 1.0:
        raise ValueError(f"--warmup-ratio is a share of the steps in [0, 1); got {args.warmup_ratio}.")
    set_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    offline = args.features is not None
    if offline:
        dataset = OfflineFeatureDataset(args.features)
        print(f"Offline features: {len(dataset)} samples from {dataset.folder}.")
    else:
        _, dataset, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations)
    # Under FSDP (--fsdp, or an accelerate FSDP config) each process loads only its shard of the target.
    fsdp = args.fsdp is not None or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    check_fsdp_loading()
    target = load_target(args.target, dtype=dtype, shard=fsdp and init_distributed_from_launcher()[1] > 1)
    if args.init_draft:
        draft = Eagle3DraftModel.from_pretrained(args.init_draft, target=target, dtype=torch.float32)
    else:
        size = args.draft_vocab_size
        if offline and size is None:
            size = int(dataset.t2d.sum())
        overrides = {}
        if args.target_layer_ids:
            try:
                overrides["target_layer_ids"] = [int(i) for i in args.target_layer_ids.split(",")]
            except ValueError as err:
                raise ValueError(
                    f"--target-layer-ids must be comma-separated integers, got {args.target_layer_ids!r}."
                ) from err
        draft = Eagle3DraftModel.from_target(target, draft_vocab_size=size, **overrides).float()
        if offline:
            draft.set_draft_vocab(dataset.d2t, dataset.t2d)
        elif draft.config.uses_draft_vocab:
            vocab = install_draft_vocab(draft, dataset)
            print(f"Draft vocabulary: {vocab.draft_vocab_size} of {vocab.target_vocab_size} ids, covering "
                  f"{100 * vocab.coverage:.2f}% of supervised tokens.")  # fmt: skip
    training_args = Eagle3TrainingArguments(
        output_dir=args.output, max_steps=args.max_steps, ttt_length=args.ttt_length, ttt_decay=args.ttt_decay,
        feature_mode="offline" if offline else "online", max_length=args.max_length,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_ratio, lr_scheduler_type="cosine",
        adam_beta2=0.95, max_grad_norm=0.5, weight_decay=0.0,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        save_steps=args.save_steps, save_total_limit=args.save_total_limit or None,
        logging_steps=args.logging_steps, seed=args.seed, report_to="none",
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, gradient_checkpointing=args.gradient_checkpointing,
        draft_vocab_size=args.draft_vocab_size, build_draft_vocab=False,
        use_cpu=not torch.cuda.is_available(),  # bf16 autocast on a CPU-only machine needs it said explicitly
        fsdp=args.fsdp, fsdp_config=args.fsdp_config,
    )  # fmt: skip
    trainer = Eagle3Trainer(draft, training_args, target=None if offline else target, train_dataset=dataset)
    checkpoint = get_last_checkpoint(args.output) if args.resume and os.path.isdir(args.output) else None
    if args.resume:
        print(f"Resuming from {checkpoint}." if checkpoint else f"No checkpoint in {args.output}: starting afresh.")
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(args.output)
    trainer.save_state()
    last = next((log for log in reversed(trainer.state.log_history) if "acc_0" in log), None)
    if last is not None:
        accs = " ".join(f"{last[f'acc_{j}']:.3f}" for j in range(args.ttt_length))
        print(f"Last logged accuracy per TTT step: {accs}; simulated acceptance length {last['sim_accept_len']:.2f}.")
    print(f"Saved the draft to {args.output} ({trainer.state.global_step} steps).")
    return 0


def run_cli(args: Any) -> int:
    try:
        return _run_train(args)
    except ValueError as err:
        print(f"eagle3-hf train: error: {err}", file=sys.stderr)
        return 2
