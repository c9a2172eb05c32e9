"""Is it the cost model or the draft? Fixed tree shapes against plain generate and the adaptive tree.

The adaptive tree (the default) verifies a drafted tree only when the cost model expects it to pay, so a weak draft
decodes almost plainly. This runs the same prompts with a few *fixed* tree shapes (`adaptive_tree=False`: every
cycle drafts and verifies the whole tree) so the trade can be seen directly: tokens per cycle against tokens/s.
Methods are interleaved per prompt after a warm-up; greedy outputs are compared with plain generate.

Everything runs at one precision (`--dtype auto`: bf16 where the CPU has native bf16 matmul, with prepacked weights;
fp32 elsewhere) and thread count (default: all cores), the ones the cost model then sizes trees for.

Usage: python scripts/research/tree_shapes.py [--target smollm2] [--draft DIR] [--dtype auto] [--threads N]
       [--num-prompts 10] [--max-new-tokens 64] [--shapes 2,3,4 3,4,8 4,4,12]   (each shape: depth,top_k,total_tokens)
"""

import argparse
import time

import torch

from eagle3_hf.bench.runner import read_prompts
from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.modeling.packed_linear import prepack_linears
from eagle3_hf.modeling.shipped import default_prompts_path
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.utils.precision import DTYPE_CHOICES, default_threads, resolve_dtype, short_name


def _shape(text: str) -> dict:
    try:
        depth, top_k, total = (int(v) for v in text.split(","))
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"a shape is depth,top_k,total_tokens (e.g. 3,4,8), got {text!r}") from err
    return {"adaptive_tree": False, "tree_depth": depth, "tree_top_k": top_k, "tree_total_tokens": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default=None, help="draft folder (default: the shipped draft for the target)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[_shape(s) for s in ("2,3,4", "3,4,8", "4,4,12")])
    args = parser.parse_args()
    torch.set_num_threads(args.threads or default_threads())
    dtype = resolve_dtype(args.dtype)
    target = load_target(args.target, dtype=dtype)
    draft = load_draft_for(args.target, target, args.draft)
    prepack_linears(target)  # a no-op unless bf16 on CPU
    prepack_linears(draft)
    prompts = read_prompts(default_prompts_path(), load_tokenizer(args.target), args.num_prompts, every=8)
    methods: dict[str, dict | None] = {"plain": None, "adaptive tree": {}}
    for s in args.shapes:
        methods[f"fixed d{s['tree_depth']} k{s['tree_top_k']} n{s['tree_total_tokens']}"] = s
    stats = {m: {"seconds": 0.0, "tokens": 0, "same": 0, "cycles": 0} for m in methods}

    def run(kwargs: dict | None, ids: torch.Tensor, max_new: int):
        common = {"max_new_tokens": max_new, "do_sample": False, "attention_mask": torch.ones_like(ids)}
        if kwargs is None:
            return target.generate(ids, **common), None
        out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **kwargs, **common)
        return out.sequences, len(out.accept_lengths)

    with torch.no_grad():
        for kwargs in methods.values():  # warm-up
            run(kwargs, prompts[0], 8)
        for ids in prompts:
            reference = None
            for name, kwargs in methods.items():
                start = time.perf_counter()
                sequences, cycles = run(kwargs, ids, args.max_new_tokens)
                s = stats[name]
                s["seconds"] += time.perf_counter() - start
                new = sequences[0, ids.shape[1] :].tolist()
                reference = new if reference is None else reference
                s["tokens"] += len(new)
                s["same"] += int(new == reference)
                s["cycles"] += cycles or 0
    plain_rate = stats["plain"]["tokens"] / stats["plain"]["seconds"]
    print(
        f"{len(prompts)} MT-bench prompts x {args.max_new_tokens} tokens, {short_name(dtype)}, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(f"{'method':<18} {'tokens/s':>8} {'vs plain':>8} {'tokens/cycle':>12} {'identical':>9}")
    for name, s in stats.items():
        rate = s["tokens"] / s["seconds"]
        per_cycle = f"{s['tokens'] / s['cycles']:.2f}" if s["cycles"] else "-"
        print(f"{name:<18} {rate:>8.2f} {rate / plain_rate:>7.2f}x {per_cycle:>12} {s['same']:>4}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
