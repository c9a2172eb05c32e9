"""TTT attention by chunks (`eagle3_hf.training.ttt_attention`) equals the dense joint softmax it replaced: outputs and
gradients of the attention alone, and the whole TTT loss and gradients, in fp32 (1e-5) and under bf16 autocast."""

import pytest
import torch
from helpers.fast_step import make_batch, make_pair

from eagle3_hf.training import ttt_attention as attention_module
from eagle3_hf.training import ttt_layer
from eagle3_hf.training.ttt import ttt_forward, ttt_loss
from eagle3_hf.training.ttt_attention import attention_segments, ttt_attention
from eagle3_hf.training.ttt_layer import repeat_kv

torch.set_num_threads(1)


def dense_reference(q, keys, values, query_index, segments, scaling, softcap=None):
    """The attention as it was written before: one ``[B, h, Sq, S + j]`` score tensor (the causal block plus ``j``
    diagonal columns) under one softmax, with an additive mask, in the inputs' dtype."""
    groups = q.shape[1] // keys[0].shape[1]
    keys = [repeat_kv(k, groups) for k in keys]
    values = [repeat_kv(v, groups) for v in values]
    seq = keys[0].shape[-2]
    allowed = (torch.arange(seq)[None, None] <= query_index[..., None]) & (
        segments[:, None, :] == segments.gather(1, query_index)[..., None]
    )  # [B, Sq, S]
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)[:, None]
    scores = torch.matmul(q, keys[0].transpose(-1, -2))
    if len(keys) > 1:
        scores = torch.cat([scores, torch.stack([(q * k).sum(-1) for k in keys[1:]], dim=-1)], dim=-1)
    scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = torch.nn.functional.pad(mask, (0, len(keys) - 1))
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(values[0].dtype)
    out = torch.matmul(probs[..., :seq], values[0])
    for i, v in enumerate(values[1:]):
        out = out + probs[..., seq + i, None] * v
    return out


def attention_case(steps, dtype, deep=False, packed=False):
    torch.manual_seed(steps)
    batch, heads, kv, seq, dim = 2, 6, 2, 23, 8
    segments = attention_segments(torch.tensor([[1] * seq, [1] * 17 + [0] * 6]), None, batch, seq, torch.device("cpu"))
    if packed:
        positions = torch.cat([torch.arange(9), torch.arange(14)])[None].expand(batch, seq)
        segments = attention_segments(None, positions, batch, seq, torch.device("cpu"))
    query_index = torch.arange(seq)[None].expand(batch, seq)
    if deep:  # queries at a subset of the positions, a different one per row (the function allows it)
        query_index = torch.stack([torch.tensor([0, 3, 4, 10, 20]), torch.tensor([1, 2, 5, 6, 16])])
    count = query_index.shape[1]
    q = torch.randn(batch, heads, count, dim, dtype=dtype, requires_grad=True)
    keys = [torch.randn(batch, kv, seq, dim, dtype=dtype, requires_grad=True)]
    keys += [torch.randn(batch, kv, count, dim, dtype=dtype, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(k.shape, dtype=dtype, requires_grad=True) for k in keys]
    return q, keys, values, query_index, segments


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "steps, deep, packed, softcap",
    [
        (0, False, False, None),
        (3, False, False, None),
        (2, True, False, None),
        (3, False, True, None),
        (2, False, False, 5.0),
    ],
    ids=["step0", "step3", "deep-rows", "packed", "softcap"],
)
def test_chunked_attention_equals_the_dense_softmax(monkeypatch, dtype, tol, steps, deep, packed, softcap):
    monkeypatch.setattr(attention_module, "_CPU_BLOCK_BYTES", 4 * 2 * 6 * 23 * 5)  # chunks of 5 queries
    q, keys, values, query_index, segments = attention_case(steps, dtype, deep, packed)
    results = []
    for run in (ttt_attention, dense_reference):
        out = run(q, keys, values, query_index, segments, 0.35, softcap)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        grads = torch.autograd.grad((out.float() * weights.float()).sum(), [q, *keys, *values])
        results.append((out, grads))
    (out, grads), (ref_out, ref_grads) = results
    # fp32 and the reference's own bf16 rounding: tolerance relative to the tensors' scale
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    for grad, ref in zip(grads, ref_grads):
        scale = max(float(ref.float().abs().max()), 1.0)
        torch.testing.assert_close(grad.float() / scale, ref.float() / scale, atol=tol, rtol=tol)


