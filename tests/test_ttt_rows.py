"""Sampled deep TTT steps (`eagle3_hf.training.ttt_rows`): the deep steps at the sampled positions are the full
unroll's, taking every candidate position gives the full unroll's loss and gradients, and the trainer samples only
in training."""

import math

import pytest
import torch

from eagle3_hf.training.head_loss import head_cross_entropy
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.ttt import target_top_k, ttt_forward, ttt_loss
from eagle3_hf.training.ttt_rows import DeepRows, deep_candidates, sample_deep_rows
from tests.test_train_fast_step import make_batch, make_pair

torch.set_num_threads(1)

TTT = 4


def test_candidates_are_the_positions_some_deep_step_supervises():
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]])
    # step j >= 1 at position t predicts the token at t+2+j: t+3..t+5 for K=4, so t in 5-5..6-3 = 0..3
    assert deep_candidates(mask, 4)[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3]
    assert deep_candidates(mask, 2)[0].nonzero()[:, 0].tolist() == [2, 3]
    assert not deep_candidates(mask, 1).any()


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 1.0])
def test_each_row_samples_its_share_of_distinct_candidates(fraction):
    torch.manual_seed(0)
    mask = torch.zeros(3, 40)
    mask[0, 5:40] = 1
    mask[1, 10:20] = 1
    mask[2, 30:32] = 1
    rows = sample_deep_rows(mask, TTT, fraction)
    candidates = deep_candidates(mask, TTT)
    for b in range(3):
        taken = rows.positions[b][rows.valid[b]]
        assert len(taken) == math.ceil(fraction * int(candidates[b].sum()))
        assert candidates[b, taken].all()
        assert taken.unique().numel() == len(taken)
        assert torch.equal(taken, taken.sort().values)
    assert rows.positions.shape == rows.valid.shape == (3, int(rows.valid.sum(1).max()))


def test_sampling_is_uniform_over_the_candidates():
    generator = torch.Generator().manual_seed(3)
    mask = torch.zeros(1, 30)
    mask[0, 6:26] = 1
    candidates = deep_candidates(mask, TTT)[0]
    hits = torch.zeros(30)
    draws = 3000
    for _ in range(draws):
        rows = sample_deep_rows(mask, TTT, 0.25, generator)
        hits[rows.positions[rows.valid]] += 1
    share = hits[candidates] / draws  # 6 of 23 candidates per draw
    assert (share - 6 / 23).abs().max() < 0.04, share
    assert hits[~candidates].sum() == 0


def test_rows_without_candidates_keep_one_unsupervised_column():
    rows = sample_deep_rows(torch.zeros(2, 8), TTT, 0.5)
    assert rows.positions.shape == (2, 1) and not rows.valid.any()


@pytest.mark.parametrize("fraction", [0, -0.5, 1.5, float("nan"), True, "half"])
def test_bad_fractions_are_refused(fraction):
    with pytest.raises(ValueError, match="share of positions"):
        sample_deep_rows(torch.ones(1, 8), TTT, fraction)
    with pytest.raises(ValueError, match="ttt_deep_fraction"):
        Eagle3TrainingArguments("unused", ttt_deep_fraction=fraction, report_to=[], use_cpu=True)


def test_one_ttt_step_has_no_deep_steps_to_sample():
    with pytest.raises(ValueError, match="ttt_length >= 2"):
        sample_deep_rows(torch.ones(1, 8), 1, 0.5)


@pytest.mark.parametrize("num_hidden_layers", [1, 2])
def test_deep_steps_at_sampled_positions_are_the_full_unroll(num_hidden_layers):
    target, draft = make_pair(num_hidden_layers)
    ids, attention, loss_mask, features, _ = make_batch(target, draft)
    draft.eval()
    with torch.no_grad():
        full = ttt_forward(draft, ids, features, attention, ttt_length=TTT, return_hidden=True)
        rows = sample_deep_rows(loss_mask, TTT, 0.5, torch.Generator().manual_seed(0))
        sampled = ttt_forward(draft, ids, features, attention, ttt_length=TTT, return_hidden=True, deep_rows=rows)
    torch.testing.assert_close(sampled[0], full[0], rtol=0, atol=0)
    for step in range(1, TTT):
        assert sampled[step].shape[:2] == rows.positions.shape
        for b in range(2):
            taken = rows.positions[b][rows.valid[b]]
            torch.testing.assert_close(sampled[step][b][rows.valid[b]], full[step][b, taken], rtol=1e-5, atol=1e-6)


