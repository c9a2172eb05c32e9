"""Row-exact verification (generation/exact_attention.py): in bf16, each node of a tree forward gets, bit for bit,
the logits the target's own one-token decoding steps give along that node's path; and greedy EAGLE-3 output equals
plain bf16 greedy output token for token, for every family (sliding-window targets past their window included).

That holds where the target's matmuls are row-invariant on this CPU, which the row-invariance probe decides first
(tests/helpers/exactness.py): each test runs as its "exact" case there and as its "near-tie" case elsewhere (the probe names
the op that differs, greedy divergences are near-ties of the fp32 target), and skips the other with the probe's
answer. Targets made row-invariant on purpose (`rowwise_linears`) check the attention path bit for bit on any CPU.
"""

import copy
import dataclasses

import pytest
import torch
from helpers import exactness
from helpers.exact import RowDependentMLP, V, bf16_target
from helpers.exactness import EXPECTATIONS, assert_near_ties, case, expectation, probe_for, rowwise_linears
from helpers.generation import FAMILIES
from transformers.cache_utils import DynamicCache

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.bench.report import NEAR_TIE_ULPS, ulp
from eagle3_hf.generation.exact_attention import exact_verification
from eagle3_hf.utils.compat import cache_kwargs

TREE = [-1, 0, 0, 0, 1, 1, 1, 2, 4, 4, 5, 8, 8, 9, 11, 11, 13, 14]  # 18 nodes, depth 6, up to 4 wide


def plain_rows(target, cache, tokens, parents):
    """Each node's logits `[T, V]` from one-token steps along its path, from copies of `cache`."""
    rows = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        step_cache = copy.deepcopy(cache)
        for n in reversed(path):
            logits = target(tokens[None, n : n + 1], use_cache=True, **cache_kwargs(step_cache)).logits
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
    from eagle3_hf.generation.target_cache import target_tree_mask

    past = prompt.shape[1]
    with exact_verification(target, enabled=exact) as state:
        cache = DynamicCache()
        extra = {} if state is None else {"eagle3_exact": state}
        target(prompt, use_cache=True, **cache_kwargs(cache), **extra)
        if state is not None:
            state.set_tree(torch.tensor(parents), past)
        out = target(
            tokens[None],
            use_cache=True,
            **cache_kwargs(cache),
            position_ids=(past + torch.tensor(depths))[None],
            attention_mask=target_tree_mask(target.config, mask, past, target.dtype),
            **extra,
        )
    return out.logits[0]


@pytest.mark.grid(by=("expect",))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("expect", EXPECTATIONS)
def test_tree_rows_equal_one_token_steps(family, implementation, expect):
    target = bf16_target(family, implementation)
    probe = case(target, expect)
    if expect == "near-tie":
        # What differs is a matmul's rounding over several rows, never the attention call row-exact verification
        # shapes: with the linear layers made row-invariant, every node is bit for bit its one-token steps again.
        assert probe.first_difference and not probe.first_difference.endswith("(attention)"), probe.describe()
        rowwise_linears(target)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for past in (3, 11, 21, 509):  # sliding windows of 5: before, across and past them; 512-key kernel blocks
            prompt = torch.randint(0, V, (1, past), generator=generator)
            tokens = torch.randint(0, V, (len(TREE),), generator=generator)
            cache = DynamicCache(config=target.config)  # what plain generate() decodes with
            target(prompt, use_cache=True, **cache_kwargs(cache))
            reference = plain_rows(target, cache, tokens, TREE)
            rows = tree_rows(target, prompt, tokens, TREE, exact=True)
            assert torch.equal(rows, reference), f"{family}/{implementation}, {past} tokens of prefix"
            assert target.config._attn_implementation == implementation  # restored after the call


# Trees within `ExactAttention.max_rows` (16) give every node its own row of prefix copies, its path written in one
# gather for all nodes; a tree whose nodes are not in depth order is reordered for the calls and back.
SMALL_TREES = {
    "sorted, one row per node": TREE[:16],
    "not in depth order": [-1, 0, 1, 0, 2, 3, 1, 4, 0, 6],
}


@pytest.mark.grid(by=("expect",))
@pytest.mark.parametrize("tree", list(SMALL_TREES))
@pytest.mark.parametrize("family,implementation", [("llama", "sdpa"), ("llama", "eager"), ("gemma3", "sdpa")])
@pytest.mark.parametrize("expect", EXPECTATIONS)
def test_small_and_unsorted_tree_rows_equal_one_token_steps(family, implementation, tree, expect):
    target, parents = bf16_target(family, implementation), SMALL_TREES[tree]
    probe = case(target, expect)
    if expect == "near-tie":  # as in test_tree_rows_equal_one_token_steps
        assert probe.first_difference and not probe.first_difference.endswith("(attention)"), probe.describe()
        rowwise_linears(target)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for past in (3, 21):
            prompt = torch.randint(0, V, (1, past), generator=generator)
            tokens = torch.randint(0, V, (len(parents),), generator=generator)
            cache = DynamicCache(config=target.config)
            target(prompt, use_cache=True, **cache_kwargs(cache))
            reference = plain_rows(target, cache, tokens, parents)
            assert torch.equal(tree_rows(target, prompt, tokens, parents, exact=True), reference), f"{tree}, {past}"


