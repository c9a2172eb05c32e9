"""The batch cost model: the same draft confidence buys smaller trees as the batch grows, and none at all once a
plain batched step is faster per token."""

import torch

from eagle3_hf.generation.batched_cost import BatchCostModel
from eagle3_hf.generation.cost_model import LinearCost

# per-row node path probabilities, best first: a confident chain, then weaker siblings
PROBS = torch.tensor([0.8, 0.6, 0.45, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03, 0.02])


def model(rows, a=1.0, b=0.02):
    cost = BatchCostModel(verify=LinearCost(prior_a=a, prior_b=b), draft_step=LinearCost(prior_a=0.05, prior_b=0.0))
    cost.rows = rows
    return cost


def test_trees_shrink_as_the_batch_grows_then_plain_steps_win():
    sizes = [model(rows).choose_size(PROBS.expand(rows, -1), draft_seconds=0.1)[0] for rows in (1, 4, 16, 64, 256)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[2]
    assert sizes[0] >= 4 and sizes[-1] == 0  # wide at batch 1, a plain batched step at 256 rows


def test_predicted_acceptance_is_summed_over_rows():
    cost = model(4)
    n, predicted = cost.choose_size(PROBS.expand(4, -1), draft_seconds=0.0)
    assert n > 0 and abs(predicted - 4 * float(PROBS[:n].double().sum())) < 1e-6


def test_worth_drafting_and_deeper_follow_the_batch():
    top = PROBS[:4]
    assert model(1).worth_drafting(top[None]) and not model(256).worth_drafting(top.expand(256, -1))
    assert model(1).worth_deeper(0.6, 4) and not model(256).worth_deeper(0.6 * 256 * 0.1, 4)


def test_plain_rate_counts_every_row():
    cost = model(8)
    assert abs(cost.plain_rate() - 8 / (1.0 + 0.02 * 8)) < 1e-12
