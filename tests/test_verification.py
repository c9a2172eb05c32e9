import itertools

import pytest
import torch

from eagle3_hf.generation.tree import children_lists, sample_children
from eagle3_hf.generation.verification import AcceptResult, _rrs_stages, greedy_accept, rrs_step, sample_accept

#                      0:10
#                    /      \
#                 1:11      2:12
#                /    \        \
#             3:13   4:14      5:15
#              |
#             6:16
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
TOKENS = torch.tensor([10, 11, 12, 13, 14, 15, 16])
CHILDREN = children_lists(PARENTS)


GREEDY_CASES = [
    ([99, 0, 0, 0, 0, 0, 0], [0], 99),  # rejected at the root
    ([11, 13, 0, 16, 0, 0, 77], [0, 1, 3, 6], 77),  # the full deepest path
    ([12, 0, 15, 0, 0, 42, 0], [0, 2, 5], 42),  # the other branch, down to a leaf
    ([11, 14, 0, 0, 8, 0, 0], [0, 1, 4], 8),  # second sibling chosen
    ([11, 50, 0, 0, 0, 0, 0], [0, 1], 50),  # stops mid-path
]


@pytest.mark.parametrize("target_next, path, bonus", GREEDY_CASES)
def test_greedy_accept(target_next, path, bonus):
    result = greedy_accept(TOKENS.tolist(), CHILDREN, target_next.__getitem__)
    assert result == AcceptResult(path=path, bonus_token=bonus)


@pytest.mark.parametrize("target_next, path, bonus", GREEDY_CASES)
def test_greedy_accept_with_a_callable_reads_only_the_visited_nodes(target_next, path, bonus):
    read = []
    result = greedy_accept(TOKENS.tolist(), CHILDREN, lambda node: read.append(node) or target_next[node])
    assert result == AcceptResult(path=path, bonus_token=bonus)
    assert read == path  # each node on the path once, in order, and no other


def _without_replacement_sequences(q: torch.Tensor, k: int):
    """All ordered draws of k distinct tokens from q, with their probabilities."""
    support = [x for x in range(q.shape[0]) if q[x] > 0]
    for seq in itertools.permutations(support, k):
        prob, used = 1.0, 0.0
        for x in seq:
            prob *= float(q[x]) / (1.0 - used)
            used += float(q[x])
        yield list(seq), prob


