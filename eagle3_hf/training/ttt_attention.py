"""TTT attention without the score tensor: the joint softmax over the step-0 keys and the diagonal keys, by chunks.

At TTT step ``j`` query ``(t, j)`` attends to the step-0 keys at positions ``<= t`` of its own conversation and to the
keys of steps ``1..j`` at position ``t`` only, under one softmax (`eagle3_hf.training.ttt`). Written with tensor ops,
that is a ``[B, h, S, S + j]`` score tensor per layer and step, kept for the backward with its softmax: about 0.9 GiB
a step at 4k tokens for the shipped draft, 7 steps of them, most of a step's memory.

`ttt_attention` computes the same output as a log-space merge, chunk by chunk of queries, in an autograd function:

* forward: for a chunk of ``c`` queries, the scores against the step-0 keys up to the chunk's last position (the
  causal part only), masked, and the ``j`` diagonal scores ``q . k_i``; their joint logsumexp ``L`` ``[c]``; the
  output ``sum_k exp(s_k - L) v_k + sum_i exp(s_i - L) v_i``. Only ``L`` and the inputs are kept;
* backward: the flash-attention backward, recomputing each chunk's scores: ``P = exp(s - L)``,
  ``dS = P * (dO . v - D)`` with ``D = dO . out`` (the joint output, so every block's gradient is the joint
  softmax's), and the diagonal blocks the same way, one score per query.

The working blocks are ``[B, h, c, S]`` fp32 with ``c`` chosen to keep one near 32 MiB on a CPU (256 MiB on an
accelerator), so memory grows with the sequence, not its square. Which keys a query sees is given by indices, not a
mask tensor: ``query_index`` ``[B, Sq]`` (the position of each query; a subset of the positions may be given) and
``segments`` ``[B, S]`` (a conversation id per position: key ``k`` is visible to query ``t`` iff ``k <= t`` and both lie
in the same segment), which is how padding and packed conversations are kept apart. Scores are the matmul in the
inputs' dtype (bf16 under autocast, as the eager attention computes them), softmax and accumulation in fp32; Gemma's
logit soft-capping is applied as the family's eager attention does.
"""

from __future__ import annotations

import torch

__all__ = ["attention_segments", "ttt_attention"]

_CPU_BLOCK_BYTES = 32 * 2**20
_ACCELERATOR_BLOCK_BYTES = 256 * 2**20


def attention_segments(
    attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device
) -> torch.Tensor:
    """``[B, S]`` long segment ids for `ttt_attention`: 0 on padding (``attention_mask == 0``), otherwise 1, or with
    `position_ids` (packed rows) a new id wherever the positions restart (``position_ids[t] != position_ids[t-1] + 1``)."""
    if position_ids is None:
        segments = torch.ones(batch, seq, dtype=torch.long, device=device)
    else:
        if position_ids.shape != (batch, seq):
            raise ValueError(f"position_ids must be [batch, seq] = {(batch, seq)}, got {tuple(position_ids.shape)}.")
        starts = torch.ones(batch, seq, dtype=torch.long, device=device)
        starts[:, 1:] = (position_ids[:, 1:] != position_ids[:, :-1] + 1).long()
        segments = starts.cumsum(1)
    if attention_mask is not None:
        segments = segments * attention_mask.to(device).bool()
    return segments