def test_queries_see_only_their_conversation_and_no_padding():
    q, keys, values, query_index, segments = attention_case(0, torch.float32, packed=True)
    out = ttt_attention(q, keys, values, query_index, segments, 0.35)
    # Changing the second conversation's keys and values changes nothing in the first one's outputs, and vice versa.
    moved_keys, moved_values = keys[0].detach().clone(), values[0].detach().clone()
    moved_keys[:, :, 9:] += 1.0
    moved_values[:, :, 9:] -= 2.0
    moved = ttt_attention(q, [moved_keys], [moved_values], query_index, segments, 0.35)
    assert torch.equal(moved[:, :, :9], out[:, :, :9]) and not torch.allclose(moved[:, :, 9:], out[:, :, 9:])
    padded = attention_segments(torch.tensor([[1, 1, 0]]), None, 1, 3, torch.device("cpu"))
    assert padded.tolist() == [[1, 1, 0]]


def test_attention_refuses_mismatched_inputs():
    q, keys, values, query_index, segments = attention_case(1, torch.float32)
    with pytest.raises(ValueError, match="as many keys as values"):
        ttt_attention(q, keys, values[:1], query_index, segments, 0.35)
    with pytest.raises(ValueError, match="query heads"):
        ttt_attention(q[:, :5], keys, values, query_index, segments, 0.35)


def test_ttt_loss_and_gradients_equal_the_dense_attention(monkeypatch):
    """The whole TTT step (3 steps, 2 layers, padding, the head on the supervised rows) with the chunked attention
    and with the dense softmax it replaced: in fp32 the same loss and gradients of every draft weight (1e-5); under
    bf16 autocast both are as close to the fp32 result as each other (the rounding differs, not the function)."""
    target, draft = make_pair(num_hidden_layers=2)
    ids, attention_mask, loss_mask, features, logits = make_batch(target, draft)  # padded rows, some prompts
    monkeypatch.setattr(attention_module, "_CPU_BLOCK_BYTES", 4 * 2 * 4 * 12 * 4)  # chunks of 4 queries

    def run(autocast):
        draft.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            states = ttt_forward(draft, ids, features, attention_mask, ttt_length=3, return_hidden=True)
        result = ttt_loss(states, logits, loss_mask, draft.t2d, head=draft.lm_head)
        result.loss.backward()
        return result.loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}

    (loss, grads), (loss_bf16, grads_bf16) = run(False), run(True)
    monkeypatch.setattr(ttt_layer, "ttt_attention", dense_reference)
    (ref_loss, ref_grads), (ref_loss_bf16, ref_grads_bf16) = run(False), run(True)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys() and "upper_layers.0.self_attn.k_proj.weight" in grads
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, atol=1e-5, rtol=1e-5, msg=name)
    for bf16 in (loss_bf16, ref_loss_bf16):  # bf16 keeps 8 bits: 4e-3 relative is half its rounding step
        torch.testing.assert_close(bf16, ref_loss, rtol=4e-3, atol=0)
    for name, ref in ref_grads.items():
        scale = float(ref.abs().max())
        error, ref_error = [float((g[name] - ref).abs().max()) / scale for g in (grads_bf16, ref_grads_bf16)]
        assert error <= 2 * ref_error + 1e-3 and error < 0.1, (name, error, ref_error)
