"""What row-exact verification costs: a tree's verify forward, row-exact and in one call, beside a plain step.

Row-exact verification (eagle3_hf/generation/exact_attention.py) computes each tree node's attention as its own
one-token step would, one attention call per tree depth; the rest of the forward is unchanged. This times the whole
verify forward (tree mask, depth positions, the cache update, as decoding runs it) over trees of 8, 16 and 32 nodes
at several context lengths, both ways, interleaved with a plain one-token step at the same context, and prints the
medians and their ratios to that step.

Usage: python scripts/research/exact_verify_cost.py [--target smollm2] [--contexts 100,300,600] [--threads 2]
       [--dtype bfloat16] [--repeats 15]   (bf16 prepacks the weights, as `eagle3-hf bench` and `generate` do)
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from eagle3_hf.generation.exact_attention import ExactAttention, exact_verification
from eagle3_hf.generation.target_cache import crop_cache, target_tree_mask
from eagle3_hf.generation.tree import tree_attention_mask
from eagle3_hf.modeling.packed_linear import prepack_linears
from eagle3_hf.targets import load_target
from eagle3_hf.utils.compat import cache_kwargs
from eagle3_hf.utils.precision import DTYPE_CHOICES, resolve_dtype


def tree_of(nodes: int, width: int) -> list[int]:
    """A draft-like tree: `width` candidates per depth, all children of the previous depth's best (first) node."""
    parents, first_of_depth = [-1], 0
    while len(parents) < nodes:
        level = list(range(len(parents), min(len(parents) + width, nodes)))
        parents.extend([first_of_depth] * len(level))
        first_of_depth = level[0]
    return parents


def verify_forward(
    model: torch.nn.Module,
    state: ExactAttention,
    cache: DynamicCache,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    context: int,
    exact: bool,
) -> None:
    """One verify forward of the tree `parents` (tokens `[1, T]`, `depths` `[T]`) behind `context` cached tokens, as
    decoding runs it (tree mask, depth positions, the cache update), row-exact or in one call; the cache is cropped
    back to `context` after it."""
    if exact:
        state.set_tree(parents, context)
    mask = target_tree_mask(model.config, tree_attention_mask(parents), context, model.dtype)
    model(
        tokens,
        attention_mask=mask,
        position_ids=(context + depths)[None],
        use_cache=True,
        eagle3_exact=state,
        **cache_kwargs(cache),
    )
    state.clear_tree()
    crop_cache(cache, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--contexts", default="100,300,600", help="tokens already in the cache, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_target(args.target, dtype=resolve_dtype(args.dtype))
    prepack_linears(model)  # a no-op unless bf16 on CPU
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    print(
        f"{args.target}, {model.dtype}, {args.threads} threads, {model.config._attn_implementation}; "
        f"median of {args.repeats} verify forwards, ms"
    )
    print(
        f"{'context':>8}{'nodes':>7}{'depth':>7}{'step':>7}{'one call':>10}{'row-exact':>11}{'ratio':>8}"
        f"{'one call / step':>17}{'row-exact / step':>18}"
    )
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = torch.randint(0, vocab, (1, context), generator=generator)
        for nodes, width in ((8, 2), (16, 3), (32, 5)):
            parents = torch.tensor(tree_of(nodes, width))
            depths = torch.zeros(nodes, dtype=torch.long)
            for i in range(1, nodes):
                depths[i] = depths[parents[i]] + 1
            tokens = torch.randint(0, vocab, (1, nodes), generator=generator)
            times: dict[str, list[float]] = {"step": [], "one call": [], "row-exact": []}
            with exact_verification(model) as state, torch.no_grad():
                cache = DynamicCache()
                model(prompt, use_cache=True, **cache_kwargs(cache), eagle3_exact=state)
                for repeat in range(args.repeats + 2):  # two warm-up rounds
                    for kind in times:
                        start = time.perf_counter()
                        if kind == "step":  # what plain decoding runs: one token, no mask, the original attention
                            model(tokens[:, :1], use_cache=True, eagle3_exact=state, **cache_kwargs(cache))
                            crop_cache(cache, context)
                        else:
                            verify_forward(model, state, cache, tokens, parents, depths, context, kind == "row-exact")
                        seconds = time.perf_counter() - start
                        if repeat >= 2:
                            times[kind].append(seconds)
            step, one, exact_ms = (1000 * statistics.median(times[k]) for k in times)
            print(
                f"{context:>8}{nodes:>7}{int(depths.max()):>7}{step:>7.1f}{one:>10.1f}{exact_ms:>11.1f}"
                f"{exact_ms / one:>8.2f}{one / step:>17.2f}{exact_ms / step:>18.2f}"
            )


if __name__ == "__main__":
    main()
