"""How much does verifying n tokens cost the target, compared with decoding one?

EAGLE-3's speedup is bounded by tau * t(1) / (t_draft + t(n)): each cycle emits tau tokens for one draft and one
verify forward over the n tree nodes. On a GPU t(n) stays near t(1) for n up to a few dozen (the forward is
memory-bound); on a small CPU it grows with n. This prints t(n) for a target at a realistic context length, and the
tau that a tree of n nodes needs to break even and to reach 2.5x (ignoring draft time, so these are lower bounds).

With `--batch B` each of B rows verifies n nodes (B * n tokens, a 4D mask as a batch's verify forward has one) and
the ratio is to a plain batched step of B rows (B tokens): what a tree of n nodes per row costs in a batch.

Usage: python scripts/research/verify_cost.py [--target smollm2] [--context 300] [--threads 1] [--dtype float32]
       [--batch 1]
       (--dtype bfloat16 prepacks the weights for oneDNN, as `eagle3-hf bench` and `generate` do on CPU)
"""

import argparse
import time

import torch
from transformers import DynamicCache

from eagle3_hf.modeling.packed_linear import prepack_linears
from eagle3_hf.targets import load_target
from eagle3_hf.utils.compat import cache_kwargs
from eagle3_hf.utils.precision import DTYPE_CHOICES, resolve_dtype


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument("--batch", type=int, default=1, help="rows, each verifying n nodes")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error(f"--batch must be >= 1, got {args.batch}")
    torch.set_num_threads(args.threads)
    model = load_target(args.target, dtype=resolve_dtype(args.dtype))
    prepack_linears(model)  # a no-op unless bf16 on CPU
    vocab = model.config.get_text_config().vocab_size
    with torch.no_grad():
        rows, past = args.batch, args.context
        cache = DynamicCache()
        model(torch.randint(0, vocab, (rows, past)), use_cache=True, **cache_kwargs(cache))
        times = {}
        for n in (1, 2, 4, 8, 16, 32, 64):
            masked = {}
            if rows > 1:  # [B, 1, n, past + n]: the prefix and a causal block, as a batch with holes gets it
                mask = torch.zeros(rows, 1, n, past + n, dtype=model.dtype)
                mask[:, :, :, past:] = torch.full((n, n), torch.finfo(model.dtype).min, dtype=model.dtype).triu(1)
                positions = torch.arange(past, past + n).expand(rows, n)
                masked = {"attention_mask": mask, "position_ids": positions}
            runs = []
            for _ in range(args.repeats):
                ids = torch.randint(0, vocab, (rows, n))
                start = time.perf_counter()
                # logits_to_keep=0: every node's logits, as verification needs
                model(ids, use_cache=True, logits_to_keep=0, **masked, **cache_kwargs(cache))
                runs.append(time.perf_counter() - start)
                cache.crop(-n)
            times[n] = min(runs)
    print(f"{rows} row(s) of {past} tokens; nodes per row, ms, and the ratio to a plain step of the rows")
    print(f"{'nodes':>5} {'ms':>8} {'x t(1)':>7} {'tau for 1x':>11} {'tau for 2.5x':>13}")
    for n, t in times.items():
        ratio = t / times[1]
        print(f"{n:>5} {1000 * t:>8.1f} {ratio:>7.2f} {ratio:>11.2f} {2.5 * ratio:>13.2f}")


if __name__ == "__main__":
    main()
