import pytest
import torch
from transformers import MistralConfig

from eagle3_hf.generation.drafting import _rerank_rows
from eagle3_hf.generation.target_cache import target_tree_mask
from eagle3_hf.generation.tree import (
    DraftTree,
    HostTree,
    children_lists,
    cut_host,
    sample_children,
    subtree,
    tree_attention_mask,
    tree_depths,
)

# Tree used throughout:      0
#                          /   \
#                         1     2
#                        / \     \
#                       3   4     5
#                       |
#                       6
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])

ANCESTORS = torch.tensor(
    [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ],
    dtype=torch.bool,
)

MIN = torch.finfo(torch.float32).min


def verification_mask(tree_mask, past, dtype, sliding_window=None):
    """The verify mask of one tree behind `past` tokens, for a target with that sliding window (None: none)."""
    config = MistralConfig(
        sliding_window=sliding_window, num_hidden_layers=1, hidden_size=8, num_attention_heads=1, num_key_value_heads=1
    )
    return target_tree_mask(config, tree_mask, past, dtype)


def rerank(scores, cand_parents, total_tokens):
    """Keep the `total_tokens - 1` best candidates (`cand_parents` -1: a child of the root) as the loop does, on the
    host (`cut_host`) and batched on the device (drafting's `_rerank_rows`), which must agree. Returns the kept
    candidates and the tree's parents."""
    host = HostTree([0] * (len(scores) + 1), [-1] + [p + 1 for p in cand_parents.tolist()], [0.0] + scores.tolist())
    nodes = cut_host(host, total_tokens)
    kept = torch.tensor([n - 1 for n in nodes[1:]], dtype=torch.long)
    parents = torch.tensor(subtree(host, nodes).parents)
    on_device = _rerank_rows(scores[None], cand_parents[None], total_tokens)
    assert on_device[0][0].tolist() == kept.tolist() and on_device[1][0].tolist() == parents.tolist()
    return kept, parents


def _visible_to_additive(visible: list[list[int]]) -> torch.Tensor:
    visible = torch.tensor(visible, dtype=torch.bool)
    return torch.where(visible, 0.0, MIN)[None, None]


def test_ancestor_mask_depths_positions_paths():
    torch.testing.assert_close(tree_attention_mask(PARENTS), ANCESTORS)
    torch.testing.assert_close(tree_depths(PARENTS), torch.tensor([0, 1, 1, 2, 2, 2, 3]))
    assert children_lists(PARENTS) == [[1, 2], [3, 4], [5], [6], [], [], []]


def test_single_node_tree():
    root = torch.tensor([-1])
    torch.testing.assert_close(tree_attention_mask(root), torch.tensor([[True]]))
    assert children_lists(root) == [[]]
    torch.testing.assert_close(verification_mask(tree_attention_mask(root), 2, torch.float32), torch.zeros(1, 1, 1, 3))


def test_verification_mask_past_3():
    expected = _visible_to_additive(
        [
            [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 1, 0, 0],
            [1, 1, 1, 1, 0, 1, 0, 0, 1, 0],
            [1, 1, 1, 1, 1, 0, 1, 0, 0, 1],
        ]
    )
    mask = verification_mask(ANCESTORS, 3, torch.float32)
    assert mask.shape == (1, 1, 7, 10) and mask.dtype == torch.float32
    torch.testing.assert_close(mask, expected, rtol=0, atol=0)
    half = verification_mask(ANCESTORS, 3, torch.float16)
    assert half.dtype == torch.float16 and set(half.unique().tolist()) == {torch.finfo(torch.float16).min, 0.0}


def test_verification_mask_sliding_window_tree():
    # Positions: past 0, 1, 2; nodes 3, 4, 4, 5, 5, 5, 6. With W=3 a query at position t sees t-2..t.
    expected = _visible_to_additive(
        [
            [0, 1, 1, 1, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 0, 1, 0, 0, 0, 0],
            [0, 0, 0, 1, 1, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 1, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0, 1, 0, 0, 1, 0],
            [0, 0, 0, 0, 1, 0, 1, 0, 0, 1],
        ]
    )
    torch.testing.assert_close(verification_mask(ANCESTORS, 3, torch.float32, sliding_window=3), expected)


