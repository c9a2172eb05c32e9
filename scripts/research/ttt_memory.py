"""Peak memory of one TTT training step (forward and backward) of the shipped draft's architecture, by sequence length.

Each length runs in a fresh subprocess, so that its peak is its own: the script builds the shipped draft's config
(`eagle3_hf/drafts/smollm2-135m-instruct`, random weights, a random 49,152 x 576 token embedding and draft vocabulary),
random target features ``[1, S, 3 * 576]`` and top-64 soft labels whose top token the draft vocabulary holds, every
token supervised (the most rows the head and loss can get), and runs the trainer's path under bf16 autocast:
``ttt_forward(return_hidden=True)``, ``ttt_loss`` with the fused head and loss (`ttt_head_kwargs`), ``backward()``.
It prints the process's peak resident set (``getrusage`` max RSS) and the step's own share of it: the peak minus the
resident set just before the step (weights, inputs and the Python runtime are in the baseline).

Each child runs with glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``, ``--mmap-threshold``, 1 MiB): every
block above it is mapped on allocation and unmapped on free, so the peak RSS is the peak of the live tensors. With the
default dynamic threshold, freed blocks stay in the heap and the same step's peak moved by about 250 MiB from run to
run (``--mmap-threshold 0`` measures that way).

A child's heap is capped (``RLIMIT_DATA``, ``--cap-gib``) so that a length that needs more memory than the shared
machine holds fails its allocation instead of pushing other processes out; it is then reported as over the cap.

Usage (one measurement at a time; memory, not time, is what it measures):

    python scripts/research/ttt_memory.py --lengths 2048 4096 8192 --ttt-length 7 [--gradient-checkpointing]
    # the code before the chunked attention, for the "before" column (a worktree of commit 35b1f80):
    git worktree add ../before 35b1f80 && PYTHONPATH=../before python scripts/research/ttt_memory.py --lengths 2048 4096 8192
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "eagle3_hf", "drafts", "smollm2-135m-instruct")


def _rss_mib() -> float:
    """The current resident set, MiB (/proc/self/statm's second field, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(length: int, ttt_length: int, dtype: str, checkpointing: bool) -> dict[str, float]:
    import torch

    from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel
    from eagle3_hf.modeling.embedding import set_embedding
    from eagle3_hf.training.head_loss import ttt_head_kwargs
    from eagle3_hf.training.ttt import ttt_forward, ttt_loss

    torch.manual_seed(0)
    config = Eagle3DraftConfig.from_pretrained(SHIPPED)
    draft = Eagle3DraftModel(config).train()  # fp32 weights, as the trainer holds them under bf16 autocast
    set_embedding(draft, torch.randn(config.vocab_size, config.hidden_size) * 0.02)
    if checkpointing:  # what --gradient-checkpointing does: each TTT step's layer call is recomputed in the backward
        getattr(draft, "activation_checkpointing_enable", draft.gradient_checkpointing_enable)()
    vocab, draft_vocab = config.vocab_size, config.draft_vocab_size
    members = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[members] = True
    draft.set_draft_vocab(members - torch.arange(draft_vocab), t2d)
    ids = torch.randint(0, vocab, (1, length))
    features = torch.randn(1, length, 3 * config.target_hidden_size)
    top_ids = members[torch.randint(0, draft_vocab, (1, length, 64))].to(torch.int32)  # top token in the vocabulary
    top_logits = torch.randn(1, length, 64).sort(-1, descending=True).values
    loss_mask = torch.ones(1, length, dtype=torch.long)
    autocast_dtype = {"bfloat16": torch.bfloat16, "float32": None}[dtype]

    def autocast():
        return torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None)

    baseline = _rss_mib()
    with autocast():
        states = ttt_forward(draft, ids, features, None, ttt_length, return_hidden=True)
    heads = ttt_head_kwargs(draft.lm_head, autocast, autocast_dtype)
    out = ttt_loss(states, top_logits, loss_mask, draft.t2d, target_ids=top_ids, **heads)
    out.loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "length": length,
        "peak_rss_mib": round(peak),
        "baseline_mib": round(baseline),
        "step_mib": round(peak - baseline),
        "loss": round(float(out.loss), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--ttt-length", type=int, default=7)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=2**20,
        help="MALLOC_MMAP_THRESHOLD_ of each child, bytes (0: glibc's dynamic default)",
    )
    parser.add_argument("--cap-gib", type=float, default=12.0, help="heap cap of each child (RLIMIT_DATA)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        cap = int(args.cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        print(json.dumps(child(args.child, args.ttt_length, args.dtype, args.gradient_checkpointing)))
        return
    extra = ", gradient checkpointing" if args.gradient_checkpointing else ""
    extra += f", mmap threshold {args.mmap_threshold}" if args.mmap_threshold else ", dynamic mmap threshold"
    print(f"| tokens | peak RSS (MiB) | step's share (MiB) |  (ttt_length {args.ttt_length}, {args.dtype}{extra})")
    for length in args.lengths:
        command = [
            sys.executable,
            __file__,
            "--child",
            str(length),
            "--ttt-length",
            str(args.ttt_length),
            "--dtype",
            args.dtype,
            "--cap-gib",
            str(args.cap_gib),
        ]
        command += ["--gradient-checkpointing"] if args.gradient_checkpointing else []
        env = dict(os.environ)
        if args.mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
        run = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
        if run.returncode != 0:
            last = (run.stderr.strip().splitlines() or ["?"])[-1]
            print(f"| {length} | over the {args.cap_gib:g} GiB cap | ({last[:120]}) |", flush=True)
            continue
        result = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"| {length} | {result['peak_rss_mib']:,} | {result['step_mib']:,} |  loss {result['loss']}", flush=True)


if __name__ == "__main__":
    main()
