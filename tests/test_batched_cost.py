"""The cost model over a batch (`CycleCostModel.rows`): the same draft confidence buys smaller trees as the batch
grows, and none at all once a plain batched step is faster per token; one row decides as one prompt does."""

import pytest
import torch

from eagle3_hf.generation.cost_model import PLAIN_REFRESH, CycleCostModel, LinearCost

# per-row node path probabilities, best first: a confident chain, then weaker siblings
PROBS = torch.tensor([0.8, 0.6, 0.45, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03, 0.02])


def model(rows, a=1.0, b=0.02):
    return CycleCostModel(
        verify=LinearCost(prior_a=a, prior_b=b), draft_step=LinearCost(prior_a=0.05, prior_b=0.0), rows=rows
    )


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


def test_one_row_decides_as_one_prompt_with_the_batch_1_formulas():
    """With one row the batch formulas are the batch-1 ones: a plain step's rate 1 / verify(1), a tree of the m best
    candidates worth (1 + c * sum p) / verify(m + 1), a level worth its best node against a draft step and one more
    verified token -- whether the probabilities come as one prompt's `[N]` or a batch's `[1, N]`."""
    cost = model(1)
    a, b = 1.0, 0.02
    assert abs(cost.plain_rate() - 1 / (a + b)) < 1e-12
    for draft_seconds in (0.0, 0.1, 1.0):
        n, predicted = cost.choose_size(PROBS, draft_seconds)
        rates = [(1 + float(PROBS[:m].double().sum())) / (draft_seconds + a + b * (m + 1)) for m in range(13)]
        assert n == max(range(13), key=lambda m: rates[m]) and abs(predicted - float(PROBS[:n].double().sum())) < 1e-9
        assert (n, predicted) == cost.choose_size(PROBS[None], draft_seconds)
    for top in (PROBS[:4], torch.tensor([0.01, 0.01])):
        best = max((1 + float(top[:m].double().sum())) / (a + b * (m + 1)) for m in range(1, top.numel() + 1))
        assert cost.worth_drafting(top) == (best > 1 / (a + b)) == cost.worth_drafting(top[None])
    for p in (0.01, 0.6):
        assert cost.worth_deeper(p, 4) == (p * (a + b) > 0.05 + b)


def test_a_measured_plain_step_replaces_the_line_for_a_batch():
    """A line fit at tree widths overrates a batch's plain step (one wide forward): once a plain step is measured, a
    tree is weighed against what it really costs, and one that beat the line's plain step no longer does."""
    cost = model(4)
    for width in (3, 4, 5):  # tree cycles on the line 1 + 0.02 x
        cost.observe(4, width, 1.0 + 0.02 * 4 * width)
    probs = torch.tensor([0.1, 0.02]).expand(4, -1)
    assert cost.plain_step() == pytest.approx(1.0 + 0.02 * 4) and cost.choose_size(probs, 0.0)[0] == 1
    cost.observe(4, 1, 0.9)  # a measured plain step of the 4 rows: cheaper than the line says
    assert cost.plain_step() == pytest.approx(0.9) and cost.plain_rate() == pytest.approx(4 / 0.9)
    assert cost.choose_size(probs, 0.0)[0] == 0
    assert cost.verify(12) == pytest.approx(cost.verify.coefficients()[0] + cost.verify.coefficients()[1] * 12)


def test_a_batch_measures_a_plain_step_first_and_again_every_refresh():
    cost = model(4)
    assert cost.plain_due()  # nothing measured yet: the first cycle is a plain step
    cost.observe(4, 1, 0.9)
    assert not cost.plain_due()
    for _ in range(PLAIN_REFRESH - 1):
        cost.observe(4, 3, 1.2)
    assert not cost.plain_due()
    cost.observe(4, 3, 1.2)
    assert cost.plain_due()  # the context has grown since: measure again
    one = model(1)
    assert not one.plain_due()  # one row: its nodes cost little next to its plain step, it never skips here
    one.observe(1, 1, 0.5)
    assert one.plain_step() == one.verify(1)  # and its plain step is the line's, as it always was


def test_a_batch_whose_trees_lose_takes_plain_steps_until_they_pay():
    cost = model(4)
    cost.observe(4, 1, 0.9)
    pattern = []
    for _ in range(8):
        plain = cost.plain_due()
        pattern.append(int(plain))
        if not plain:
            cost.after_tree_cycle(-0.5)  # a tree cycle that produced half a token less than plain steps would have
    assert pattern == [0, 1, 0, 1, 1, 0, 1, 1]
    cost.after_tree_cycle(3.0)  # one that paid outweighs the recent losses: trees again
    assert not cost.plain_due()
