"""Row-exact verification (generation/exact_attention.py): in bf16, each node of a tree forward gets, bit for bit,
the logits the target's own one-token decoding steps give along that node's path; and greedy EAGLE-3 output equals
plain bf16 greedy output token for token, for every family (sliding-window targets past their window included)."""

import copy

import pytest
import torch
from transformers.cache_utils import DynamicCache

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.generation.exact_attention import exact_verification
from test_generation import FAMILIES, SHAPE

V = 256  # a larger vocabulary than test_generation's: bf16 near-ties between candidates become common
# Wider than test_generation's shapes: on this CPU a bf16 nn.Linear with 64 input features and 32-64 outputs is not
# row-invariant (1 row vs 18 can round differently); from 128 input features on it is, as in real targets.
BF16_SHAPE = dict(hidden_size=128, intermediate_size=256)
TREE = [-1, 0, 0, 0, 1, 1, 1, 2, 4, 4, 5, 8, 8, 9, 11, 11, 13, 14]  # 18 nodes, depth 6, up to 4 wide


def bf16_target(family, implementation="sdpa", seed=0):
    model_class, config_class, extra = FAMILIES[family]
    extra = {k: v for k, v in extra.items() if k != "initializer_range"}  # default init: near-ties happen
    if "head_dim" in extra:
        extra = {**extra, "head_dim": 32, "query_pre_attn_scalar": 32} if family == "gemma3" else {**extra, "head_dim": 32}
    torch.manual_seed(seed)
    config = config_class(**{**SHAPE, **BF16_SHAPE, **extra, "vocab_size": V})
    config._attn_implementation = implementation
    return model_class(config).eval().to(torch.bfloat16)


def plain_rows(target, cache, tokens, parents):
    """Each node's logits `[T, V]` from one-token steps along its path, from copies of `cache`."""
    rows = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        step_cache = copy.deepcopy(cache)
        for n in reversed(path):
            logits = target(tokens[None, n : n + 1], cache=step_cache, use_cache=True).logits
        rows.append(logits[0, -1])
    return torch.stack(rows)


def tree_rows(target, prompt, tokens, parents, exact):
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        depths[i] = depths[p] + 1 if p >= 0 else 0
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    from eagle3_hf.generation.steps import _target_mask

    past = prompt.shape[1]
    with exact_verification(target, enabled=exact) as state:
        cache = DynamicCache()
        extra = {} if state is None else {"eagle3_exact": state}
        target(prompt, cache=cache, use_cache=True, **extra)
        if state is not None:
            state.set_tree(torch.tensor(parents), past)
        out = target(
            tokens[None], cache=cache, use_cache=True, position_ids=(past + torch.tensor(depths))[None],
            attention_mask=_target_mask(target.config, mask, past, target.dtype), **extra,
        )  # fmt: skip
    return out.logits[0]


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tree_rows_equal_one_token_steps(family, implementation):
    target = bf16_target(family, implementation)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for past in (3, 11, 21):  # sliding windows of 5: before, across and past them
            prompt = torch.randint(0, V, (1, past), generator=generator)
            tokens = torch.randint(0, V, (len(TREE),), generator=generator)
            cache = DynamicCache(config=target.config)  # what plain generate() decodes with
            target(prompt, cache=cache, use_cache=True)
            reference = plain_rows(target, cache, tokens, TREE)
            rows = tree_rows(target, prompt, tokens, TREE, exact=True)
            assert torch.equal(rows, reference), f"{family}/{implementation}, {past} tokens of prefix"
            assert target.config._attn_implementation == implementation  # restored after the call