@pytest.mark.parametrize("sliding_window", [None, 1, 3, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_matches_transformers_masks(sliding_window, dtype):
    from transformers import DynamicCache, MistralConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    past_length, num_nodes = 4, 5
    config = MistralConfig(
        sliding_window=sliding_window,
        num_hidden_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    config._attn_implementation = "eager"
    cache = DynamicCache()
    past = torch.zeros(1, 1, past_length, 2, dtype=dtype)
    cache.update(past, past, 0)
    embeds = torch.zeros(1, num_nodes, 8, dtype=dtype)
    position_ids = torch.arange(past_length, past_length + num_nodes)[None]
    make = create_causal_mask if sliding_window is None else create_sliding_window_causal_mask
    reference = make(
        config=config,
        inputs_embeds=embeds,
        attention_mask=None,
        cache=cache,
        position_ids=position_ids,
        allow_is_causal_skip=False,
    )

    chain = torch.tensor([-1, 0, 1, 2, 3])
    ours = verification_mask(tree_attention_mask(chain), past_length, dtype, sliding_window=sliding_window)
    assert ours.shape == reference.shape == (1, 1, num_nodes, past_length + num_nodes)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_chain_is_linear_decoding():
    # A chain must look exactly like ordinary causal decoding.
    parents = torch.tensor([-1, 0, 1, 2, 3])
    torch.testing.assert_close(tree_attention_mask(parents), torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(tree_depths(parents), torch.arange(5))


def test_rerank_hand_made():
    # c0 (-0.1) and c1 (-1.0) hang from the root; c2, c3 from c0; c4, c5 from c1; c6, c7 from c2.
    scores = torch.tensor([-0.1, -1.0, -0.3, -1.5, -1.2, -2.0, -0.5, -1.1])
    cand_parents = torch.tensor([-1, -1, 0, 0, 1, 1, 2, 2])
    kept, parents = rerank(scores, cand_parents, total_tokens=5)
    torch.testing.assert_close(kept, torch.tensor([0, 1, 2, 6]))
    torch.testing.assert_close(parents, torch.tensor([-1, 0, 0, 1, 3]))

    kept, parents = rerank(scores, cand_parents, total_tokens=7)
    torch.testing.assert_close(kept, torch.tensor([0, 1, 2, 4, 6, 7]))
    torch.testing.assert_close(parents, torch.tensor([-1, 0, 0, 1, 2, 3, 3]))

    # More room than candidates keeps everything; total_tokens=1 keeps only the root.
    kept, parents = rerank(scores, cand_parents, total_tokens=100)
    torch.testing.assert_close(kept, torch.arange(8))
    torch.testing.assert_close(parents, torch.tensor([-1, 0, 0, 1, 1, 2, 2, 3, 3]))
    kept, parents = rerank(scores, cand_parents, total_tokens=1)
    assert kept.tolist() == [] and parents.tolist() == [-1]


def test_rerank_ties_keep_parents():
    # A child with log-prob 0 ties with its parent; the cut must not keep the child without the parent.
    scores = torch.tensor([-0.5, -0.5, -0.5])
    cand_parents = torch.tensor([-1, 0, -1])
    kept, parents = rerank(scores, cand_parents, total_tokens=3)
    torch.testing.assert_close(kept, torch.tensor([0, 1]))
    torch.testing.assert_close(parents, torch.tensor([-1, 0, 1]))
    # Ties across branches and along a chain of zero log-probs (c0 -> c2 -> c3).
    scores = torch.tensor([-1.0, -0.2, -1.0, -1.0, -0.2])
    cand_parents = torch.tensor([-1, -1, 0, 2, 1])
    kept, parents = rerank(scores, cand_parents, total_tokens=4)
    torch.testing.assert_close(kept, torch.tensor([0, 1, 4]))
    torch.testing.assert_close(parents, torch.tensor([-1, 0, 0, 2]))
    kept, parents = rerank(scores, cand_parents, total_tokens=5)
    torch.testing.assert_close(kept, torch.tensor([0, 1, 2, 4]))
    torch.testing.assert_close(parents, torch.tensor([-1, 0, 0, 1, 2]))


def test_rerank_invariant_on_random_eagle_trees():
    generator = torch.Generator().manual_seed(0)
    top_k, depth, vocab = 4, 5, 16
    for _ in range(10):
        logprobs = torch.randn(1, vocab, generator=generator).mul(3).log_softmax(-1)
        scores = logprobs.topk(top_k, dim=-1).values  # the root's best children
        cand_scores, cand_parents = [scores.flatten()], [torch.full((top_k,), -1)]
        frontier_scores, frontier_index = scores.flatten(), torch.arange(top_k)
        offset = top_k
        for _ in range(depth):
            logprobs = torch.randn(top_k, vocab, generator=generator).mul(3).log_softmax(-1)
            child_scores = frontier_scores[:, None] + logprobs.topk(top_k, dim=-1).values
            cand_scores.append(child_scores.flatten())
            cand_parents.append(frontier_index.repeat_interleave(top_k))
            flat = child_scores.flatten().topk(top_k).indices  # the best children overall: the next frontier
            frontier_scores, frontier_index = child_scores.flatten()[flat], flat + offset
            offset += top_k * top_k
        cand_scores, cand_parents = torch.cat(cand_scores), torch.cat(cand_parents)
        for total_tokens in (1, 2, 10, 25, 60, 200):
            kept, parents = rerank(cand_scores, cand_parents, total_tokens)
            assert kept.shape[0] == min(total_tokens - 1, cand_scores.shape[0])
            assert kept.tolist() == sorted(kept.tolist())
            kept_set = set(kept.tolist())
            assert all(int(cand_parents[c]) == -1 or int(cand_parents[c]) in kept_set for c in kept.tolist())
            tree_attention_mask(parents)  # validates parents[0] == -1 and parents[i] < i
            # Every kept candidate scores at least as well as every dropped one.
            dropped = sorted(set(range(cand_scores.shape[0])) - kept_set)
            if kept.numel() and dropped:
                assert cand_scores[kept].min() >= cand_scores[dropped].max()
            # The final parents mirror the candidate parents.
            for m, c in enumerate(kept.tolist(), start=1):
                parent = int(cand_parents[c])
                assert int(parents[m]) == (0 if parent == -1 else kept.tolist().index(parent) + 1)


def test_sample_children_without_replacement_in_draw_order():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    generator = torch.Generator().manual_seed(1)
    n = 6000
    counts = torch.zeros(4, 4)
    for _ in range(n):
        first, second = sample_children(probs.log(), 2, generator).tolist()
        assert first != second
        counts[first, second] += 1
    # P(first=x, second=y) = q(x) q(y) / (1 - q(x)); zero-probability tokens are never drawn.
    expected = probs[:, None] * probs[None, :] / (1 - probs[:, None])
    expected.fill_diagonal_(0)
    assert counts[expected == 0].sum() == 0
    cells = expected > 0  # 6 cells -> 5 degrees of freedom
    chi2 = ((counts[cells] - n * expected[cells]) ** 2 / (n * expected[cells])).sum()
    assert chi2 < 20.515  # chi-square critical value, dof 5, alpha = 0.001


def test_sample_children_support_and_logits():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    drawn = sample_children(probs.log(), 3, torch.Generator().manual_seed(0))
    assert sorted(drawn.tolist()) == [1, 3]  # truncated to the support
    logits = torch.tensor([0.3, -1.0, 2.0, 0.5, 0.0])
    from_logits = sample_children(logits, 3, torch.Generator().manual_seed(5))
    from_probs = sample_children(logits.softmax(-1).log(), 3, torch.Generator().manual_seed(5))
    torch.testing.assert_close(from_logits, from_probs)
    assert len(set(from_logits.tolist())) == 3


def test_draft_tree_container():
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7]),
        parents=torch.tensor([-1, 0, 0]),
        scores=torch.tensor([0.0, -0.1, -0.2]),
    )
    assert tree.num_nodes == 3 and tree.draft_probs is None
    with pytest.raises(ValueError, match="tokens"):
        DraftTree(tokens=torch.tensor([5]), parents=tree.parents, scores=tree.scores)


@pytest.mark.parametrize(
    "parents",
    [[0, 0], [-1, 0, 3, 1], [-1, 1], [-1, -1], []],
)
def test_bad_parents_raise(parents):
    with pytest.raises(ValueError, match="parents"):
        tree_attention_mask(torch.tensor(parents, dtype=torch.long))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="total_tokens"):
        rerank(torch.zeros(3), torch.tensor([-1, 0, 1]), total_tokens=0)
    with pytest.raises(ValueError, match="must not increase"):
        rerank(torch.tensor([-1.0, -0.5]), torch.tensor([-1, 0]), total_tokens=2)
    with pytest.raises(ValueError, match="num"):
        sample_children(torch.zeros(4), 0)
