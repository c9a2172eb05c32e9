"""Where a training step's time goes: the shipped recipe's step cut into its parts, in CPU-seconds per supervised token.

`eagle3-hf train` spends each micro-batch on: collating the batch (data loading and padding), the target's online
forward (its taps and top-k logits, no gradients), the draft's TTT forward (``ttt_length`` steps of the one layer),
the head and loss on the supervised rows, the backward, and -- once per ``gradient_accumulation_steps`` micro-batches
-- the optimizer. This script builds the trainer exactly as the command does (the same arguments are accepted:
anything after ``--`` is passed to `eagle3-hf train`'s parser), then runs those parts itself on the trainer's own
data loader, timing each with the process's CPU clock, and prints a table: seconds per micro-batch, share of the
step, CPU-seconds per 1,000 supervised tokens, plus the padding share of the batches (tokens computed on padding).

    OMP_NUM_THREADS=1 python scripts/research/train_step_profile.py --batches 12 -- \
        --target smollm2 --data work_data/regen_sharegpt work_data/regen_alpaca SHAREGPT_JSON \
        --init-draft eagle3_hf/drafts/smollm2-135m-instruct --output work_data/profile --ttt-length 7 --max-length 384 \
        --batch-size 2 --gradient-accumulation-steps 2 --learning-rate 1e-4 --dtype bfloat16

The optimizer is the trainer's own (`create_optimizer`); nothing is saved. Timings are CPU seconds of this process
(``time.process_time``), so with one thread they are the wall time of a step that has the machine to itself.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import time

import torch

PARTS = ["collate", "target forward", "draft TTT forward", "head + loss", "backward", "optimizer"]


class Clock:
    """Accumulated CPU seconds per part."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._start = 0.0

    def start(self) -> None:
        self._start = time.process_time()

    def stop(self, part: str) -> None:
        now = time.process_time()
        self.seconds[part] += now - self._start
        self._start = now


def build_trainer(train_argv: list[str]):  # noqa: ANN201 - an Eagle3Trainer, imported late
    """The trainer `eagle3-hf train` would build for `train_argv` (its data, target, draft and arguments)."""
    from transformers.trainer_utils import set_seed

    from eagle3_hf.commands import train as train_command
    from eagle3_hf.commands.train_draft import build_draft
    from eagle3_hf.targets import load_target, resolve_target
    from eagle3_hf.training.trainer import Eagle3Trainer

    args = train_command.parse_cli(train_argv)
    train_command.check_train_arguments(args)
    offline = args.features is not None  # --features: the trainer reads the target's features from disk
    training_args = train_command._training_arguments(args, offline=offline)
    resolve_target(args.target)
    set_seed(training_args.seed)
    dataset, _, vocab_rows = train_command._data(args, training_args, offline=offline)
    target = load_target(args.target, dtype=getattr(torch, args.dtype))  # the draft takes its embedding from it
    draft = build_draft(args, target, vocab_rows)
    return Eagle3Trainer(draft, training_args, target=None if offline else target, train_dataset=dataset)


def fused_head(reference: bool, bf16: bool):  # noqa: ANN201 - the trainer's fused head and loss, or None
    """What the trainer runs for the head and loss: `head_cross_entropy` where the tree has it (unless
    `reference`), else None (the separate ops)."""
    if reference or importlib.util.find_spec("eagle3_hf.training.head_loss") is None:
        return None
    from eagle3_hf.training.head_loss import head_cross_entropy

    dtype = torch.bfloat16 if bf16 else None

    def run(weight: torch.Tensor, rows: torch.Tensor, p: torch.Tensor, columns: torch.Tensor | None):  # noqa: ANN202
        return head_cross_entropy(rows, weight, p, columns, dtype)

    return run