def _step(draft, batch, deep_rows, fused):
    ids, attention, loss_mask, features, logits = batch
    target_logits, target_ids = target_top_k(logits, 5)
    draft.zero_grad(set_to_none=True)
    states = ttt_forward(draft, ids, features, attention, ttt_length=TTT, return_hidden=True, deep_rows=deep_rows)
    if fused:
        heads = {"fused_head": lambda rows, p, columns: head_cross_entropy(rows, draft.lm_head.weight, p, columns)}
    else:
        heads = {"head": draft.lm_head}
    out = ttt_loss(states, target_logits, loss_mask, draft.t2d, 0.8, target_ids=target_ids, deep_rows=deep_rows,
                   **heads)  # fmt: skip
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("fused", [False, True])
def test_sampling_every_candidate_is_the_full_unroll(fused):
    target, draft = make_pair()
    batch = make_batch(target, draft)
    ref, ref_grads = _step(draft, batch, None, fused)
    rows = sample_deep_rows(batch[2], TTT, 1.0)
    out, grads = _step(draft, batch, rows, fused)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-6)
    for name in ("step_correct", "step_supervised", "step_in_vocab"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    for name, grad in ref_grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_sample_scores_deep_steps_on_its_positions_only():
    target, draft = make_pair()
    batch = make_batch(target, draft)
    ids, attention, loss_mask, features, logits = batch
    rows = sample_deep_rows(loss_mask, TTT, 0.3, torch.Generator().manual_seed(1))
    out, _ = _step(draft, batch, rows, fused=True)
    ref, _ = _step(draft, batch, None, fused=True)
    assert out.step_supervised[0] == ref.step_supervised[0]  # step 0 still runs everywhere
    for step in range(1, TTT):
        expected = 0
        for b in range(2):
            predicted = rows.positions[b][rows.valid[b]] + 2 + step
            inside = predicted < loss_mask.shape[1]
            expected += int(loss_mask[b, predicted[inside]].sum())
        assert int(out.step_supervised[step]) == expected
        assert 0 < expected < int(ref.step_supervised[step])


def test_a_hand_built_sample_matches_the_full_loss_of_its_positions():
    """One position per row: each deep step's loss is the mean over the positions it supervises."""
    target, draft = make_pair()
    ids, attention, loss_mask, features, logits = make_batch(target, draft)
    rows = DeepRows(positions=torch.tensor([[4], [3]]), valid=torch.tensor([[True], [True]]))
    target_logits, target_ids = target_top_k(logits, 5)
    with torch.no_grad():
        states = ttt_forward(draft, ids, features, attention, ttt_length=TTT, return_hidden=True, deep_rows=rows)
        out = ttt_loss(states, target_logits, loss_mask, draft.t2d, 0.8, target_ids=target_ids, head=draft.lm_head,
                       deep_rows=rows)  # fmt: skip
        full = ttt_forward(draft, ids, features, attention, ttt_length=TTT, return_hidden=True)
    t2d_ids = torch.nonzero(draft.t2d)[:, 0]
    for step in range(1, TTT):
        losses, supervised = [], 0
        for b, t in ((0, 4), (1, 3)):
            if t + 2 + step >= ids.shape[1] or not loss_mask[b, t + 2 + step]:
                continue
            supervised += 1
            top = int(target_ids[b, t + 1 + step, 0])
            if not draft.t2d[top]:
                continue
            log_q = torch.log_softmax(draft.lm_head(full[step][b, t]).float(), -1)  # [Vd]
            member = draft.t2d[target_ids[b, t + 1 + step].long()]
            p = torch.softmax(torch.where(member, target_logits[b, t + 1 + step].float(), float("-inf")), -1)
            columns = torch.searchsorted(t2d_ids, target_ids[b, t + 1 + step].long().clamp(max=t2d_ids[-1]))
            losses.append(-(p[member] * log_q[columns[member]]).sum())
        assert int(out.step_supervised[step]) == supervised
        expected = torch.stack(losses).mean() if losses else torch.tensor(0.0)
        torch.testing.assert_close(out.step_losses[step], expected, rtol=1e-5, atol=1e-6)


def test_the_trainer_samples_in_training_and_unrolls_everything_in_evaluation(tmp_path):
    target, draft = make_pair()
    ids, attention, loss_mask, _, _ = make_batch(target, draft)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    full_args = Eagle3TrainingArguments(str(tmp_path), ttt_length=TTT, report_to=[], use_cpu=True, logits_top_k=5)
    _, ref = Eagle3Trainer(draft, full_args, target=target).compute_loss(draft, batch, return_outputs=True)
    args = Eagle3TrainingArguments(str(tmp_path), ttt_length=TTT, report_to=[], use_cpu=True, logits_top_k=5,
                                   ttt_deep_fraction=0.3)  # fmt: skip
    trainer = Eagle3Trainer(draft, args, target=target)
    torch.manual_seed(5)
    _, sampled = trainer.compute_loss(draft.train(), batch, return_outputs=True)
    assert sampled.step_supervised[0] == ref.step_supervised[0]
    assert (sampled.step_supervised[1:] < ref.step_supervised[1:]).all()
    with torch.no_grad():
        _, evaluated = trainer.compute_loss(draft.eval(), batch, return_outputs=True)
    assert torch.equal(evaluated.step_supervised, ref.step_supervised)


def test_mismatched_deep_rows_are_refused():
    target, draft = make_pair()
    ids, attention, loss_mask, features, logits = make_batch(target, draft)
    rows = sample_deep_rows(loss_mask, TTT, 0.5)
    one_row = DeepRows(rows.positions[:1], rows.valid[:1])
    with pytest.raises(ValueError, match=r"must both be \[batch=2"):
        ttt_forward(draft, ids, features, attention, ttt_length=TTT, deep_rows=one_row)
    past_the_end = DeepRows(rows.positions + 12, rows.valid)
    with pytest.raises(ValueError, match=r"must lie in \[0, 12\)"):
        ttt_forward(draft, ids, features, attention, ttt_length=TTT, deep_rows=past_the_end)
    full = ttt_forward(draft, ids, features, attention, ttt_length=TTT, return_hidden=True)
    with pytest.raises(ValueError, match="pass ttt_forward the same deep_rows"):
        ttt_loss(full, *target_top_k(logits, 5)[:1], loss_mask, draft.t2d, head=draft.lm_head, deep_rows=rows,
                 target_ids=target_top_k(logits, 5)[1])  # fmt: skip
