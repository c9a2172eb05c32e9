"""The CPU's fp32 matmul rate at the shapes a SmolLM2 training micro-batch runs (2 x 384 tokens, 576 wide), one thread.

Sets a profiled step's seconds against what the BLAS can do: a step whose parts run at about this rate is bound by
its FLOPs, and only fewer FLOPs (or more cores) make it cheaper.

    OMP_NUM_THREADS=1 python scripts/research/sgemm_rate.py
"""

from __future__ import annotations

import argparse
import time

import torch

# (rows, inner, columns): attention projection, MLP up, MLP down (a micro-batch's 768 tokens), and the 16,384-id draft
# head over one 384-token sequence's 7 TTT steps.
SHAPES = [(768, 576, 576), (768, 576, 1536), (768, 1536, 576), (2688, 576, 16384)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name in ("threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    for rows, inner, columns in SHAPES:
        a, b = torch.randn(rows, inner), torch.randn(inner, columns)
        for _ in range(2):
            a @ b
        start = time.perf_counter()
        for _ in range(args.repeats):
            a @ b
        seconds = (time.perf_counter() - start) / args.repeats
        print(
            f"{rows} x {inner} @ {inner} x {columns}: {seconds * 1e3:.1f} ms, "
            f"{2 * rows * inner * columns / seconds / 1e9:.1f} GFLOP/s"
        )


if __name__ == "__main__":
    main()
