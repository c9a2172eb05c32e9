"""Train a tiny EAGLE-3 draft for a tiny random target on CPU: the whole training pipeline in seconds.

    python examples/train_tiny.py --output tiny_draft
    python examples/train_tiny.py --output tiny_draft --offline          # precomputed features
    accelerate launch --multi_gpu --num_processes 2 examples/train_tiny.py --output tiny_draft   # 2 processes, CPU too

The target is a random 8-layer Llama whose head is sharpened so that its next-token choice is a clear function of
the context; the data are arithmetic token sequences (a 4-token prompt, then supervised "assistant" tokens). The
last line printed is a JSON summary (final per-step accuracies, simulated acceptance length, whether every process
ended with the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.features import precompute_features
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments, install_draft_vocab
from eagle3_hf.utils.tiny import make_tiny_target, synthetic_dataset


def params_in_sync(model: torch.nn.Module) -> bool:
    """True when every process holds the same trainable weights (always True in one process)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return True
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters() if p.requires_grad])
    gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--ttt-length", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--draft-vocab-size", type=int, default=48)
    parser.add_argument("--offline", action="store_true", help="precompute the target features first")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    target = make_tiny_target()
    dataset = synthetic_dataset()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=args.draft_vocab_size)
    vocab = install_draft_vocab(draft, dataset)
    train_dataset, mode = dataset, "online"
    if args.offline:
        folder = os.path.join(args.output, "features")
        precompute_features(target, dataset, folder, dtype=torch.float32, shard_size=8)
        train_dataset, mode = OfflineFeatureDataset(folder), "offline"
    training_args = Eagle3TrainingArguments(
        output_dir=args.output,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        ttt_length=args.ttt_length,
        feature_mode=mode,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,  # a CPU example: also under torchrun on a GPU machine (gloo)
    )
    trainer = Eagle3Trainer(
        draft, training_args, target=target if mode == "online" else None, train_dataset=train_dataset
    )
    trainer.train()
    trainer.save_model(args.output)
    trainer.save_state()
    in_sync = params_in_sync(trainer.model)
    last = next((log for log in reversed(trainer.state.log_history) if "acc_0" in log), {})
    if trainer.is_world_process_zero():
        summary = {k: v for k, v in last.items() if k.startswith(("acc_", "sim_", "loss", "coverage"))}
        summary.update(
            data_coverage=round(vocab.coverage, 4),
            in_sync=in_sync,
            world_size=training_args.world_size,
            steps=trainer.state.global_step,
        )
        print(json.dumps(summary))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Launched by torchrun or accelerate: wait for every process, then leave at once, group and all. Neither
        # teardown is safe here (torch 2.13, gloo, seen on a loaded 2-core machine): destroying the group can hang,
        # as ProcessGroupGloo's destructor joins its worker thread while holding the GIL and that thread may still
        # be releasing the all_gather above, whose Python-made tensors need the GIL; left to the interpreter's exit
        # instead, gloo's threads can abort a finished run ("terminate called without an active exception").
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if in_sync else 1)
    return 0 if in_sync else 1


if __name__ == "__main__":
    raise SystemExit(main())
