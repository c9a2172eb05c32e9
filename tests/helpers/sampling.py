"""The sampling laws' tools: a tiny target and draft pair, the exact law of the first sampled tokens, chi-square
checks against it, and the tree shapes and sampling settings they run over."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from eagle3_hf import Eagle3DraftModel, bind_target

V = 8

PROMPT = torch.tensor([[1, 5, 2, 7]])

REPEATING = torch.tensor([[1, 5, 2, 7, 0, 3, 6, 4, 1, 5, 2, 7, 0, 3, 6, 4]])  # any next token occurred before

N = 1500  # continuations per configuration; one generate() of this size takes ~10 ms on one thread

TREES = {
    "chain": dict(tree_top_k=1, tree_depth=3),
    "tree": dict(tree_top_k=3, tree_depth=3, tree_total_tokens=10),
}

SETTINGS = {
    "T1": dict(temperature=1.0, top_p=1.0),
    "T0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
}

# Upper 0.001 quantiles of the chi-square distribution, by degrees of freedom (cells after pooling - 1). The
# pooling depends only on the exact law and N, so each configuration's dof is fixed; the test checks it.
CHI2_CRITICAL_0001 = {51: 87.968, 54: 91.872, 63: 103.442}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8)  # sharper target distributions, so top-p removes tokens
    torch.manual_seed(1)
    return target, bind_target(Eagle3DraftModel.from_target(target), target)


def warpers(temperature, top_p):
    """The warpers generate() builds for do_sample=True, top_k=0, in its order."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return processors


@torch.no_grad()
def exact_law_of_tokens_2_and_3(target, temperature, top_p, prompt=PROMPT):
    """`[V, V]` float64: P(x2 = i, x3 = j), summing over x1."""
    processors = warpers(temperature, top_p)

    def next_probs(ids):
        return torch.softmax(processors(ids, target(ids).logits[:, -1].float()).double(), dim=-1)

    p1 = next_probs(prompt)[0]  # [V]
    ids1 = torch.cat([prompt.expand(V, -1), torch.arange(V)[:, None]], dim=1)
    p2 = next_probs(ids1)  # [x1, x2]
    ids2 = torch.cat([ids1.repeat_interleave(V, dim=0), torch.arange(V).repeat(V)[:, None]], dim=1)
    p3 = next_probs(ids2).view(V, V, V)  # [x1, x2, x3]
    law = (p1[:, None, None] * p2[:, :, None] * p3).sum(dim=0)
    assert abs(float(law.sum()) - 1) < 1e-9
    return law


def chi_square(counts, expected):
    """Pearson's statistic and dof over cells of positive expectation; cells with expected < 5 pooled into one."""
    counts, expected = counts.flatten().double(), expected.flatten().double()
    small = expected < 5
    cells_e, cells_c = expected[~small].tolist(), counts[~small].tolist()
    pooled_e, pooled_c = float(expected[small].sum()), float(counts[small].sum())
    if pooled_e > 0:
        if pooled_e < 5:  # merge the pool with the smallest regular cell
            i = min(range(len(cells_e)), key=cells_e.__getitem__)
            cells_e[i] += pooled_e
            cells_c[i] += pooled_c
        else:
            cells_e.append(pooled_e)
            cells_c.append(pooled_c)
    e, c = torch.tensor(cells_e, dtype=torch.float64), torch.tensor(cells_c, dtype=torch.float64)
    return float(((c - e) ** 2 / e).sum()), len(cells_e) - 1


def check_law(target, draft, prompt, options, tree_options, name):
    """Sample N continuations and compare tokens 2 and 3 with their exact law; returns the outputs."""
    law = exact_law_of_tokens_2_and_3(target, **options, prompt=prompt)
    counts = torch.zeros(V, V, dtype=torch.float64)
    outputs = []
    for _ in range(N):
        out = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            assistant_model=draft,
            do_sample=True,
            top_k=0,
            max_new_tokens=3,
            adaptive_tree=False,
            return_dict_in_generate=True,
            **options,
            **tree_options,
        )
        x1, x2, x3 = out.sequences[0, prompt.shape[1] :].tolist()
        counts[x2, x3] += 1
        outputs.append(out)
    # Both outcomes of the first cycle's rejection sampling occur often: a draft token accepted (3 tokens after one
    # cycle) or every first-level draft rejected (a second cycle needed).
    forwards = [len(out.accept_lengths) for out in outputs]
    one_cycle = sum(f == min(forwards) for f in forwards)
    assert 0.05 * N < one_cycle < 0.95 * N
    impossible = law == 0
    if options["top_p"] < 1.0:
        assert bool(impossible.any())  # top-p removed some continuations: the check below has teeth
    assert float(counts[impossible].sum()) == 0, "sampled a continuation that top-p forbids"
    stat, dof = chi_square(counts[~impossible], N * law[~impossible])
    print(f"\n{name}: chi2 = {stat:.1f} at {dof} dof (critical {CHI2_CRITICAL_0001.get(dof)})")
    assert dof in CHI2_CRITICAL_0001, f"pooling gave {dof} dof: add its 0.001 critical value"
    assert stat < CHI2_CRITICAL_0001[dof], f"{name}: chi2 {stat:.1f} at {dof} dof"
    return outputs
