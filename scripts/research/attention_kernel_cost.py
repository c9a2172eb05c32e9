"""What one attention call costs the CPU kernel a one-token step uses, by precision and key count.

Row-exact verification (eagle3_hf/generation/exact_attention.py) gives every tree node the attention call of its own
one-token step: T nodes cost T one-query calls a layer where one tree-masked call serves them all. So its price is
that of a one-query call, which this times for the target's attention shape (SmolLM2-135M: 9 query heads sharing 3
key heads of 64), next to one call over 16 queries, in bf16 and fp32, with torch's default CPU backend (the flash
kernel) and its math backend.

Usage: python scripts/research/attention_kernel_cost.py [--threads 2] [--keys 32,300,1000] [--repeats 200]
"""

import argparse
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention


def microseconds(call, repeats: int) -> float:
    for _ in range(5):  # warm-up: the first calls choose and prepare kernels
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def attend(args: argparse.Namespace, dtype: torch.dtype, keys: int, queries: int, batch: int = 1):
    """One attention call of `batch` rows of `queries` queries over `keys` keys, ready to time."""
    q = torch.randn(batch, args.heads, queries, args.head_dim, dtype=dtype)
    k = torch.randn(batch, args.kv_heads, keys, args.head_dim, dtype=dtype)
    v = torch.randn_like(k)
    return lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keys", default="32,300,1000", help="key counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{args.heads} heads over {args.kv_heads} key heads of {args.head_dim}, {args.threads} threads; microseconds a call"
    )
    print(f"{'dtype':>9}{'keys':>6}{'1 query':>9}{'math':>7}{'16 queries, one call':>22}{'16 one-query calls':>20}")
    for dtype in (torch.bfloat16, torch.float32):
        for keys in (int(k) for k in args.keys.split(",")):
            one = microseconds(attend(args, dtype, keys, 1), args.repeats)
            with sdpa_kernel(SDPBackend.MATH):
                math = microseconds(attend(args, dtype, keys, 1), args.repeats)
            sixteen = microseconds(attend(args, dtype, keys, 16), args.repeats)
            batched = microseconds(
                attend(args, dtype, keys, 1, batch=16), max(args.repeats // 16, 5)
            )  # how row-exact calls them
            name = str(dtype).removeprefix("torch.")
            print(f"{name:>9}{keys:>6}{one:>9.0f}{math:>7.0f}{sixteen:>22.0f}{batched:>20.0f}")


if __name__ == "__main__":
    main()
