"""Accuracy of a draft lineage against the training it has had: does more training still pay, and how much?

A shipped draft is the end of a lineage: each release continued the one before it. This script evaluates drafts
along such a lineage (folders, or ``git:COMMIT`` for the shipped draft as committed then) with the project's one
evaluation (`eagle3_hf.training.evaluation.evaluate_draft`: teacher-forced accuracy against the target's
full-vocabulary top token) and sets step-0 accuracy against the number of training conversations the lineage had
processed when each was saved (optimizer steps x conversations per step, summed over its runs), on a log axis.

A least-squares line of accuracy against log2(conversations), through the points at or past ``--fit-from``, gives the
gain per doubling of training and where that line reaches ``--target-accuracy``: a curve that looks flat against
steps may still be climbing at a steady rate per doubling, which points at the amount of training as what holds
the draft (its size and its data need their own tests). Results already in the CSV are kept (keyed by label and set).

Usage (the shipped SmolLM2 draft's lineage, MT-bench turn 1 answered by the target; docs/research/draft-accuracy.md,
"The lineage curve", says where each point's conversation count comes from; ``regen_mtbench/`` from
examples/data/smollm2_mtbench_turn1_regen.tar.gz):

    python scripts/research/lineage_curve.py --eval "MT-bench turn 1=work_data/regen_mtbench" \
        --point "900=1800=git:df8f842" --point "1700=3400=git:ef8ea80" --point "7700=15400=git:c0088ee" \
        --point "9700=19400=git:0828561" --point "10325=21900=git:2384f74" \
        --point "10700=23400=work_data/draft_mix/checkpoint-1000" --point "10950=24400=git:2d7ed19" \
        --fit-from 3400 --target-accuracy 0.60 \
        --csv scripts/research/results/curve/curve_lineage.csv \
        --png scripts/research/results/curve/curve_lineage.png
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import tempfile

import torch

from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.training.evaluation import evaluate_draft
from eagle3_hf.training.split import split_filter
from eagle3_hf.training.tokenise import tokenise_data

FIELDS = ["label", "trained_conversations", "source", "set", "supervised_tokens", "coverage", "sim_accept_len"] + [
    f"acc_{j}" for j in range(7)
]


def parse_point(spec: str) -> tuple[str, int, str]:
    """``LABEL=CONVERSATIONS=SOURCE`` -> (label, conversations, source)."""
    parts = spec.split("=", 2)
    if len(parts) != 3 or not parts[0] or not parts[2]:
        raise ValueError(f"--point {spec!r}: expected LABEL=CONVERSATIONS=SOURCE, e.g. '9700=19400=git:0828561'.")
    try:
        conversations = int(parts[1])
    except ValueError:
        raise ValueError(f"--point {spec!r}: CONVERSATIONS must be a whole number, got {parts[1]!r}.") from None
    if conversations < 1:
        raise ValueError(f"--point {spec!r}: CONVERSATIONS must be at least 1, got {conversations}.")
    return parts[0], conversations, parts[2]


def checkout_draft(commit: str, draft_dir: str, into: str) -> str:
    """Write the files of `draft_dir` as they were at `commit` into `into`; returns `into`."""
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", f"{commit}:{draft_dir}"], capture_output=True, text=True, check=False
    )
    if names.returncode != 0 or not names.stdout.strip():
        raise ValueError(f"git:{commit}: no folder {draft_dir!r} at that commit ({names.stderr.strip()}).")
    os.makedirs(into, exist_ok=True)
    for name in names.stdout.split():
        blob = subprocess.run(["git", "show", f"{commit}:{draft_dir}/{name}"], capture_output=True, check=True)
        with open(os.path.join(into, name), "wb") as f:
            f.write(blob.stdout)
    return into


def fit_per_doubling(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of accuracy on log2(conversations): (gain per doubling, accuracy at one conversation)."""
    if len(points) < 2 or len({n for n, _ in points}) < 2:
        raise ValueError(f"a fit needs at least two distinct conversation counts, got {points}.")
    xs = [math.log2(n) for n, _ in points]
    ys = [acc for _, acc in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def conversations_for(accuracy: float, slope: float, intercept: float) -> float | None:
    """Where the fitted line reaches `accuracy` (None if it never rises)."""
    return 2 ** ((accuracy - intercept) / slope) if slope > 0 else None


def plot(rows: list[dict], fits: dict, target_accuracy: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = sorted((r for r in rows if r["set"] == name), key=lambda r: int(r["trained_conversations"]))
        xs = [int(r["trained_conversations"]) for r in mine]
        ax.plot(xs, [float(r["acc_0"]) for r in mine], marker="o", linestyle="", label=f"{name}: step 0")
        if name in fits:
            slope, intercept, start = fits[name]
            reach = conversations_for(target_accuracy, slope, intercept) or xs[-1]
            line_x = [start, max(xs[-1], reach)]
            ax.plot(
                line_x,
                [intercept + slope * math.log2(x) for x in line_x],
                linestyle="--",
                label=f"{name}: fit, {slope:+.3f} per doubling",
            )
    ax.axhline(target_accuracy, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training conversations processed by the lineage (log scale)")
    ax.set_ylabel("step-0 accuracy (full vocabulary)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle("A draft lineage's accuracy against its training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--point",
        action="append",
        required=True,
        metavar="LABEL=CONVERSATIONS=SOURCE",
        help="a draft of the lineage: SOURCE is a folder or git:COMMIT (repeat, in any order)",
    )
    parser.add_argument(
        "--git-draft-dir",
        default="eagle3_hf/drafts/smollm2-135m-instruct",
        help="the draft's folder inside the repository, for git:COMMIT sources",
    )
    parser.add_argument("--target", default="smollm2")
    parser.add_argument(
        "--eval",
        action="append",
        required=True,
        metavar="NAME=DATA[:held-out]",
        help="an evaluation set (repeat); ':held-out' keeps only the held-out split",
    )
    parser.add_argument("--max-conversations", type=int, default=200, help="per set")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--fit-from", type=int, default=1, help="fit only points with at least this many conversations")
    parser.add_argument("--target-accuracy", type=float, default=0.60)
    parser.add_argument("--csv", required=True)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    points = [parse_point(spec) for spec in args.point]

    done: list[dict] = []
    if os.path.isfile(args.csv):
        with open(args.csv, encoding="utf-8") as f:
            done = list(csv.DictReader(f))
    seen = {(r["label"], r["set"]) for r in done}
    specs = [spec.partition("=") for spec in args.eval]
    for spec, (name, _, data) in zip(args.eval, specs):
        if not name or not data:
            raise ValueError(f"--eval {spec!r}: expected NAME=DATA[:held-out]: a set's name and its data folder.")
    todo = [(p, name) for p in points for name, _, _ in specs if (p[0], name) not in seen]
    if todo:
        dtype = getattr(torch, args.dtype)
        sets = {}
        for name, _, data in specs:
            data, _, split = data.partition(":")
            tokenizer = load_tokenizer(args.target)
            rows, _ = tokenise_data(
                tokenizer, [data], args.max_length, args.max_conversations, split_filter(split or "all")
            )
            sets[name] = rows
        target = load_target(args.target, dtype=dtype)
        with tempfile.TemporaryDirectory() as scratch:
            for (label, conversations, source), name in todo:
                path = source
                if source.startswith("git:"):
                    path = checkout_draft(source[4:], args.git_draft_dir, os.path.join(scratch, label))
                draft = load_draft_for(args.target, target, path).to(dtype=dtype)
                metrics = evaluate_draft(draft, target, sets[name], batch_size=4)
                row = {
                    "label": label,
                    "trained_conversations": conversations,
                    "source": source,
                    "set": name,
                    **{k: metrics.get(k) for k in FIELDS if k in metrics},
                }
                done.append(row)
                print(json.dumps(row), flush=True)
    done.sort(key=lambda r: (r["set"], int(r["trained_conversations"])))
    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in FIELDS} for r in done)

    fits = {}
    for name, _, _ in specs:
        fitted = [
            (int(r["trained_conversations"]), float(r["acc_0"]))
            for r in done
            if r["set"] == name and int(r["trained_conversations"]) >= args.fit_from
        ]
        if len({n for n, _ in fitted}) < 2:
            print(f"{name}: fewer than two points at or past --fit-from {args.fit_from}; no fit.")
            continue
        slope, intercept = fit_per_doubling(fitted)
        reach = conversations_for(args.target_accuracy, slope, intercept)
        fits[name] = (slope, intercept, min(n for n, _ in fitted))
        where = "never (the fit does not rise)" if reach is None else f"{reach:,.0f} conversations"
        print(
            f"{name}: {slope:+.4f} step-0 accuracy per doubling of training over {len(fitted)} points; "
            f"{args.target_accuracy:.2f} reached at {where}"
        )
    if args.png:
        plot(done, fits, args.target_accuracy, args.png)


if __name__ == "__main__":
    main()