def profile(trainer, batches: int, warmup: int, reference_head: bool = False) -> dict:  # noqa: ANN001
    from eagle3_hf.training.features import online_features
    from eagle3_hf.training.ttt import ttt_forward, ttt_loss

    args = trainer.args
    if trainer.target is None:
        raise ValueError("The profile times the online recipe's target forward; --features (offline) is not supported.")
    draft = trainer.model
    draft.train()
    trainer.create_optimizer()
    optimizer = trainer.optimizer
    loader = iter(trainer.get_train_dataloader())
    clock = Clock()
    supervised = tokens = real = 0
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    fused = fused_head(reference_head, args.bf16)
    for index in range(warmup + batches):
        if index == warmup:  # the first batches pay one-time costs (allocations, prepacking)
            clock, supervised, tokens, real = Clock(), 0, 0, 0
        clock.start()
        batch = next(loader)
        clock.stop("collate")
        ids, mask, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        hidden, top_logits, top_ids = online_features(trainer.target, draft, ids, mask, args.logits_top_k)
        clock.stop("target forward")
        with autocast:
            states = ttt_forward(draft, ids, hidden, mask, args.ttt_length, return_hidden=True)
        clock.stop("draft TTT forward")

        def head(rows: torch.Tensor) -> torch.Tensor:
            with autocast:
                return draft.lm_head(rows)

        heads = {"fused_head": functools.partial(fused, draft.lm_head.weight)} if fused else {"head": head}
        out = ttt_loss(states, top_logits, loss_mask, draft.t2d, args.ttt_decay, target_ids=top_ids, **heads)
        clock.stop("head + loss")
        (out.loss / args.gradient_accumulation_steps).backward()
        clock.stop("backward")
        if (index + 1) % args.gradient_accumulation_steps == 0:
            torch.nn.utils.clip_grad_norm_(draft.parameters(), args.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            clock.stop("optimizer")
        supervised += int(loss_mask.sum())
        tokens += ids.numel()
        real += int(mask.sum())
    total = sum(clock.seconds.values())
    rows = [
        {
            "part": part,
            "seconds_per_batch": s / batches,
            "share": s / total,
            "cpu_s_per_1k_supervised": 1000 * s / supervised,
        }
        for part, s in clock.seconds.items()
    ]
    return {
        "batches": batches,
        "batch_size": args.per_device_train_batch_size,
        "threads": torch.get_num_threads(),
        "supervised_tokens": supervised,
        "tokens": tokens,
        "padding_share": 1 - real / tokens,
        "cpu_s_per_1k_supervised": 1000 * total / supervised,
        "seconds_per_batch": total / batches,
        "head": "separate ops" if fused is None else "fused",
        "parts": rows,
    }


def format_table(report: dict) -> str:
    lines = ["| part | s per micro-batch | share | CPU-s per 1,000 supervised tokens |", "|---|---|---|---|"]
    for row in report["parts"]:
        lines.append(
            f"| {row['part']} | {row['seconds_per_batch']:.3f} | {100 * row['share']:.1f}% | "
            f"{row['cpu_s_per_1k_supervised']:.3f} |"
        )
    lines.append(
        f"| **step (all parts)** | {report['seconds_per_batch']:.3f} | 100% | {report['cpu_s_per_1k_supervised']:.3f} |"
    )
    lines.append("")
    lines.append(
        f"Head and loss: {report.get('head', 'separate ops')}. "
        f"{report['batches']} micro-batches of {report['batch_size']}, {report['threads']} thread(s): "
        f"{report['supervised_tokens']:,} supervised of {report['tokens']:,} computed tokens; "
        f"{100 * report['padding_share']:.1f}% of computed tokens are padding."
    )
    return "\n".join(lines)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options this script shares with `train_throughput`: the report file and the train arguments."""
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `eagle3-hf train` arguments")


def train_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The `eagle3-hf train` arguments given after ``--`` (an error if there are none)."""
    train_argv = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if not train_argv:
        parser.error("give the `eagle3-hf train` arguments after `--`.")
    return train_argv


def write_report(path: str | None, report: dict) -> None:
    """Write `report` as JSON to `path` (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=12, help="micro-batches timed (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="micro-batches run first and not timed")
    parser.add_argument(
        "--reference-head",
        action="store_true",
        help="run the head and loss as separate ops (the step before the fused head)",
    )
    add_run_options(parser)
    args = parser.parse_args()
    if args.batches < 1 or args.warmup < 0:
        parser.error(f"--batches must be >= 1 and --warmup >= 0, got {args.batches} and {args.warmup}.")
    trainer = build_trainer(train_arguments(parser, args))
    report = profile(trainer, args.batches, args.warmup, args.reference_head)
    print(format_table(report))
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
