"""The fast training step (head and loss fused over every TTT step's supervised rows) computes the reference step's
loss, metrics and gradients: in fp32 to a tight tolerance, under bf16 autocast to bf16's."""

import functools

import pytest
import torch
from helpers.fast_step import METRICS, V, make_batch, make_pair

from eagle3_hf.training import head_loss
from eagle3_hf.training.head_loss import default_chunk_rows, fused_head_applies, head_cross_entropy
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.ttt import target_top_k, ttt_forward, ttt_loss

torch.set_num_threads(1)


def run_step(draft, batch, fused: bool, k: int | None, autocast: bool, chunk_rows: int = 256):
    """One micro-batch's loss and backward; returns the `TTTOutput` and every trainable parameter's gradient."""
    ids, attention, loss_mask, features, logits = batch
    target_logits, target_ids = (logits, None) if k is None else target_top_k(logits, k)
    draft.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        states = ttt_forward(draft, ids, features, attention, ttt_length=4, return_hidden=True)
    dtype = torch.bfloat16 if autocast else None

    def head(rows):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return draft.lm_head(rows)

    def fused_head(rows, p, columns):
        return head_cross_entropy(rows, draft.lm_head.weight, p, columns, dtype, chunk_rows=chunk_rows)

    heads = {"fused_head": fused_head} if fused else {"head": head}
    out = ttt_loss(states, target_logits, loss_mask, draft.t2d, 0.8, target_ids=target_ids, **heads)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    return out, grads


@pytest.mark.parametrize("num_hidden_layers", [1, 2])
@pytest.mark.parametrize("k", [None, 5])
def test_fused_step_equals_the_reference_step_in_fp32(num_hidden_layers, k):
    target, draft = make_pair(num_hidden_layers)
    batch = make_batch(target, draft)
    ref, ref_grads = run_step(draft, batch, fused=False, k=k, autocast=False)
    for chunk_rows in (256, 3):  # one chunk, and chunks that split the rows unevenly
        fast, fast_grads = run_step(draft, batch, fused=True, k=k, autocast=False, chunk_rows=chunk_rows)
        torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast.step_losses, ref.step_losses, rtol=1e-5, atol=1e-6)
        for name in METRICS:
            assert torch.equal(getattr(fast, name), getattr(ref, name)), name
        assert fast_grads.keys() == ref_grads.keys()
        for name, grad in ref_grads.items():
            assert grad.abs().sum() > 0, name  # every trainable weight takes part
            torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (ref.step_in_vocab < ref.step_supervised).any() and ref.step_in_vocab.sum() > 0