# ------------------------------------------------------------------------------------------------
# generate(): bf16 EAGLE-3 greedy output equals plain bf16 greedy output

TREES = {
    "chain": dict(tree_top_k=1, tree_depth=6, adaptive_tree=False),
    "wide": dict(tree_top_k=8, tree_depth=2, adaptive_tree=False),
    "deep": dict(tree_top_k=4, tree_depth=5, adaptive_tree=False),
    "adaptive": dict(),
}
NEW = 40  # well past the 5-token sliding windows of the Mistral and Gemma3 targets


def greedy(target, prompt, **kwargs):
    return target.generate(
        prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW, **kwargs
    ).tolist()


@pytest.fixture(scope="module")
def bf16_case():
    cache = {}

    def get(family, implementation="sdpa"):
        if (family, implementation) not in cache:
            target = bf16_target(family, implementation)
            torch.manual_seed(1)
            draft = bind_target(Eagle3DraftModel.from_target(target), target)
            generator = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, V, (1, n), generator=generator) for n in (3, 9, 17)]
            cache[family, implementation] = (target, draft, prompts, [greedy(target, p) for p in prompts])
        return cache[family, implementation]

    return get


def check_greedy(target, prompt, reference, out, probe, expect, label):
    """Token identity in the exact case; near-ties of the fp32 target in the near-tie case."""
    if expect == "exact":
        assert out == reference, label
    else:
        P = prompt.shape[1]
        assert_near_ties(target, prompt, reference[0][P:], out[0][P:], probe, label)


@pytest.mark.grid(by=("expect",))
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("expect", EXPECTATIONS)
def test_bf16_greedy_is_token_identical(bf16_case, family, tree, expect):
    target, draft, prompts, references = bf16_case(family)
    probe = case(target, expect)
    for prompt, reference in zip(prompts, references):
        out = greedy(target, prompt, assistant_model=draft, **TREES[tree])
        check_greedy(target, prompt, reference, out, probe, expect, f"{family}/{tree}, prompt of {prompt.shape[1]}")


@pytest.mark.grid(by=("expect",))
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("expect", EXPECTATIONS)
def test_bf16_greedy_is_token_identical_with_eager(bf16_case, family, expect):
    target, draft, prompts, references = bf16_case(family, "eager")
    probe = case(target, expect)
    for prompt, reference in zip(prompts, references):
        out = greedy(target, prompt, assistant_model=draft, **TREES["deep"])
        check_greedy(target, prompt, reference, out, probe, expect, f"{family}/eager, prompt of {prompt.shape[1]}")
    assert target.config._attn_implementation == "eager"


@pytest.mark.slow
def test_one_tree_masked_call_is_not_exact_in_bf16(bf16_case):
    """The control: the same cases verified by one tree-masked attention call (exact_verify=False) do differ, so the
    equalities above are what row-exact verification buys, not what these cases give anyway."""
    differing = 0
    for family in FAMILIES:
        target, draft, prompts, references = bf16_case(family)
        for prompt, reference in zip(prompts, references):
            differing += greedy(target, prompt, assistant_model=draft, exact_verify=False, **TREES["deep"]) != reference
    assert differing > 0


@pytest.fixture(scope="module")
def smollm2_bf16():
    """SmolLM2 in bf16 with prepacked weights, loaded once for both cases of the test below (the probe too)."""
    from eagle3_hf.modeling.packed_linear import prepack_linears
    from eagle3_hf.modeling.shipped import SMOLLM2
    from eagle3_hf.targets import load_target

    target = load_target(SMOLLM2, dtype=torch.bfloat16)
    prepack_linears(target)
    probe_for(target)
    return target


