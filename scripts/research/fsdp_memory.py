"""Per-process memory of online EAGLE-3 training under FSDP2: the formula against a measurement.

    torchrun --nproc_per_node 2 scripts/research/fsdp_memory.py --target smollm2     # FSDP2 over 2 processes
    python scripts/research/fsdp_memory.py --target smollm2                          # one process, nothing sharded

Loads the target (sharded while it loads under torchrun), trains a fresh draft a few steps on random token rows
(online features), then prints one JSON line per process: the bytes its shards of the target, the draft and
AdamW's moments really take (summed over its local tensors), what `fsdp_memory_per_process` predicts, and the
process's resident memory (RSS) before and after loading and training, and its peaks. For an RSS that follows the
live tensors, run it with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then returns every freed tensor to the system).
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
from datasets import Dataset

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.targets import load_target
from eagle3_hf.training.distributed import fsdp_memory_per_process, init_distributed_from_launcher, parameter_bytes
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments, install_draft_vocab

MIB = 2**20


def resident_mib() -> dict[str, float]:
    """Current and peak resident memory of this process (Linux), after handing freed heap back to the system."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status", encoding="utf-8") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {name: int(fields[key].split()[0]) / 1024 for name, key in (("now", "VmRSS"), ("peak", "VmHWM"))}


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # resets VmHWM to the current RSS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--output", default="fsdp_memory_run")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = init_distributed_from_launcher()
    before = resident_mib()
    target = load_target(args.target, shard=world > 1)
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(1, vocab, (args.seq_len,), generator=generator).tolist(),
            "loss_mask": [1] * args.seq_len,
        }
        for _ in range(4 * world * args.steps)
    ]
    dataset = Dataset.from_list(rows)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=args.draft_vocab_size).float()
    install_draft_vocab(draft, dataset)
    training = Eagle3TrainingArguments(
        output_dir=args.output,
        max_steps=args.steps,
        per_device_train_batch_size=1,
        ttt_length=3,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        logging_steps=1,
        fsdp="full_shard auto_wrap" if world > 1 else None,
    )
    trainer = Eagle3Trainer(draft, training, target=target, train_dataset=dataset)
    set_up = resident_mib()
    reset_peak()
    trainer.train()
    after = resident_mib()
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    measured = {
        "target": parameter_bytes(trainer.target)[0],
        "draft": parameter_bytes(trainer.model)[0],
        "optimizer": sum((t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size() for t in states),
    }
    estimate = fsdp_memory_per_process(trainer.target, trainer.model, world)
    print(
        json.dumps(
            {
                "rank": rank,
                "world_size": world,
                "measured_mib": {k: round(v / MIB, 1) for k, v in measured.items()},
                "formula_mib": {k: round(v / MIB, 1) for k, v in estimate.items()},
                "rss_mib": {
                    "before_load": round(before["now"]),
                    "peak_while_loading": round(set_up["peak"]),
                    "after_loading": round(set_up["now"]),
                    "peak_while_training": round(after["peak"]),
                    "after_training": round(after["now"]),
                },
            }
        )
    )
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
