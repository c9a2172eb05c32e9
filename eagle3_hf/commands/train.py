"""`eagle3-hf train`: train a draft with `Eagle3Trainer` and the TTT loss (`eagle3_hf.training.trainer`)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from transformers.trainer_utils import get_last_checkpoint, set_seed

from eagle3_hf.commands.vocab import add_vocab_size_arguments
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.modeling.target_init import init_head_from_target, init_layer_from_target, remap_draft_vocab
from eagle3_hf.targets import load_target, load_tokenised_data
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.features import DEFAULT_TOP_K
from eagle3_hf.training.split import split_held_out
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.vocab import DraftVocab, build_draft_vocab, load_draft_vocab, select_draft_vocab


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
    add_vocab_size_arguments(parser, default=None)  # default: the target's whole vocabulary
    parser.add_argument("--vocab", default=None,
                        help="draft vocabulary file written by `eagle3-hf vocab` (fresh drafts)")  # fmt: skip
    parser.add_argument("--logits-top-k", type=int, default=DEFAULT_TOP_K,
                        help="target logits per token the soft labels are built from (online; offline features "
                        "carry their own)")  # fmt: skip
    parser.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
                        help="start a fresh draft's head from the target's head rows and final norm")  # fmt: skip
    parser.add_argument("--init-layer-from-target", action="store_true",
                        help="also copy the target's last decoder layer's MLP, o_proj and norms into a fresh draft")
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
    parser.add_argument("--init-draft", default=None,
                        help="continue training this saved draft (with --draft-vocab-size/--vocab: remapped to that "
                        "vocabulary, shared tokens keeping their head rows, new ones the target's)")  # fmt: skip
    parser.add_argument("--eval-steps", type=int, default=None,
                        help="evaluate every N steps on the held-out conversations (online) or --eval-features")
    parser.add_argument("--eval-features", nargs="+", default=None,
                        help="offline features of held-out conversations (`eagle3-hf features --split held-out`)")
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


def _fresh_draft_vocab(args: Any, dataset: Any, target_vocab_size: int) -> DraftVocab | None:
    """The vocabulary of a fresh draft: `--vocab`, or counted on the training data; None for the whole vocabulary."""
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
        print(choice.table())
        vocab = choice.vocab
    print(f"Draft vocabulary: {vocab.draft_vocab_size} of {vocab.target_vocab_size} ids, covering "
          f"{100 * vocab.coverage:.2f}% of the training data's supervised tokens.")  # fmt: skip
    return vocab


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
    eval_dataset = None
    if offline:
        dataset = OfflineFeatureDataset(args.features)
        print(f"Offline features: {len(dataset)} samples from {dataset.folder}.")
        if args.eval_features:
            eval_dataset = OfflineFeatureDataset(args.eval_features)
        elif args.eval_steps:
            raise ValueError("--eval-steps with --features needs --eval-features (features of held-out conversations).")
    else:
        _, everything, _ = load_tokenised_data(args.target, args.data, args.max_length, args.max_conversations)
        dataset, held_out = split_held_out(everything, args.held_out_fraction)
        print(f"Held out {len(held_out)} of {len(everything)} conversations (by id hash) from training.")
        if args.eval_steps and len(held_out) == 0:
            raise ValueError("--eval-steps: no conversation is held out; raise --held-out-fraction or add data.")
        eval_dataset = held_out if args.eval_steps else None
    target = load_target(args.target, dtype=dtype)
    if args.init_draft:
        draft = Eagle3DraftModel.from_pretrained(args.init_draft, target=target, dtype=torch.float32)
        if args.vocab or args.draft_vocab_size not in (None, draft.config.draft_vocab_size):
            vocab_size = target.config.get_text_config().vocab_size
            vocab = _fresh_draft_vocab(args, dataset, vocab_size)
            d2t, t2d = (vocab.d2t, vocab.t2d) if vocab is not None else (
                torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool))  # fmt: skip
            shared = remap_draft_vocab(draft, d2t, t2d, target if args.init_from_target else None)
            print(f"Remapped the draft to {d2t.numel()} ids: {shared} kept their head rows.")
    else:
        vocab = _fresh_draft_vocab(args, dataset, target.config.get_text_config().vocab_size)
        size = vocab.draft_vocab_size if vocab is not None else None
        overrides = {}
        if args.target_layer_ids:
            try:
                overrides["target_layer_ids"] = [int(i) for i in args.target_layer_ids.split(",")]
            except ValueError as err:
                raise ValueError(
                    f"--target-layer-ids must be comma-separated integers, got {args.target_layer_ids!r}."
                ) from err
        draft = Eagle3DraftModel.from_target(target, draft_vocab_size=size, **overrides).float()
        if vocab is not None:
            draft.set_draft_vocab(vocab.d2t, vocab.t2d)  # before the head copy: it picks the rows by these ids
        if args.init_from_target:
            print(f"Target-derived init: {', '.join(init_head_from_target(draft, target)) or 'nothing'} copied.")
        if args.init_layer_from_target:
            print(f"Target-derived init: {', '.join(init_layer_from_target(draft, target)) or 'nothing'} copied.")
    training_args = Eagle3TrainingArguments(
        output_dir=args.output, max_steps=args.max_steps, ttt_length=args.ttt_length, ttt_decay=args.ttt_decay,
        feature_mode="offline" if offline else "online", max_length=args.max_length, logits_top_k=args.logits_top_k,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_ratio, lr_scheduler_type="cosine",
        adam_beta2=0.95, max_grad_norm=0.5, weight_decay=0.0,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        save_steps=args.save_steps, save_total_limit=args.save_total_limit or None,
        logging_steps=args.logging_steps, seed=args.seed, report_to="none",
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, gradient_checkpointing=args.gradient_checkpointing,
        build_draft_vocab=False, eval_strategy="steps" if args.eval_steps else "no", eval_steps=args.eval_steps,
        per_device_eval_batch_size=args.batch_size,
        use_cpu=not torch.cuda.is_available(),  # bf16 autocast on a CPU-only machine needs it said explicitly
    )  # fmt: skip
    trainer = Eagle3Trainer(draft, training_args, target=None if offline else target, train_dataset=dataset,
                            eval_dataset=eval_dataset)  # fmt: skip
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