@pytest.mark.slow
@pytest.mark.parametrize("expect", EXPECTATIONS)
def test_smollm2_bf16_greedy_is_token_identical(tokenizer_dir, smollm2_bf16, expect):
    """The real target in bf16 with prepacked weights (how `bench` and `generate` decode on a bf16 CPU) and the
    shipped draft: EAGLE-3's greedy output equals plain bf16 greedy decoding over 128 tokens of real prompts where the
    probe proves row-exact verification bit for bit on this CPU, and leaves it only at near-ties of the fp32 target
    elsewhere (an AMD EPYC without AMX rounds SmolLM2's `mlp.down_proj` over 16 rows differently from one row)."""
    from helpers.generation import mt_bench_questions
    from transformers import AutoTokenizer

    from eagle3_hf.draft_names import load_draft_for
    from eagle3_hf.modeling.shipped import SMOLLM2
    from eagle3_hf.targets import load_target

    target = smollm2_bf16
    probe = case(target, expect)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    draft = load_draft_for(SMOLLM2, target)
    scorer = load_target(SMOLLM2, dtype=torch.float32) if expect == "near-tie" else None
    drafted = 0
    for question in mt_bench_questions()[2::40]:  # two questions of other categories
        messages = [{"role": "user", "content": question["turns"][0]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=128)
        expected = target.generate(ids, **kwargs)
        out = target.generate(
            ids,
            assistant_model=draft,
            return_dict_in_generate=True,
            adaptive_tree=False,
            tree_depth=5,
            tree_top_k=4,
            tree_total_tokens=24,
            exact_verify=True,
            **kwargs,
        )
        label = f"question {question['question_id']}"
        if expect == "exact":
            assert out.sequences.tolist() == expected.tolist(), label
        else:
            P = ids.shape[1]
            reference, other = expected[0, P:].tolist(), out.sequences[0, P:].tolist()
            assert_near_ties(target, ids, reference, other, probe, label, scorer=scorer)
        drafted += sum(length - 1 for length in out.accept_lengths)
    assert drafted > 0


# ------------------------------------------------------------------------------------------------
# the row-invariance probe


@pytest.mark.grid
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_probe_finds_the_exact_path_bitwise_and_names_the_attention_call_otherwise(family):
    from eagle3_hf.generation.probe import probe_row_exactness

    target = rowwise_linears(bf16_target(family))  # row-invariant matmuls on any CPU: only attention can differ
    exact = probe_row_exactness(target, prefix=21)  # past Gemma3's 5-token sliding window
    assert exact.identical and exact.first_difference is None and exact.max_logit_difference == 0.0
    assert "bit for bit" in exact.describe()
    broken = probe_row_exactness(target, prefix=21, exact_verify=False)
    assert not broken.identical and broken.max_logit_difference > 0
    assert broken.first_difference == "model.layers.0.self_attn (attention)"
    assert "first at model.layers.0.self_attn (attention)" in broken.describe()


def test_probe_names_the_op_that_breaks_exactness():
    from eagle3_hf.generation.probe import probe_row_exactness

    target = rowwise_linears(bf16_target("llama"))
    target.model.layers[2].mlp = RowDependentMLP(target.model.layers[2].mlp)
    result = probe_row_exactness(target, prefix=9)
    assert not result.identical
    assert result.first_difference == "model.layers.2.mlp"


def test_probe_first_puts_each_test_in_the_case_the_hardware_proves():
    """tests/helpers/exactness.py's choice, shown on both sides on any CPU: a target made row-invariant on purpose runs the
    exact case, the same target with one MLP made row-dependent the near-tie case; `case` skips the other, saying
    which case runs and what the probe found."""
    exact = rowwise_linears(bf16_target("llama"))
    broken = rowwise_linears(bf16_target("llama"))
    broken.model.layers[1].mlp = RowDependentMLP(broken.model.layers[1].mlp)
    assert expectation(probe_for(exact)) == "exact"
    assert expectation(probe_for(broken)) == "near-tie" and probe_for(broken).first_difference == "model.layers.1.mlp"
    assert case(exact, "exact") is probe_for(exact) and case(broken, "near-tie") is probe_for(broken)
    with pytest.raises(pytest.skip.Exception, match="the exact case runs on this CPU: verify forward == one-token"):
        case(exact, "near-tie")
    with pytest.raises(pytest.skip.Exception, match=r"the near-tie case runs .* first at model\.layers\.1\.mlp"):
        case(broken, "exact")
    with pytest.raises(ValueError, match="expect must be one of"):
        case(exact, "close")


def test_the_near_tie_case_fails_a_flip_at_a_clear_margin():
    """The near-tie case is not a pass for any output: a divergence where the fp32 target is far from a tie fails."""
    target = rowwise_linears(bf16_target("llama"))
    target.model.layers[1].mlp = RowDependentMLP(target.model.layers[1].mlp)
    probe = probe_for(target)
    prompt = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(4))
    reference = greedy(target, prompt)[0][7:]
    assert assert_near_ties(target, prompt, reference, list(reference), probe) is None
    scorer = exactness.fp32_scorer(target)
    with torch.no_grad():  # the position where the fp32 target's choice is clearest, and its second choice there
        logits = scorer(torch.tensor([prompt[0].tolist() + reference])).logits[0, 6:-1].float()  # [NEW, V]
    top = logits.topk(2)
    ulps = [(t[0] - t[1]) / ulp(float(t[0]), torch.bfloat16) for t in top.values]
    at = max(range(len(ulps)), key=lambda i: ulps[i])
    assert ulps[at] >= NEAR_TIE_ULPS  # so the forced flip below is not a near-tie
    flipped = reference[:at] + [int(top.indices[at, 1])]
    with pytest.raises(AssertionError, match="not a rounding flip"):
        assert_near_ties(target, prompt, reference, flipped, probe, "forced")
    unnamed = dataclasses.replace(probe, first_difference=None)
    with pytest.raises(AssertionError, match="named no op"):
        assert_near_ties(target, prompt, reference, flipped, unnamed)


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3]])
def test_probe_refuses_a_malformed_tree(parents):
    from eagle3_hf.generation.probe import probe_row_exactness

    with pytest.raises(ValueError, match="parents"):
        probe_row_exactness(bf16_target("llama"), parents=parents)