def _exact_rrs_output(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """Exact law of the token produced at one node (accepted sibling or residual draw), integrating over the
    draws of the k siblings and over the acceptance uniforms."""
    out = torch.zeros_like(p)
    total = 0.0
    for seq, prob in _without_replacement_sequences(q, k):
        total += prob
        reach = 1.0  # probability that all earlier siblings were rejected
        stages = list(_rrs_stages(p, q, seq))
        for x, (accept, _) in zip(seq, stages):
            out[x] += prob * reach * accept
            reach *= 1.0 - accept
        out += prob * reach * stages[-1][1]
    assert abs(total - 1.0) < 1e-12
    return out


def _dist(values):
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


PQ_PAIRS = {
    "generic": (_dist([0.1, 0.2, 0.3, 0.25, 0.15]), _dist([0.3, 0.1, 0.15, 0.25, 0.2])),
    "q_zero_where_p_positive": (_dist([0.1, 0.2, 0.3, 0.25, 0.15]), _dist([0.5, 0.3, 0.2, 0.0, 0.0])),
    "p_zero_where_q_positive": (_dist([0.0, 0.5, 0.0, 0.5, 0.0]), _dist([0.2, 0.2, 0.2, 0.2, 0.2])),
    "both_have_zeros": (_dist([0.6, 0.0, 0.4, 0.0]), _dist([0.1, 0.5, 0.0, 0.4])),
    "p_equals_q": (_dist([0.4, 0.3, 0.2, 0.1]), _dist([0.4, 0.3, 0.2, 0.1])),
    "p_one_hot": (_dist([0.0, 0.0, 1.0, 0.0]), _dist([0.25, 0.25, 0.25, 0.25])),
}


@pytest.mark.parametrize("name", sorted(PQ_PAIRS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_rrs_exact_distribution_is_target(name, k):
    p, q = PQ_PAIRS[name]
    if int((q > 0).sum()) < k:
        pytest.skip("fewer draft tokens than siblings")
    torch.testing.assert_close(_exact_rrs_output(p, q, k), p, rtol=0, atol=1e-6)


def test_rrs_step_follows_the_stages():
    # rrs_step accepts sibling i iff uniforms[i] < accept probability of stage i, and returns that stage's p.
    generator = torch.Generator().manual_seed(0)
    for p, q in PQ_PAIRS.values():
        for seq, _ in _without_replacement_sequences(q, 2):
            stages = list(_rrs_stages(p, q, seq))
            for _ in range(5):
                uniforms = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
                expected = next((i for i in range(2) if uniforms[i] < stages[i][0]), None)
                index, residual = rrs_step(p, q, seq, uniforms)
                assert index == expected
                torch.testing.assert_close(residual, stages[2 if index is None else index][1])
    # Single sibling, hand-computed: accept probability min(1, 0.2 / 0.5) = 0.4, residual = [0.8, 0.2, 0] / 1.
    p, q = _dist([0.2, 0.6, 0.2]), _dist([0.5, 0.1, 0.4])
    assert rrs_step(p, q, [0], [0.39])[0] == 0
    index, residual = rrs_step(p, q, [0], [0.41])
    assert index is None
    torch.testing.assert_close(residual, _dist([0.0, 0.5, 0.0]))
    index, residual = rrs_step(p, q, [0, 2], [0.41, 0.99])  # then q -> [0, .2, .8], p -> [0, 1, 0]
    assert index is None
    torch.testing.assert_close(residual, _dist([0.0, 1.0, 0.0]))


def test_rrs_degenerate_cases():
    # Drafted token with zero draft mass: accepted iff the target gives it mass.
    p, q = _dist([0.5, 0.5, 0.0]), _dist([1.0, 0.0, 0.0])
    assert rrs_step(p, q, [1], [0.999])[0] == 0
    assert rrs_step(p, q, [2], [0.0])[0] is None
    # Residual without mass (p below q everywhere, e.g. an unnormalised p): fall back to p minus rejected tokens.
    p, q = torch.tensor([0.2, 0.3], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64)
    index, residual = rrs_step(p, q, [0], [0.9])
    assert index is None
    torch.testing.assert_close(residual, _dist([0.0, 1.0]))
    with pytest.raises(ValueError, match="distinct"):
        rrs_step(p, q, [0, 0], [0.1, 0.2])
    with pytest.raises(ValueError, match="uniform"):
        rrs_step(p, q, [0], [])
    with pytest.raises(ValueError, match="drafted"):
        rrs_step(p, q, [5], [0.5])


# Toy language over V = 4 tokens. TARGET[t] / DRAFT[t] are the target / draft next-token laws after token t.
# Token 3 is outside the draft vocabulary (q = 0 there) though the target likes it; the target puts no mass
# on token 1 after token 2 although the draft does.
TARGET = torch.tensor(
    [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64
)
DRAFT = torch.tensor(
    [[0.6, 0.3, 0.1, 0.0], [0.2, 0.2, 0.6, 0.0], [0.3, 0.4, 0.3, 0.0], [0.5, 0.25, 0.25, 0.0]], dtype=torch.float64
)


def _build_sampled_tree(root: int, generator: torch.Generator):
    """Depth-2 tree: the root and each of its 2 children get 2 children drawn without replacement."""
    tokens, parents = [root], [-1]
    for parent in (0, 1, 2):
        if parent >= len(tokens):
            break
        for token in sample_children(DRAFT[tokens[parent]].log(), 2, generator).tolist():
            tokens.append(token)
            parents.append(parent)
    tokens = torch.tensor(tokens)
    return tokens, torch.tensor(parents), DRAFT[tokens], TARGET[tokens]


def test_sample_accept_is_lossless_monte_carlo():
    """Speculative generation of 2 tokens after token 0 must follow TARGET exactly: P(x, y) = T[0, x] T[x, y]."""
    generator = torch.Generator().manual_seed(1234)
    n = 3000
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for _ in range(n):
        emitted = []
        while len(emitted) < 2:
            tokens, parents, draft_probs, target_probs = _build_sampled_tree(emitted[-1] if emitted else 0, generator)
            result = sample_accept(tokens, parents, target_probs.__getitem__, draft_probs, generator)
            emitted += tokens[result.path[1:]].tolist() + [result.bonus_token]
        counts[emitted[0], emitted[1]] += 1

    expected = TARGET[0][:, None] * TARGET
    assert counts[expected == 0].sum() == 0
    cells = expected > 0  # 15 cells -> 14 degrees of freedom
    joint_chi2 = ((counts[cells] - n * expected[cells]) ** 2 / (n * expected[cells])).sum()
    assert joint_chi2 < 36.123  # chi-square critical value, dof 14, alpha = 0.001

    first = counts.sum(dim=1)  # first emitted token: accepted root child or bonus; 4 cells -> dof 3
    first_chi2 = ((first - n * TARGET[0]) ** 2 / (n * TARGET[0])).sum()
    assert first_chi2 < 16.266  # chi-square critical value, dof 3, alpha = 0.001


def test_sample_accept_one_hot_target_matches_greedy():
    # With a one-hot target the draft distribution is irrelevant: sampling verification = greedy verification.
    generator = torch.Generator().manual_seed(7)
    for trial in range(30):
        target_next = torch.randint(10, 17, (7,), generator=generator)
        target_probs = torch.nn.functional.one_hot(target_next, 20).double()
        draft_probs = torch.rand(7, 20, generator=generator, dtype=torch.float64)
        draft_probs /= draft_probs.sum(-1, keepdim=True)
        sampled = sample_accept(TOKENS, PARENTS, target_probs.__getitem__, draft_probs, generator)
        assert sampled == greedy_accept(TOKENS.tolist(), CHILDREN, target_next.tolist().__getitem__), trial


def test_sample_accept_reproducible_and_lazy():
    target = TARGET[torch.tensor([0, 1, 2, 3, 0, 1, 2])]
    draft = DRAFT[torch.tensor([0, 1, 2, 3, 0, 1, 2])]
    tokens = torch.tensor([0, 0, 1, 2, 1, 0, 3])  # children of each node are distinct draft tokens
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
    visited = []

    def target_fn(node):
        visited.append(node)
        return target[node]

    results = [sample_accept(tokens, parents, target_fn, draft, torch.Generator().manual_seed(s)) for s in range(20)]
    again = [
        sample_accept(tokens, parents, target.__getitem__, draft, torch.Generator().manual_seed(s)) for s in range(20)
    ]
    assert results == again
    # Only the nodes on the accepted paths are evaluated.
    assert sorted(visited) == sorted(node for r in results for node in r.path)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="parents"):
        sample_accept(TOKENS, PARENTS[:-1], torch.zeros(7, 20).__getitem__, torch.zeros(7, 20))
