"""Does a tree verify forward equal the target's one-token steps bit for bit? The row-invariance probe for any target.

Runs `eagle3_hf.generation.probe.probe_row_exactness` twice, row-exact (exact_attention.py) and as one tree-masked
attention call, and prints what each found: bitwise equality, or the logit gap and the first op that differs.

Usage: python scripts/research/exactness_probe.py [--target smollm2] [--dtype bfloat16] [--threads 2] [--prefix 48]
       [--attn-implementation sdpa|eager] [--no-prepack]
"""

import argparse

import torch

from eagle3_hf.generation.probe import probe_row_exactness
from eagle3_hf.modeling.packed_linear import prepack_linears
from eagle3_hf.targets import load_target
from eagle3_hf.utils.precision import DTYPE_CHOICES, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=48, help="tokens in the cache before the tree")
    parser.add_argument("--attn-implementation", default=None, help="the target's attention (default: its own)")
    parser.add_argument("--no-prepack", action="store_true", help="keep bf16 CPU weights unpacked")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=resolve_dtype(args.dtype), attn_implementation=args.attn_implementation)
    if not args.no_prepack:
        prepack_linears(target)  # a no-op unless bf16 on CPU
    for exact in (True, False):
        print(probe_row_exactness(target, prefix=args.prefix, exact_verify=exact).describe())


if __name__ == "__main__":
    main()
