"""Time the target's output head (a [V, H] matmul) for 1 ... 16 rows, the way a verify forward calls it.

`scripts/research/verify_cost.py` shows that on a CPU verifying 2 tokens can cost more than verifying 4. This
isolates the reason: the time `torch.nn.functional.linear` takes for the SmolLM2 head shape (49,152 x 576, fp32) at
a few rows, next to the same product computed as ``(W @ x.T).T`` (another BLAS path). It needs no model download.

Usage: python scripts/research/head_matmul_cost.py [--vocab 49152] [--hidden 576] [--threads 1] [--repeats 30]
"""

import argparse
import time

import torch
import torch.nn.functional as F


def _ms(fn, x: torch.Tensor, repeats: int) -> float:
    with torch.no_grad():
        for _ in range(3):  # warm-up
            fn(x)
        start = time.perf_counter()
        for _ in range(repeats):
            fn(x)
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weight = torch.randn(args.vocab, args.hidden)
    print(f"head {args.vocab} x {args.hidden} fp32, {args.threads} thread(s), torch {torch.__version__}")
    print(f"{'rows':>4} {'F.linear ms':>12} {'x one row':>10} {'(W @ x.T).T ms':>15}")
    base = None
    for rows in (1, 2, 3, 4, 8, 16):
        x = torch.randn(rows, args.hidden)
        linear = _ms(lambda v: F.linear(v, weight), x, args.repeats)
        other = _ms(lambda v: (weight @ v.T).T, x, args.repeats)
        base = base or linear
        print(f"{rows:>4} {linear:>12.2f} {linear / base:>10.2f} {other:>15.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
