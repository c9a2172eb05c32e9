"""The per-call scheduler: cost fits, tree sizing and backoff."""

import pytest
import torch

from eagle3_hf.generation.cost_model import Backoff, CycleCostModel, LinearCost


def test_linear_cost_recovers_an_exact_line():
    cost = LinearCost(prior_a=1.0, prior_b=0.0)
    for n in (1, 4, 16, 32):
        cost.observe(n, 0.05 + 0.002 * n)
    a, b = cost.coefficients()
    assert a == pytest.approx(0.05) and b == pytest.approx(0.002)
    assert cost(64) == pytest.approx(0.05 + 0.128)


def test_linear_cost_one_size_keeps_the_prior_ratio():
    cost = LinearCost(prior_a=1.0, prior_b=0.1)
    cost.observe(1, 0.22)
    cost.observe(1, 0.22)
    # level measured at n=1 (0.22), shape from the prior line 1 + 0.1 n: cost(11) / cost(1) = 2.1 / 1.1
    assert cost(1) == pytest.approx(0.22)
    assert cost(11) == pytest.approx(0.22 * 2.1 / 1.1)


def test_choose_size_skips_hopeless_and_takes_confident_nodes():
    cost = CycleCostModel()
    for n in (1, 16, 32):
        cost.verify.observe(n, 0.05 * (1 + (n - 1) / 30))
    assert cost.choose_size(torch.full((31,), 1e-4), draft_seconds=0.01)[0] == 0
    probs = torch.tensor([0.9, 0.8, 0.7, 0.6] + [1e-3] * 27)
    n, predicted = cost.choose_size(probs, draft_seconds=0.01)
    assert n == 4 and predicted == pytest.approx(3.0)


def test_calibration_discounts_an_overconfident_draft():
    cost = CycleCostModel()
    for _ in range(20):
        cost.record_cycle(predicted=3.0, accepted=0)
    assert cost.calibration < 0.05
    assert not cost.worth_drafting(0.99)


def test_worth_drafting_counts_every_depth_one_candidate_where_a_wide_verify_is_cheap():
    # No candidate is likely (5% at best), but the best eight together are (16%): worth verifying where 9 nodes cost
    # little more than one (bf16 on a CPU with bf16 units), not where every node adds a fifteenth of a token (fp32).
    probs = torch.tensor([0.2, 0.1, 0.08, 0.07, 0.05, 0.05, 0.04, 0.04]) / 4
    bf16, fp32 = CycleCostModel.for_device("cpu", torch.bfloat16), CycleCostModel.for_device("cpu", torch.float32)
    for cost in (bf16, fp32):
        for n in (1, 1, 9):
            cost.verify.observe(n, 0.04 * cost.verify.prior_a + 0.04 * cost.verify.prior_b * n)  # on its prior line
    assert bf16.worth_drafting(probs) and not fp32.worth_drafting(probs)
    assert not bf16.worth_drafting(torch.tensor([0.005]))  # even a cheap verify needs some chance of a gain


def test_backoff_doubles_while_consulting_loses_and_resets_when_it_pays():
    cost = CycleCostModel(consultations=Backoff(max_skip=4))
    pattern = []
    for _ in range(14):
        consulted = cost.consult_draft()
        pattern.append(int(consulted))
        if consulted:
            cost.after_consultation(-0.05)  # declined: a draft step lost
    # consult, skip 1, consult, skip 2, consult, skip 4, consult, skip 4 (capped), ...
    assert pattern == [1, 0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0]
    cost.after_consultation(1.2)  # a drafted cycle that won 1.2 tokens outweighs the recent declines
    assert cost.consult_draft()


def test_a_useful_draft_keeps_being_consulted_through_its_declines():
    # Half the consultations decline (a draft step lost), the other half draft and win 0.6 tokens: no backoff.
    cost = CycleCostModel()
    for i in range(40):
        assert cost.consult_draft()
        cost.after_consultation(-0.05 if i % 2 else 0.6)
    # An unlucky drafted cycle (nothing accepted) does not stop it either: the recent ones still pay together.
    cost.after_consultation(-1.3)
    assert cost.consult_draft()


def test_priors_fit_the_precision_the_tree_is_verified_in():
    # One measured one-token step (40 ms), the same draft: in bf16 on CPU a wide verify costs little more than one
    # token, in fp32 it grows with every node, so the same draft confidence buys a bigger tree in bf16.
    probs = torch.tensor([0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.1] + [0.05] * 8)
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):
        cost = CycleCostModel.for_device("cpu", dtype)
        cost.verify.observe(1, 0.04)
        sizes[dtype] = cost.choose_size(probs, draft_seconds=0.006)[0]
    assert sizes[torch.bfloat16] == 16 and 0 < sizes[torch.float32] < 8
    assert CycleCostModel.for_device("cpu", torch.bfloat16).draft_step(1) < CycleCostModel().draft_step(1)
    gpu = CycleCostModel.for_device("cuda", torch.float16)
    assert gpu.verify(32) < 1.2 * gpu.verify(1)  # a GPU verifies a few dozen tokens for about the price of one
