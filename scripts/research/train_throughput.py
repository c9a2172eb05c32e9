"""Training throughput: conversations and supervised tokens per CPU-hour of `Trainer.train()` on the shipped recipe.

The trainer is built exactly as `eagle3-hf train` builds it from the arguments after ``--`` (`train_step_profile`'s
`build_trainer`), then trained for ``--warmup + --steps`` optimizer steps; the process's CPU seconds
(``time.process_time``) and the conversations and supervised tokens of the micro-batches are counted over the last
``--steps`` steps only (the first pay one-time costs). Nothing is saved. Which code runs is whatever ``eagle3_hf``
the interpreter imports, so the same script measures two trees on the same data and seed, e.g. main's::

    git worktree add --detach ../main-tree main
    PYTHONPATH=../main-tree OMP_NUM_THREADS=1 python scripts/research/train_throughput.py --steps 12 -- \\
        --target smollm2 --data work_data/regen_sharegpt work_data/regen_alpaca SHAREGPT_JSON \\
        --init-draft eagle3_hf/drafts/smollm2-135m-instruct --output work_data/throughput --ttt-length 7 \\
        --max-length 384 --batch-size 2 --gradient-accumulation-steps 2 --learning-rate 1e-4 --dtype bfloat16

The report names the package's git commit (with ``+changes`` when its package differs from it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from train_step_profile import add_run_options, build_trainer, train_arguments, write_report


class Meter:
    """Counts the micro-batches' conversations and supervised tokens and the CPU seconds between two optimizer
    steps (after `warmup` and after `warmup + steps`)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.timing = False
        self.conversations = self.supervised = 0
        self.cpu_s = self.wall_s = 0.0
        self._cpu = self._wall = 0.0

    def count(self, inputs: dict[str, Any]) -> None:
        if self.timing:
            self.conversations += int(inputs["input_ids"].shape[0])
            self.supervised += int(inputs["loss_mask"].sum())

    def step_ended(self, step: int) -> None:
        if step == self.warmup:
            self.timing, self._cpu, self._wall = True, time.process_time(), time.perf_counter()
        elif step == self.warmup + self.steps and self.timing:
            self.cpu_s, self.wall_s = time.process_time() - self._cpu, time.perf_counter() - self._wall
            self.timing = False


def package_tree() -> str:
    """The git commit of the imported eagle3_hf's checkout (``+changes`` if its package has edits)."""
    import eagle3_hf

    folder = os.path.dirname(os.path.dirname(os.path.abspath(eagle3_hf.__file__)))

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", folder, *args], capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", "eagle3_hf")
    return commit + ("+changes" if changed else "")


def measure(train_argv: list[str], steps: int, warmup: int) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    quiet = [
        "--max-steps",
        str(warmup + steps),
        "--save-strategy",
        "no",
        "--logging-steps",
        str(10**9),
        "--report-to",
        "none",
        "--disable-tqdm",
        "true",
    ]
    trainer = build_trainer(train_argv + quiet)  # the last occurrence of an option wins
    meter = Meter(warmup, steps)

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201, ANN003
            meter.step_ended(state.global_step)

    compute_loss = trainer.compute_loss

    def counted(model, inputs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        meter.count(inputs)
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counted
    trainer.add_callback(StepClock())
    trainer.train()
    if meter.cpu_s <= 0:
        raise RuntimeError(f"Training stopped before step {warmup + steps}; nothing was timed.")
    hours = meter.cpu_s / 3600
    return {
        "commit": package_tree(),
        "threads": torch.get_num_threads(),
        "steps": steps,
        "warmup_steps": warmup,
        "conversations": meter.conversations,
        "supervised_tokens": meter.supervised,
        "cpu_s": round(meter.cpu_s, 2),
        "wall_s": round(meter.wall_s, 2),
        "conversations_per_cpu_hour": round(meter.conversations / hours),
        "supervised_tokens_per_cpu_hour": round(meter.supervised / hours),
        "cpu_s_per_1k_supervised": round(1000 * meter.cpu_s / meter.supervised, 3),
        "cpu_hours_per_1k_conversations": round(1000 * hours / meter.conversations, 3),
        "train_args": train_argv,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps timed (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps run first and not timed")
    add_run_options(parser)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps and --warmup must be >= 1, got {args.steps} and {args.warmup}.")
    report = measure(train_arguments(parser, args), args.steps, args.warmup)
    print(json.dumps(report, indent=2))
    print(
        f"{report['commit']}: {report['conversations_per_cpu_hour']:,} conversations and "
        f"{report['supervised_tokens_per_cpu_hour']:,} supervised tokens per CPU-hour "
        f"({report['threads']} thread(s), {args.steps} steps after {args.warmup}).",
        file=sys.stderr,
    )
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