def test_fused_step_equals_the_reference_step_under_bf16_autocast():
    target, draft = make_pair()
    batch = make_batch(target, draft)
    ref, ref_grads = run_step(draft, batch, fused=False, k=5, autocast=True)
    fast, fast_grads = run_step(draft, batch, fused=True, k=5, autocast=True)
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(fast.step_losses, ref.step_losses, rtol=1e-2, atol=1e-3)
    for name in ("step_supervised", "step_in_vocab"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    for name, grad in ref_grads.items():
        # bf16 rounds each value to 8 bits: compare each gradient as a whole, relative to its size.
        error = (fast_grads[name].float() - grad.float()).norm() / grad.float().norm()
        assert error < 2e-2, (name, float(error))


def test_trainer_uses_the_fused_step_and_matches_the_reference(tmp_path):
    target, draft = make_pair()
    ids, attention, loss_mask, _, _ = make_batch(target, draft)
    args = Eagle3TrainingArguments(str(tmp_path), ttt_length=4, report_to=[], use_cpu=True, logits_top_k=5)
    trainer = Eagle3Trainer(draft, args, target=target)
    assert fused_head_applies(draft.lm_head)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    draft.zero_grad(set_to_none=True)
    loss, out = trainer.compute_loss(draft, batch, return_outputs=True)
    loss.backward()
    trainer_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    features = draft.target_features(target(ids, attention_mask=attention, output_hidden_states=True).hidden_states)
    logits = target(ids, attention_mask=attention).logits
    ref, ref_grads = run_step(draft, (ids, attention, loss_mask, features, logits), fused=False, k=5, autocast=False)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(trainer_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("sparse", [False, True])
def test_head_cross_entropy_is_the_soft_cross_entropy_of_the_head(sparse, recompute, monkeypatch):
    """Row losses, argmax and gradients equal log-softmax written out, with repeated label columns adding up; the
    same when the backward recomputes the gradient of the logits (in blocks of 2 chunks of 2 rows) instead of
    keeping it."""
    if recompute:
        monkeypatch.setattr(head_loss, "KEEP_GRADIENT_BYTES", 0)
        monkeypatch.setattr(head_loss, "_BACKWARD_BLOCK_BYTES", 2 * 2 * 10 * 8)
    torch.manual_seed(2)
    rows = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.rand(7, dtype=torch.float64)
    columns = torch.randint(0, 10, (7, 4)) if sparse else None
    p = torch.softmax(torch.randn(7, 4 if sparse else 10, dtype=torch.float64), -1)
    loss, argmax = head_cross_entropy(rows, weight, p, columns, chunk_rows=2)
    (loss * upstream).sum().backward()
    fast_grads = rows.grad.clone(), weight.grad.clone()
    rows.grad = weight.grad = None
    log_q = torch.log_softmax(rows @ weight.T, -1)
    expected = -(p * (log_q if columns is None else log_q.gather(1, columns))).sum(-1)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(loss, expected.detach())
    assert torch.equal(argmax, log_q.argmax(-1))
    torch.testing.assert_close(fast_grads[0], rows.grad)
    torch.testing.assert_close(fast_grads[1], weight.grad)


@pytest.mark.parametrize("loss_name", ["forward_kl", "tv", "lk"])
def test_recomputing_the_gradient_of_the_logits_changes_nothing_in_bf16(loss_name, monkeypatch):
    """Above `KEEP_GRADIENT_BYTES` the backward recomputes each forward chunk's gradient of the logits: the same
    values, so the gradients equal the kept path's (up to the blocks' matmul summation order)."""
    torch.manual_seed(3)
    rows, weight = torch.randn(37, 16, requires_grad=True), torch.randn(256, 16, requires_grad=True)
    columns = torch.randint(0, 256, (37, 5))
    p = torch.softmax(torch.randn(37, 5), -1)
    upstream = torch.rand(37)
    results = []
    for keep in (2**30, 0):
        monkeypatch.setattr(head_loss, "KEEP_GRADIENT_BYTES", keep)
        monkeypatch.setattr(head_loss, "_BACKWARD_BLOCK_BYTES", 256 * 2 * 8 * 2)  # blocks of 2 chunks of 8 rows
        loss, argmax = head_cross_entropy(rows, weight, p, columns, torch.bfloat16, chunk_rows=8, loss=loss_name)
        grads = torch.autograd.grad((loss * upstream).sum(), [rows, weight])
        results.append((loss, argmax, grads))
    (loss, argmax, grads), (recomputed, recomputed_argmax, recomputed_grads) = results
    assert torch.equal(loss, recomputed) and torch.equal(argmax, recomputed_argmax)
    assert torch.equal(grads[0], recomputed_grads[0])  # each row's gradient is its own block's matmul
    torch.testing.assert_close(recomputed_grads[1], grads[1], rtol=1e-2, atol=1e-3)


def test_default_chunk_rows_keep_cpu_blocks_small_and_accelerator_launches_few():
    assert default_chunk_rows(torch.device("cpu")) == 256
    assert default_chunk_rows(torch.device("cuda", 0)) == default_chunk_rows(torch.device("xpu")) == 4096
    rows, weight = torch.randn(300, 8), torch.randn(10, 8)
    p = torch.softmax(torch.randn(300, 10), -1)
    loss, argmax = head_cross_entropy(rows, weight, p)  # the default on a CPU: two chunks, 256 rows and 44
    reference, reference_argmax = head_cross_entropy(rows, weight, p, chunk_rows=300)
    torch.testing.assert_close(loss, reference)
    assert torch.equal(argmax, reference_argmax)


def test_head_cross_entropy_rejects_bad_shapes():
    rows, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="rows"):
        head_cross_entropy(rows, torch.randn(10, 7), torch.ones(4, 10) / 10)
    with pytest.raises(ValueError, match="p has shape"):
        head_cross_entropy(rows, weight, torch.ones(4, 3) / 3)
    with pytest.raises(ValueError, match="chunk_rows"):
        head_cross_entropy(rows, weight, torch.ones(4, 10) / 10, chunk_rows=0)
    with pytest.raises(ValueError, match="head or a fused_head"):
        ttt_loss(
            [rows[None]],
            torch.randn(1, 4, V),
            torch.ones(1, 4),
            torch.ones(V, dtype=torch.bool),
            head=functools.partial(torch.matmul),
            fused_head=lambda *a: a,
        )


def test_the_blocked_row_maximum_is_torch_max():
    from eagle3_hf.training.head_loss import _row_max

    torch.manual_seed(3)
    z = torch.randn(5, 384).round(decimals=1)  # many equal values: the first index must win, as in torch.max
    z[2, 300] = z[2, 10] = 9.0
    for block in (z, z[:, :100]):  # 128-wide blocks, and the plain fallback
        top, index = _row_max(block)
        expected = block.max(-1)
        assert torch.equal(top, expected.values) and torch.equal(index, expected.indices)
    assert int(_row_max(z)[1][2]) == 10


@pytest.mark.parametrize("keep", [2**30, 0], ids=["kept", "recomputed"])
def test_head_cross_entropy_without_rows_gives_zero_gradients(keep, monkeypatch):
    """A batch where no position carries loss (all prompts, or all out of the vocabulary) still runs its backward."""
    monkeypatch.setattr(head_loss, "KEEP_GRADIENT_BYTES", keep)
    rows, weight = torch.zeros(0, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    loss, _ = head_cross_entropy(rows, weight, torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.long))
    loss.sum().backward()
    assert rows.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros_like(weight))
