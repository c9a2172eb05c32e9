"""Sequence packing (`eagle3_hf.training.collator`, ``--packing``): the packed batch's target features, TTT loss, counts
and gradients equal the padded batch's of the same conversations (fp32), in the functions and through the trainer."""

import contextlib

import pytest
import torch
from helpers.fast_step import V, make_pair
from helpers.trainer import make_args, new_draft

from eagle3_hf.training.collator import Eagle3DataCollator, pack_rows
from eagle3_hf.training.features import online_features
from eagle3_hf.training.head_loss import ttt_head_kwargs
from eagle3_hf.training.trainer import Eagle3Trainer
from eagle3_hf.training.ttt import ttt_forward, ttt_loss
from eagle3_hf.utils import tiny

torch.set_num_threads(1)


def conversations():
    """Five conversations of 4-11 tokens, each supervised on a tail (the first one from its third token)."""
    generator = torch.Generator().manual_seed(3)
    rows = []
    for length, start in ((9, 2), (4, 2), (11, 5), (6, 3), (7, 1)):
        ids = torch.randint(1, V, (length,), generator=generator)
        rows.append({"input_ids": ids.tolist(), "loss_mask": [0] * start + [1] * (length - start), "id": str(length)})
    return rows


def test_pack_rows_is_first_fit_in_order():
    assert pack_rows([9, 4, 11, 6, 7], 16) == [[0, 1], [2], [3, 4]]
    assert pack_rows([9, 4, 3], None) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="12 tokens cannot be packed into rows of 8"):
        pack_rows([12], 8)


def test_collator_packs_conversations_with_restarting_positions():
    rows = conversations()
    for row in rows:  # offline features travel with their tokens
        n = len(row["input_ids"])
        row["target_hidden_states"] = torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3)
    batch = Eagle3DataCollator(pad_token_id=0, max_length=16, packing=True)(rows)
    assert batch["input_ids"].shape == (3, 13)  # rows of 9+4, 11 (+2 padding) and 6+7 tokens
    assert batch["input_ids"][0].tolist() == rows[0]["input_ids"] + rows[1]["input_ids"]
    assert batch["position_ids"].tolist() == [[*range(9), *range(4)], [*range(11), *range(2)], [*range(6), *range(7)]]
    assert batch["attention_mask"].sum(1).tolist() == [13, 11, 13] and batch["attention_mask"][1, 11:].sum() == 0
    assert batch["loss_mask"][0].tolist() == rows[0]["loss_mask"] + rows[1]["loss_mask"]
    assert batch["target_hidden_states"][0, :, 0].tolist() == [*range(9), *range(4)]
    assert (batch["target_hidden_states"][1, 11:] == 0).all() and (batch["input_ids"][1, 11:] == 0).all()
    assert "position_ids" not in Eagle3DataCollator(max_length=16)(rows)


def losses_and_grads(draft, target, batch, ttt_length=3):
    draft.zero_grad(set_to_none=True)
    position_ids = batch.get("position_ids")
    features, top_logits, top_ids = online_features(
        target, draft, batch["input_ids"], batch["attention_mask"], top_k=V, position_ids=position_ids
    )
    states = ttt_forward(
        draft,
        batch["input_ids"],
        features,
        batch["attention_mask"],
        ttt_length,
        return_hidden=True,
        position_ids=position_ids,
    )
    heads = ttt_head_kwargs(draft.lm_head, contextlib.nullcontext, None)  # the fused head and loss, fp32
    out = ttt_loss(
        states, top_logits, batch["loss_mask"], draft.t2d, target_ids=top_ids, position_ids=position_ids, **heads
    )
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}, features


def test_packed_loss_and_gradients_equal_the_padded_batch():
    target, draft = make_pair(num_hidden_layers=2)
    rows = conversations()
    padded = Eagle3DataCollator(max_length=16)(rows)
    packed = Eagle3DataCollator(max_length=16, packing=True)(rows)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    out, grads, features = losses_and_grads(draft, target, padded)
    packed_out, packed_grads, packed_features = losses_and_grads(draft, target, packed)
    # The target's features of each conversation are its own, packed or not.
    torch.testing.assert_close(packed_features[0, 9:13], features[1, :4], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_features[2, 6:13], features[4, :7], atol=1e-5, rtol=1e-5)
    for name in ("step_supervised", "step_in_vocab", "step_correct"):
        assert torch.equal(getattr(packed_out, name), getattr(out, name)), name
    assert out.step_supervised.tolist()[0] == sum(sum(r["loss_mask"][2:]) for r in rows)
    torch.testing.assert_close(packed_out.step_losses, out.step_losses, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_out.loss, out.loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == packed_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def test_without_the_conversation_boundary_the_packed_loss_differs():
    """The position_ids are what keeps packed conversations apart: without them the rows are one long sequence."""
    target, draft = make_pair()
    packed = Eagle3DataCollator(max_length=16, packing=True)(conversations())
    with_boundaries, _, _ = losses_and_grads(draft, target, packed)
    packed.pop("position_ids")
    without, _, _ = losses_and_grads(draft, target, packed)
    assert without.step_supervised[0] > with_boundaries.step_supervised[0]
    assert not torch.allclose(without.loss, with_boundaries.loss)


def test_trainer_packs_with_the_option_and_computes_the_padded_loss(tmp_path):
    target, dataset = tiny.make_tiny_target(), tiny.synthetic_dataset()
    draft = new_draft(target)
    trainer = Eagle3Trainer(
        draft, make_args(tmp_path, packing=True, max_length=64, logits_top_k=96), target=target, train_dataset=dataset
    )
    assert trainer.data_collator.packing and trainer.data_collator.max_length == 64
    rows = list(dataset.select(range(4)))
    packed = trainer.data_collator(rows)
    assert packed["input_ids"].shape[0] < 4 and "position_ids" in packed
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, packed)
        padded_loss = trainer.compute_loss(trainer.model, Eagle3DataCollator(max_length=64)(rows))
    torch.testing.assert_close(loss, padded_loss, atol=1e-5, rtol=1e-5)
