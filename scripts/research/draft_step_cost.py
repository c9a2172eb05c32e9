"""What one level of drafting a tree costs: the draft's step over `top_k` frontier nodes, and the whole tree.

Each level of an EAGLE-2 tree is one draft forward over the `top_k` best frontier nodes plus a top-k over the
draft vocabulary; six levels must stay small next to one target step. For each precision (and, in bf16 on CPU,
with the weights prepacked for oneDNN or not) this times, after the draft has read a `--context`-token prompt:

* `model forward`: one level through `Eagle3DraftModel.forward` with a `DynamicCache` (appended to, then cropped),
  as drafting used to run;
* `draft_forward`: the same level through the decoding-time step (`generation.draft_step`, preallocated KV);
* `tree / level`: a whole `build_greedy_trees` for one row (fixed shape, every level grown) divided by its draft levels.

Medians of `--repeats`, as wall-clock and as this process's CPU time (on a shared machine the CPU time is the
steadier of the two: it leaves out the time other processes held the cores; with one thread it equals the wall
time of an idle machine).

Usage: python scripts/research/draft_step_cost.py [--target smollm2] [--draft DIR] [--context 300] [--threads 1]
       [--dtypes float32,bfloat16] [--repeats 30]
"""

import argparse
import copy
import statistics
import time

import torch
from transformers import DynamicCache

from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.generation.draft_step import draft_forward
from eagle3_hf.generation.drafting import DraftState, TreeBudget, build_greedy_trees, catch_up
from eagle3_hf.modeling.modeling_eagle3 import additive_mask, select_target_features
from eagle3_hf.modeling.packed_linear import prepack_linears
from eagle3_hf.targets import cast_weights, load_target
from eagle3_hf.utils.compat import cache_kwargs


def median_times(fn, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds, medians over `repeats` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(wall), statistics.median(cpu)


@torch.no_grad()
def measure(target, draft, context: torch.Tensor, budget: TreeBudget, repeats: int) -> dict[str, tuple[float, float]]:
    out = target(context, output_hidden_states=True)
    layer_ids = draft.config.resolved_target_layer_ids(target.config.get_text_config().num_hidden_layers)
    features = select_target_features(out.hidden_states, layer_ids).to(draft.lm_head.weight.dtype)  # [1, C, 3H]
    next_tokens = torch.cat([context[:, 1:], out.logits[:, -1:].argmax(-1)], dim=1)
    state = DraftState()
    state.add_verified(features, next_tokens, torch.ones_like(next_tokens, dtype=torch.bool))  # every pair real
    catch_up(draft, state)
    length, k = state.kv.length, budget.top_k
    tokens = torch.randint(0, target.config.get_text_config().vocab_size, (1, k))
    hidden = state.last_hidden.expand(1, k, -1)
    allowed = torch.cat([torch.ones(k, length, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], dim=1)
    mask = additive_mask(allowed, hidden.dtype)  # [k, length + k]
    positions = torch.full((k,), length)

    cache = DynamicCache()
    draft(next_tokens, target_hidden_states=features, **cache_kwargs(cache))

    def model_level():
        draft(tokens, hidden_states=hidden, position_ids=positions[None], attention_mask=mask[None, None], cache=cache)
        cache.crop(-k)

    return {
        "model forward": median_times(model_level, repeats),
        "draft_forward": median_times(
            lambda: draft_forward(draft, state.kv, tokens, hidden, positions[None], length, mask), repeats
        ),
        "tree": median_times(lambda: build_greedy_trees(draft, state, next_tokens[0, -1:], budget), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default=None, help="draft folder (default: the shipped draft for the target)")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens the draft has read")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--total-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    budget = TreeBudget(depth=args.depth, top_k=args.top_k, total_tokens=args.total_tokens)
    base = load_target(args.target)
    context = torch.randint(0, base.config.get_text_config().vocab_size, (1, args.context))
    print(
        f"{args.context}-token context, tree depth {args.depth} / top-k {args.top_k}, {args.threads} thread(s); "
        f"ms as wall / CPU time"
    )
    print(f"{'precision':<16} {'model forward':>14} {'draft_forward':>14} {'tree / level':>14}")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip())
        target = base if dtype == torch.float32 else cast_weights(copy.deepcopy(base), dtype)
        draft = load_draft_for(args.target, target, args.draft)
        variants = {name: draft}
        packed = copy.deepcopy(draft)
        if prepack_linears(packed):
            variants[f"{name}, packed"] = packed
        for label, model in variants.items():
            times = measure(target, model, context, budget, args.repeats)
            levels = budget.depth - 1
            cells = [times["model forward"], times["draft_forward"], tuple(t / levels for t in times["tree"])]
            print(f"{label:<16} " + " ".join(f"{1e3 * w:>6.2f} / {1e3 * c:<5.2f}" for w, c in cells))


if __name__ == "__main__":
    main()
