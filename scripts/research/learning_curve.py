"""Learning curve of a training run: held-out accuracy of its checkpoints against steps and CPU-hours.

Evaluates the run's starting draft (step 0) and every `--every`-th checkpoint in `--run` with the project's one
evaluation (`eagle3_hf.training.evaluation.evaluate_draft`: teacher-forced TTT accuracy against the target's
full-vocabulary top token, coverage, simulated acceptance length) on each `--eval NAME=DATA` set, and writes one CSV
row per (checkpoint, set) plus a PNG of step-0 accuracy and simulated acceptance length against steps and CPU-hours.
Results already in the CSV are kept, so rerunning after more training only evaluates the new checkpoints.

CPU time per step comes from the run's own logs: `Eagle3Trainer` logs `cpu_s`, the CPU seconds its process has spent
training, counted on across resumes.

Usage (SmolLM2; `regen_mtbench/` from examples/data/smollm2_mtbench_turn1_regen.tar.gz):

    python scripts/research/learning_curve.py --run work_data/draft_mix \
        --init-draft eagle3_hf/drafts/smollm2-135m-instruct \
        --eval "MT-bench turn 1=work_data/regen_mtbench" \
        --eval "held-out ShareGPT=work_data/regen_sharegpt:held-out" \
        --csv scripts/research/results/curve/curve.csv --png scripts/research/results/curve/curve.png
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re

import torch

from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.training.evaluation import evaluate_draft
from eagle3_hf.training.split import split_filter
from eagle3_hf.training.tokenise import tokenise_data

FIELDS = ["step", "cpu_hours", "set", "conversations", "supervised_tokens", "coverage", "sim_accept_len"] + [
    f"acc_{j}" for j in range(7)
]


def checkpoints(run: str) -> list[tuple[int, str]]:
    found = []
    for name in os.listdir(run):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        if match and os.path.isfile(os.path.join(run, name, "config.json")):
            found.append((int(match.group(1)), os.path.join(run, name)))
    return sorted(found)


def cpu_seconds_by_step(run: str) -> list[tuple[int, float]]:
    """(step, process CPU seconds since training started) pairs, increasing."""
    pairs: list[tuple[int, float]] = []
    state = None
    for _, path in reversed(checkpoints(run)):
        candidate = os.path.join(path, "trainer_state.json")
        if os.path.isfile(candidate):
            state = candidate
            break
    if state is not None:
        with open(state, encoding="utf-8") as f:
            history = json.load(f)["log_history"]
        pairs = [(int(log["step"]), float(log["cpu_s"])) for log in history if "cpu_s" in log]
    return sorted(set(pairs))


def cpu_hours_at(step: int, pairs: list[tuple[int, float]]) -> float | None:
    if step == 0:
        return 0.0
    for (s0, c0), (s1, c1) in zip(pairs, pairs[1:]):
        if s0 <= step <= s1:
            return (c0 + (c1 - c0) * (step - s0) / max(s1 - s0, 1)) / 3600
    if pairs and step > pairs[-1][0] and len(pairs) > 1:  # a little past the last sample: extrapolate the pace
        (s0, c0), (s1, c1) = pairs[0], pairs[-1]
        return (c1 + (c1 - c0) / max(s1 - s0, 1) * (step - s1)) / 3600
    return None


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = sorted((r for r in rows if r["set"] == name), key=lambda r: int(r["step"]))
        steps = [int(r["step"]) for r in mine]
        axes[0].plot(steps, [float(r["acc_0"]) for r in mine], marker="o", label=f"{name}: step-0 accuracy")
        axes[0].plot(
            steps,
            [float(r["sim_accept_len"]) - 1 for r in mine],
            marker="x",
            linestyle="--",
            label=f"{name}: simulated acceptance - 1",
        )
        timed = [r for r in mine if r["cpu_hours"] not in ("", None)]
        axes[1].plot([float(r["cpu_hours"]) for r in timed], [float(r["acc_0"]) for r in timed], marker="o", label=name)
    axes[0].set_xlabel("training steps")
    axes[1].set_xlabel("CPU-hours of training (one process)")
    axes[1].set_ylabel("step-0 accuracy (full vocabulary)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Held-out accuracy of the draft while it trains")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="training output folder (checkpoint-N folders)")
    parser.add_argument("--init-draft", default=None, help="the draft the run started from (step 0)")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument(
        "--eval",
        action="append",
        required=True,
        metavar="NAME=DATA[:held-out]",
        help="an evaluation set; ':held-out' keeps only the conversations training leaves out",
    )
    parser.add_argument("--max-conversations", type=int, default=200, help="per set")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--every", type=int, default=1, help="evaluate every n-th checkpoint (and the last)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--csv", required=True)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    sets = {}
    for spec in args.eval:
        name, _, data = spec.partition("=")
        data, _, split = data.partition(":")
        select = split_filter(split or "all")
        tokenizer = load_tokenizer(args.target)
        rows, _ = tokenise_data(tokenizer, [data], args.max_length, args.max_conversations, select)
        sets[name] = rows
    target = load_target(args.target, dtype=dtype)
    done: list[dict] = []
    if os.path.isfile(args.csv):
        with open(args.csv, encoding="utf-8") as f:
            done = list(csv.DictReader(f))
    seen = {(int(r["step"]), r["set"]) for r in done}
    found = checkpoints(args.run)
    chosen = [c for i, c in enumerate(found) if i % args.every == args.every - 1 or i == len(found) - 1]
    if args.init_draft:
        chosen = [(0, args.init_draft), *chosen]
    pairs = cpu_seconds_by_step(args.run)
    for step, path in chosen:
        for name, rows in sets.items():
            if (step, name) in seen:
                continue
            draft = load_draft_for(args.target, target, path).to(dtype=dtype)
            metrics = evaluate_draft(draft, target, rows, batch_size=4)
            hours = cpu_hours_at(step, pairs)
            row = {
                "step": step,
                "cpu_hours": "" if hours is None else round(hours, 3),
                "set": name,
                **{k: metrics.get(k) for k in FIELDS if k in metrics},
            }
            done.append(row)
            print(json.dumps(row), flush=True)
    done.sort(key=lambda r: (r["set"], int(r["step"])))
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in FIELDS} for r in done)
    if args.png:
        plot(done, args.png)


if __name__ == "__main__":
    main()
