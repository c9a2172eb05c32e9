"""The context lookup in the tree (generation/hybrid.py): grafting, and decoding that stays exact.

Greedy: with `context_lookup=True` (the hybrid tree) and with the model-free `ContextLookup`, output equals plain
greedy decoding token for token, in fp32 across the families of test_generation.py, on prompts made to repeat so
that the lookup fires -- and it must have proposed accepted tokens, or the test proves nothing. Sampling: the
recursive rejection over point-mass (lookup) and drawn siblings, duplicates removed, follows the target's law
(chi-square on the first two tokens); test_sampling.py checks the same inside generate().
"""

import math

import pytest
import torch
from helpers.generation import FAMILIES, NEW, V, cached_cases, eagle
from helpers.sampling import chi_square

from eagle3_hf import ContextLookup
from eagle3_hf.generation.context_index import build_trie
from eagle3_hf.generation.hybrid import (
    BOTH,
    DRAFT,
    LOOKUP,
    Candidates,
    LookupStats,
    best_lookup_nodes,
    graft,
    source_counts,
)
from eagle3_hf.generation.tree import DraftTree, HostTree, sample_children
from eagle3_hf.generation.verification import rrs_step, sample_accept


def repetitive_prompts(seed=0):
    """Prompts that repeat a random phrase, so that earlier occurrences predict continuations."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for phrase, repeats in ((4, 3), (6, 3), (9, 2)):
        words = torch.randint(0, V, (phrase,), generator=generator)
        prompts.append(torch.cat([words] * repeats + [words[: phrase // 2]])[None])
    return prompts


HYBRID = {
    "deep": dict(tree_top_k=2, tree_depth=6, adaptive_tree=False),
    "adaptive": dict(),
    "skip-draft": dict(tree_top_k=2, tree_depth=4, adaptive_tree=False, lookup_confidence=0.05),
}


@pytest.fixture(scope="module")
def cases():
    return cached_cases(repetitive_prompts)


@pytest.mark.parametrize("tree", list(HYBRID))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_greedy_matches_plain_generate(cases, family, tree):
    target, draft, prompts, references = cases(family)
    totals = [0, 0, 0]
    for prompt, reference in zip(prompts, references):
        out = eagle(
            target, draft, prompt, max_new_tokens=NEW, return_dict_in_generate=True, context_lookup=True, **HYBRID[tree]
        )
        assert out.sequences.tolist() == reference.tolist(), f"{family}/{tree}, prompt of {prompt.shape[1]} tokens"
        assert len(out.accept_sources) == len(out.accept_lengths)
        for i, c in enumerate((out.accepted_from_draft, out.accepted_from_lookup, out.accepted_from_both)):
            totals[i] += c
        # accepted tree tokens are at most what each cycle added minus its bonus token
        assert sum(map(sum, out.accept_sources)) <= sum(out.accept_lengths) - len(out.accept_lengths) + 1
    if tree != "adaptive":  # the cost model may rightly verify little where the target rarely repeats
        assert totals[1] + totals[2] > 0, f"{family}/{tree}: the lookup never proposed an accepted token"
    if tree == "skip-draft":  # a confident lookup skips the draft: the draft alone then adds little
        assert totals[1] + totals[2] >= totals[0]


MODEL_FREE = [dict(), dict(adaptive_tree=False), dict(tree_depth=3, tree_total_tokens=6, adaptive_tree=False)]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("options", MODEL_FREE)
def test_model_free_lookup_matches_plain_generate(cases, family, options):
    target, _, prompts, references = cases(family)
    lookup = ContextLookup().bind(target)
    accepted = 0
    for prompt, reference in zip(prompts, references):
        out = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            assistant_model=lookup,
            do_sample=False,
            max_new_tokens=NEW,
            return_dict_in_generate=True,
            **options,
        )
        assert out.sequences.tolist() == reference.tolist(), f"{family} {options}, prompt of {prompt.shape[1]}"
        assert out.accepted_from_draft == 0 and out.accepted_from_both == 0
        accepted += out.accepted_from_lookup
        if "tree_total_tokens" in options:
            assert max(out.tree_sizes) <= options["tree_total_tokens"]
    if options.get("adaptive_tree", True) is False:
        # (adaptive trees are sized from measured times: on a target that rarely repeats, they may verify little)
        assert accepted > 0, f"{family} {options}: the lookup never had a token accepted"


def test_model_free_lookup_refuses_prompt_lookup_and_binds_once(cases):
    target, _, prompts, _ = cases("llama")
    lookup = ContextLookup().bind(target)
    bound = target.generate
    ContextLookup().bind(target)
    assert target.generate is bound
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        target.generate(prompts[0], assistant_model=lookup, prompt_lookup_num_tokens=3, max_new_tokens=4)
    with pytest.raises(ValueError, match="lookup branches"):
        target.generate(prompts[0], assistant_model=lookup, lookup_branches=0, max_new_tokens=4)


# ------------------------------------------------------------------------------------------------
# grafting (pure)


def test_graft_merges_equal_nodes_and_keeps_the_best():
    #  draft: 0:r -> 1:a(0.6) -> 3:c(0.3) ; 0 -> 2:b(0.3)
    scores = torch.tensor([0.0, math.log(0.6), math.log(0.3), math.log(0.3)])
    draft = DraftTree.from_lists(HostTree([9, 1, 2, 3], [-1, 0, 0, 1], scores.tolist()), torch.device("cpu"))
    # lookup: r -> a -> d -> e (one continuation, on a match of 8 tokens)
    trie = build_trie([7, 1, 4, 5, 7], [(1, 8)], depth=3)
    assert trie.tokens == [-1, 1, 4, 5]
    cands = Candidates.of(trie, LookupStats())
    row = graft(draft.host, cands, total_tokens=10)
    tree, sources, match = row.tree, row.sources, row.match[LOOKUP]
    assert tree.tokens.tolist() == [9, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 4]
    assert sources == [0, BOTH, DRAFT, DRAFT, LOOKUP, LOOKUP]
    assert match == [0, 8, 0, 0, 9, 10]
    est = tree.scores.exp().tolist()
    assert est[1] == pytest.approx(max(0.6, LookupStats().rate(8)))  # merged: the larger estimate
    assert est[4] == pytest.approx(est[1] * LookupStats().rate(9))
    # estimates never increase from parent to child, so a cut keeps parents
    assert all(est[c] <= est[p] + 1e-9 for c, p in enumerate(tree.parents.tolist()) if p >= 0)
    cut = graft(draft.host, cands, total_tokens=4)
    kept = cut.tree.tokens.tolist()
    assert len(kept) == 4 and kept[:2] == [9, 1] and cut.sources[1] == BOTH
    assert source_counts(sources, [0, 1, 4], 2) == (0, 1, 0, 1)


def test_lookup_stats_learn_the_hit_rate():
    stats = LookupStats()
    prior = stats.rate(2)
    for _ in range(40):
        stats.observe(2, hit=True)
    assert stats.rate(2) > 0.9 > prior and stats.rate(3) == pytest.approx(LookupStats().rate(3))
    assert stats.bucket(100) == stats.bucket(8) and stats.bucket(0) == stats.bucket(1)


def test_best_lookup_nodes_are_prefix_closed():
    trie = build_trie([1, 2, 3, 1, 2, 4, 1], [(1, 3), (4, 1)], depth=3)
    cond = Candidates.of(trie, LookupStats()).cond
    for limit in range(trie.num_nodes):
        chosen = best_lookup_nodes(trie, cond, limit)
        assert len(chosen) <= limit
        assert all(trie.parents[i] == 0 or trie.parents[i] in chosen for i in chosen)


# ------------------------------------------------------------------------------------------------
# sampling with point masses (pure)


def test_rrs_step_point_mass_is_accepted_with_its_target_probability():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    # u=0.49 >= p[1]=0.3 rejects the point mass; then draft 0 has p_1[0] = 0.5/0.7 > q[0]: accepted
    index, _ = rrs_step(p, q, [0], [0.49, 0.99], point_masses=[1])
    assert index == 1
    index, _ = rrs_step(p, q, [2], [0.29, 0.9], point_masses=[1])
    assert index == 0
    # after the point mass is rejected, a draw repeating it is never accepted
    index, residual = rrs_step(p, q, [1, 2], [0.99, 0.0, 0.99], point_masses=[1])
    assert index is None and float(residual[1]) == 0.0
    with pytest.raises(ValueError, match="point_masses"):
        rrs_step(p, q, [0], [0.1, 0.1, 0.1], point_masses=[1, 1])


def test_sampling_with_point_masses_and_removed_duplicates_is_lossless():
    """A root with a lookup chain s -> s2 and two draft children drawn without replacement (a draw equal to s
    removed with its subtree, kept in the draw sequence), the first with a drawn child of its own. The first two
    emitted tokens must follow p0(x1) * P1[x1](x2)."""
    vocab, n = 5, 6000
    gen = torch.Generator().manual_seed(0)
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10], dtype=torch.float64)
    P1 = torch.softmax(torch.randn(vocab, vocab, generator=gen, dtype=torch.float64), dim=-1) * 0.7 + 0.3 / vocab
    q0 = torch.tensor([0.05, 0.40, 0.30, 0.05, 0.20], dtype=torch.float64)  # the draft prefers other tokens
    q1 = torch.softmax(torch.randn(vocab, vocab, generator=gen, dtype=torch.float64), dim=-1)
    s, s2 = 2, 4  # the lookup's continuation
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    removed = 0
    for _ in range(n):
        d1, d2 = sample_children(q0.log(), 2, gen).tolist()
        tokens, parents, rows = [0, s, s2], [-1, 0, 1], [p0, P1[s], P1[s]]
        probs = [q0, torch.zeros(vocab, dtype=torch.float64), torch.zeros(vocab, dtype=torch.float64)]
        draws = [d1, d2]
        for d in draws:
            if d == s:
                removed += 1
                continue
            tokens.append(d)
            parents.append(0)
            rows.append(P1[d])
            probs.append(q1[d])
            if d == d1:
                child = int(sample_children(q1[d].log(), 1, gen)[0])
                tokens.append(child)
                parents.append(len(tokens) - 2)
                rows.append(torch.full((vocab,), 1.0 / vocab, dtype=torch.float64))
                probs.append(torch.zeros(vocab, dtype=torch.float64))
        point = [False, True, True] + [False] * (len(tokens) - 3)
        result = sample_accept(
            torch.tensor(tokens),
            torch.tensor(parents),
            torch.stack(rows).__getitem__,
            torch.stack(probs),
            generator=gen,
            point_mass=point,
            draws={0: draws},
        )
        out = [tokens[i] for i in result.path[1:]] + [result.bonus_token]
        if len(out) < 2:
            out.append(int(torch.multinomial(P1[out[0]], 1, generator=gen)))
        counts[out[0], out[1]] += 1
    assert removed > 0.2 * n  # duplicates of the lookup token were drawn and removed often
    law = p0[:, None] * P1
    stat, dof = chi_square(counts, n * law)
    assert dof == vocab * vocab - 1
    assert stat < 51.179, f"chi2 {stat:.1f} at {dof} dof"  # the 0.001 critical value at 24 dof


def test_sample_accept_checks_the_mixed_tree():
    with pytest.raises(ValueError, match="must come before"):
        sample_accept(
            torch.tensor([0, 1, 2]),
            torch.tensor([-1, 0, 0]),
            torch.full((3, 4), 0.25).__getitem__,
            torch.full((3, 4), 0.25),
            point_mass=[False, False, True],
        )
    with pytest.raises(ValueError, match="draws"):
        sample_accept(
            torch.tensor([0, 1, 2]),
            torch.tensor([-1, 0, 0]),
            torch.full((3, 4), 0.25).__getitem__,
            torch.full((3, 4), 0.25),
            point_mass=[False, True, False],
            draws={0: [3]},
        )