def _chunk_rows(batch: int, heads: int, keys: int, device: torch.device) -> int:
    budget = _CPU_BLOCK_BYTES if device.type == "cpu" else _ACCELERATOR_BLOCK_BYTES
    return max(1, budget // (4 * batch * heads * max(keys, 1)))


def _scores(raw: torch.Tensor, scaling: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | float]:
    """fp32 scores from raw ``q . k`` and the derivative ``d scores / d raw`` (a number without soft-capping)."""
    scores = raw.float() * scaling
    if softcap is None:
        return scores, scaling
    capped = torch.tanh(scores / softcap)
    return capped * softcap, (1 - capped * capped) * scaling


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k0: torch.Tensor,
        v0: torch.Tensor,
        query_index: torch.Tensor,
        segments: torch.Tensor,
        scaling: float,
        softcap: float | None,
        *diagonal: torch.Tensor,
    ) -> torch.Tensor:
        batch, heads, count, dim = q.shape
        kv = k0.shape[1]
        q5 = q.reshape(batch, kv, heads // kv, count, dim)  # [B, kv, g, Sq, d]: no copy of k/v per query head
        # Stored [B, Sq, h, d]: the layer's o_proj reads it as [B, Sq, h*d] without a copy, so that the output the
        # backward needs and the o_proj input autograd keeps are one tensor.
        stored = q5.new_empty(batch, count, heads, dim)
        out = stored.view(batch, count, kv, heads // kv, dim).permute(0, 2, 3, 1, 4)  # [B, kv, g, Sq, d] view
        lse = q5.new_empty(q5.shape[:-1], dtype=torch.float32)  # [B, kv, g, Sq]
        query_segment = segments.gather(1, query_index)  # [B, Sq]
        with torch.autocast(q.device.type, enabled=False):
            for part, end, allowed in _chunks(query_index, segments, query_segment, heads):
                scores, _ = _scores(q5[:, :, :, part] @ k0[:, :, None, :end].transpose(-1, -2), scaling, softcap)
                scores.masked_fill_(~allowed, float("-inf"))  # [B, kv, g, c, end]
                qc = q5[:, :, :, part]
                diag = [_scores((qc * k[:, :, None, part]).sum(-1), scaling, softcap)[0] for k in diagonal[0::2]]
                top = scores.amax(-1)  # finite: a query always sees its own position
                for d in diag:
                    top = torch.maximum(top, d)
                scores.sub_(top[..., None]).exp_()
                total = scores.sum(-1)
                for d in diag:
                    total += (d - top).exp()
                log_total = top + total.log()  # [B, kv, g, c]
                scores.div_(total[..., None])  # exp(s - L)
                acc = (scores.to(q.dtype) @ v0[:, :, None, :end]).float()  # [B, kv, g, c, d]
                for d, v in zip(diag, diagonal[1::2]):
                    acc += (d - log_total).exp()[..., None] * v[:, :, None, part].float()
                out[:, :, :, part] = acc
                lse[:, :, :, part] = log_total
        ctx.save_for_backward(q, k0, v0, query_index, segments, out, lse, *diagonal)
        ctx.settings = (scaling, softcap)
        return stored.transpose(1, 2)  # [B, h, Sq, d]

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k0, v0, query_index, segments, out, lse, *diagonal = ctx.saved_tensors
        scaling, softcap = ctx.settings
        batch, heads, count, dim = q.shape
        kv = k0.shape[1]
        groups = heads // kv
        q5 = q.reshape(batch, kv, groups, count, dim)
        g5 = grad_out.reshape(q5.shape).to(q.dtype)
        delta = (g5.float() * out.float()).sum(-1)  # [B, kv, g, Sq] D = dO . out
        grad_q = torch.zeros(q5.shape, dtype=torch.float32, device=q.device)
        grad_k0 = torch.zeros(k0.shape, dtype=torch.float32, device=q.device)
        grad_v0 = torch.zeros_like(grad_k0)
        grad_diag = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in diagonal]
        query_segment = segments.gather(1, query_index)
        with torch.autocast(q.device.type, enabled=False):
            for part, end, allowed in _chunks(query_index, segments, query_segment, heads):
                qc, gc = q5[:, :, :, part], g5[:, :, :, part]  # [B, kv, g, c, d]
                keys, values = k0[:, :, None, :end], v0[:, :, None, :end]  # [B, kv, 1, end, d]
                scores, slope = _scores(qc @ keys.transpose(-1, -2), scaling, softcap)
                scores.masked_fill_(~allowed, float("-inf"))
                probs = scores.sub_(lse[:, :, :, part, None]).exp_()  # [B, kv, g, c, end] the joint softmax's block
                d_part = delta[:, :, :, part]
                d_scores = (gc @ values.transpose(-1, -2)).float().sub_(d_part[..., None]).mul_(probs).mul_(slope)
                d_scores = d_scores.to(q.dtype)
                rows = groups * qc.shape[3]
                grad_q[:, :, :, part] += (d_scores @ keys).float()
                flat = (batch, kv, rows)
                grad_k0[:, :, :end] += d_scores.reshape(*flat, end).transpose(-1, -2) @ qc.reshape(*flat, dim)
                grad_v0[:, :, :end] += probs.to(q.dtype).reshape(*flat, end).transpose(-1, -2) @ gc.reshape(*flat, dim)
                for i in range(0, len(diagonal), 2):
                    k, v = diagonal[i][:, :, None, part].float(), diagonal[i + 1][:, :, None, part].float()
                    d, d_slope = _scores((qc * k.to(q.dtype)).sum(-1), scaling, softcap)
                    p = (d - lse[:, :, :, part]).exp()  # [B, kv, g, c]
                    d_d = p * ((gc.float() * v).sum(-1) - d_part) * d_slope
                    grad_q[:, :, :, part] += d_d[..., None] * k
                    grad_diag[i][:, :, part] += (d_d[..., None] * qc.float()).sum(2)
                    grad_diag[i + 1][:, :, part] += (p[..., None] * gc.float()).sum(2)
        grads = [grad_q.view(q.shape).to(q.dtype), grad_k0.to(k0.dtype), grad_v0.to(v0.dtype), None, None, None, None]
        return (*grads, *(g.to(t.dtype) for g, t in zip(grad_diag, diagonal)))


def _chunks(query_index: torch.Tensor, segments: torch.Tensor, query_segment: torch.Tensor, heads: int):
    """Per chunk of queries: its slice, the keys it can see (``:end``, past its last position none is visible) and
    the visibility ``[B, 1, 1, c, end]`` bool."""
    batch, count = query_index.shape
    rows = _chunk_rows(batch, heads, segments.shape[1], query_index.device)
    starts = range(0, count, rows)
    last = query_index.amax(0)  # [Sq] over the batch
    ends = torch.stack([last[s : s + rows].max() for s in starts]).add(1).tolist() if count else []
    positions = torch.arange(segments.shape[1], device=query_index.device)
    for start, end in zip(starts, ends):
        part = slice(start, start + rows)
        allowed = (positions[:end] <= query_index[:, part, None]) & (
            segments[:, None, :end] == query_segment[:, part, None]
        )  # [B, c, end]
        yield part, end, allowed[:, None, None]


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    query_index: torch.Tensor,
    segments: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Joint attention of q ``[B, h, Sq, d]`` over the step-0 keys and the diagonal keys of the later steps.

    Args:
        q: the queries, ``h`` heads.
        keys, values: ``[k_0, k_1, ..., k_j]``: ``k_0`` ``[B, kv, S, d]`` the step-0 keys (every position), ``k_i``
            ``[B, kv, Sq, d]`` step ``i``'s keys at the queries' own positions (seen by that query only); ``kv``
            divides ``h`` (grouped-query attention, without repeating the keys).
        query_index: ``[B, Sq]`` long, each query's position in ``0..S-1``.
        segments: ``[B, S]`` long; key ``k`` is visible to the query at ``t`` iff ``k <= t`` and
            ``segments[k] == segments[t]`` (`attention_segments`).
        scaling: the score scale (``head_dim ** -0.5`` for most families).
        softcap: Gemma's attention logit soft-capping, or `None`.

    Returns ``[B, h, Sq, d]`` in q's dtype, differentiable with respect to q, keys and values.
    """
    if len(keys) != len(values) or not keys:
        raise ValueError(
            f"ttt_attention needs as many keys as values, at least one; got {len(keys)} and {len(values)}."
        )
    if q.shape[1] % keys[0].shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {keys[0].shape[1]} key/value heads.")
    dtype = q.dtype
    diagonal = [t.to(dtype) for pair in zip(keys[1:], values[1:]) for t in pair]
    return _TTTAttention.apply(
        q, keys[0].to(dtype), values[0].to(dtype), query_index, segments, scaling, softcap, *diagonal
    )
