"""The draft head and its soft-label cross entropy as one autograd function, over the rows that carry loss.

Written as separate ops (``lm_head`` under autocast, ``.float()``, ``log_softmax``, ``gather``), the head and loss of a
TTT step spend more time on elementwise passes over the ``[M, Vd]`` logits (16,384 draft ids) than on the matmul:
the log-softmax and its backward read and write that block several times, the gather's backward fills a zero block
of the same size, and the autocast cast of the fp32 head weight (``[Vd, H]``) and of its gradient back are paid at
every TTT step. `head_cross_entropy` instead

* casts the weight to the compute dtype once for all the rows it is given (the caller passes every step's rows);
* computes, chunk by chunk of rows (so the fp32 working block stays small), the logits, the row's loss
  ``logsumexp(z) * sum(p) - p . z[columns]`` (= ``-(p * log_softmax(z)[columns]).sum()``), the argmax, and the
  gradient with respect to the logits, ``softmax(z) * sum(p) - scatter(p)``, which is known in the forward because the
  loss is the function's last op; it is kept in the compute dtype;
* leaves the backward two matmuls, with the upstream per-row weights (the step's decay and mean) applied to the
  narrow ``[M, H]`` side instead of the ``[M, Vd]`` block.

The other objectives of `eagle3_hf.training.losses` (``loss="tv"``, ``"lk"``) fuse the same way: each gives its
row loss and the gradient of the logits in the form ``softmax(z) * scale - scatter(spread)`` from the logits at the
label's columns and the logsumexp (`losses.support_terms`), so only those two lines of the chunk differ.

The objective, and the rounding points of the bf16 path (logits in bf16, softmax in fp32, the gradient of the logits
rounded to bf16 before the matmuls), are those of the separate ops; ``tests/test_train_fast_step.py`` checks loss and
gradients against them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from eagle3_hf.modeling.head import Eagle3Head
from eagle3_hf.training.losses import check_loss, row_losses, support_terms

__all__ = ["fused_head_applies", "head_cross_entropy", "ttt_head_kwargs"]

# Rows worked on at a time: on a CPU the fp32 [rows, Vd] block should stay near the caches (256 rows of 16,384 ids,
# 16 MiB); on an accelerator each chunk costs a dozen kernel launches, so fewer, larger chunks.
CPU_CHUNK_ROWS = 256
ACCELERATOR_CHUNK_ROWS = 4096


def default_chunk_rows(device: torch.device) -> int:
    """`head_cross_entropy`'s rows per chunk on `device` when none is given."""
    return CPU_CHUNK_ROWS if device.type == "cpu" else ACCELERATOR_CHUNK_ROWS


_BLOCK = 128


def _row_max(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``z.max(-1)`` of a ``[c, V]`` block (the first index among equal maxima), in about a third of its time: the
    maxima of 128-wide blocks (`amax`, a vectorised pass without indices), then the index inside the winning block."""
    rows, width = z.shape
    if width % _BLOCK or rows == 0:
        return z.max(-1)
    blocks = z.view(rows, width // _BLOCK, _BLOCK)
    top, block = blocks.amax(-1).max(-1)  # [c] x2
    within = blocks[torch.arange(rows, device=z.device), block].argmax(-1)  # [c]
    return top, block * _BLOCK + within


# The gradient of the logits ([M, Vd], compute dtype) is kept from the forward up to this size. Above it (long rows:
# 4k tokens x 7 TTT steps is 0.9 GiB in bf16) the backward recomputes it block by block instead, one more head matmul.
KEEP_GRADIENT_BYTES = 512 * 2**20
_BACKWARD_BLOCK_BYTES = 64 * 2**20  # a recomputed block of the gradient of the logits


def _chunk_gradient(
    x: torch.Tensor,
    w_t: torch.Tensor,
    columns: torch.Tensor | None,
    weights: torch.Tensor,
    loss: str,
    logits: torch.Tensor,
    work: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of rows ``x`` ``[c, H]``: ``(row_loss [c], argmax [c], d row_loss / d logits [c, Vd])``, the last a
    view of `work` (the loss's dtype); `logits` and `work` are the reused ``[chunk, Vd]`` blocks."""
    n = x.shape[0]
    z = torch.mm(x, w_t, out=logits[:n])  # as the head under autocast gives it
    e = work[:n].copy_(z)
    top, predicted = _row_max(e)
    e.sub_(top[:, None]).exp_()  # exp(z - max)
    total = e.sum(-1)  # [c]
    lse = top + total.log()
    picked = (z if columns is None else z.gather(1, columns)).to(work.dtype)  # [c, Vd] or [c, k] at `columns`
    row_loss, scale, spread = support_terms(loss, picked, lse, weights)
    e.mul_((scale / total)[:, None])  # softmax(z) * scale (the label's mass for the cross entropy)
    if columns is None:
        e.sub_(spread)
    else:
        e.scatter_add_(1, columns, -spread)
    return row_loss, predicted, e


def _part(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    return None if t is None else t[part]


class _HeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        rows: torch.Tensor,
        weight: torch.Tensor,
        columns: torch.Tensor | None,
        p: torch.Tensor,
        compute_dtype: torch.dtype,
        chunk_rows: int,
        loss: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(rows.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            x = rows.detach().to(compute_dtype)  # [M, H]
            w = weight.detach().to(compute_dtype)  # [Vd, H]
            count = x.shape[0]
            wide = torch.promote_types(compute_dtype, torch.float32)  # softmax and loss: fp32 at least
            row_loss = x.new_empty(count, dtype=wide)
            predicted = torch.empty(count, dtype=torch.long, device=x.device)
            keep = count * w.shape[0] * x.element_size() <= KEEP_GRADIENT_BYTES
            grad_logits = x.new_empty(count, w.shape[0]) if keep else None  # [M, Vd] d row_loss / d logits
            # oneDNN's bf16 matmul runs about twice as fast with both operands contiguous as with a transposed one.
            w_t = w.T.contiguous()  # [H, Vd]
            for part, blocks in _chunks(x, w_t, chunk_rows, wide):
                row_loss[part], predicted[part], e = _chunk_gradient(
                    x[part], w_t, _part(columns, part), p[part], loss, *blocks
                )
                if keep:
                    grad_logits[part].copy_(e)
        ctx.save_for_backward(x, w, grad_logits if keep else p, *(() if columns is None else (columns,)))
        ctx.settings = (rows.dtype, weight.dtype, keep, chunk_rows, loss)
        ctx.needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.mark_non_differentiable(predicted)
        return row_loss, predicted

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor, _grad_predicted: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        x, w, kept, *columns = ctx.saved_tensors
        rows_dtype, weight_dtype, keep, chunk_rows, loss = ctx.settings
        scale = grad_loss[:, None]  # [M, 1] upstream weight of each row, in the loss's (wide) dtype
        count, width = x.shape[0], w.shape[0]
        block_rows = max(count, 1) if keep else max(1, _BACKWARD_BLOCK_BYTES // (width * x.element_size() * chunk_rows))
        block_rows *= 1 if keep else chunk_rows  # whole forward chunks: the recomputed gradient is the same
        grad_rows = x.new_empty(x.shape, dtype=rows_dtype) if ctx.needs[0] else None
        grad_w_t = x.new_zeros(x.shape[1], width, dtype=scale.dtype) if ctx.needs[1] else None  # [H, Vd]
        with torch.autocast(x.device.type, enabled=False):
            w_t = None if keep else w.T.contiguous()
            block = None if keep else x.new_empty(min(block_rows, count), width)
            for start in range(0, count, block_rows):
                rows = slice(start, start + block_rows)
                if keep:
                    grad_logits = kept[rows]
                else:  # recompute this block's gradient of the logits, forward chunk by forward chunk
                    grad_logits = block[: x[rows].shape[0]]
                    cols = columns[0][rows] if columns else None
                    for part, blocks in _chunks(x[rows], w_t, chunk_rows, scale.dtype):
                        e = _chunk_gradient(x[rows][part], w_t, _part(cols, part), kept[rows][part], loss, *blocks)[2]
                        grad_logits[part].copy_(e)
                if grad_rows is not None:
                    grad_rows[rows] = ((grad_logits @ w).to(scale.dtype) * scale[rows]).to(rows_dtype)  # [m, H]
                if grad_w_t is not None:
                    # [H, m] @ [m, Vd] with the small operand made contiguous (as for w_t).
                    scaled = (x[rows].to(scale.dtype) * scale[rows]).to(x.dtype).T.contiguous()  # [H, m]
                    grad_w_t += scaled @ grad_logits
        grad_weight = None if grad_w_t is None else grad_w_t.T.contiguous().to(weight_dtype)
        return grad_rows, grad_weight, None, None, None, None, None


def _chunks(x: torch.Tensor, w_t: torch.Tensor, chunk_rows: int, wide: torch.dtype):
    """The chunks of `x`'s rows, with the ``[chunk, Vd]`` work blocks every chunk reuses (fresh blocks of this size
    would come from mmap and cost page faults at every chunk)."""
    logits = x.new_empty(min(chunk_rows, x.shape[0]), w_t.shape[1])  # [c, Vd] compute dtype
    work = x.new_empty(logits.shape, dtype=wide)  # [c, Vd]
    for start in range(0, x.shape[0], chunk_rows):
        yield slice(start, start + chunk_rows), (logits, work)


def fused_head_applies(head: torch.nn.Module) -> bool:
    """Whether `head` is the draft's bias-free `Eagle3Head` (FSDP2's wrapped class included), whose call can run
    `head_cross_entropy` on its weight; an adapter-wrapped head (LoRA) keeps the separate ops."""
    return isinstance(head, Eagle3Head) and head.bias is None


def head_cross_entropy(
    rows: torch.Tensor,
    weight: torch.Tensor,
    p: torch.Tensor,
    columns: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    chunk_rows: int | None = None,
    loss: str = "forward_kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row soft cross entropy (or another of `eagle3_hf.training.losses.LOSSES`) of the bias-free head
    ``rows @ weight.T``: ``(row_loss [M], argmax [M])``, the loss in fp32 (or the compute dtype if wider).

    Args:
        rows: ``[M, H]`` head inputs.
        weight: ``[Vd, H]`` the head's weight (its gradient is returned in its dtype).
        p: ``[M, k]`` the soft label's probabilities at `columns`, or ``[M, Vd]`` over every draft id (`columns`
            `None`); a row's loss is ``-(p * log_softmax(logits)[columns]).sum()``.
        columns: ``[M, k]`` draft ids of `p`'s entries (repeats allowed: their weights add).
        compute_dtype: dtype of the matmuls and of the kept gradient of the logits (bf16 under bf16 autocast);
            default the weight's.
        chunk_rows: rows whose ``[rows, Vd]`` logits are worked on at a time (default 256 on a CPU, 4,096 on an
            accelerator).
        loss: ``"forward_kl"`` (the cross entropy above), ``"tv"`` or ``"lk"`` (`eagle3_hf.training.losses`; for
            these two `p`'s rows are distributions and a column repeats only where its weight is 0).

    The argmax is the draft's top id per row (no gradient). Differentiable with respect to `rows` and `weight`.
    """
    if rows.dim() != 2 or weight.dim() != 2 or rows.shape[1] != weight.shape[1]:
        raise ValueError(
            f"head_cross_entropy needs rows [M, H] and weight [Vd, H]; got {tuple(rows.shape)} and "
            f"{tuple(weight.shape)}."
        )
    expected = (rows.shape[0], weight.shape[0]) if columns is None else tuple(columns.shape)
    if tuple(p.shape) != expected or (columns is not None and columns.shape[0] != rows.shape[0]):
        raise ValueError(f"p has shape {tuple(p.shape)}, expected {expected} for {rows.shape[0]} rows.")
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(rows.device)
    if not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}.")
    compute_dtype = compute_dtype or weight.dtype
    wide = torch.promote_types(compute_dtype, torch.float32)
    return _HeadCrossEntropy.apply(rows, weight, columns, p.to(wide), compute_dtype, chunk_rows, check_loss(loss))


def ttt_head_kwargs(
    lm_head: torch.nn.Module,
    autocast: Callable[[], AbstractContextManager[Any]],
    compute_dtype: torch.dtype | None,
    loss: str = "forward_kl",
) -> dict[str, Callable[..., Any]]:
    """The head argument of `ttt_loss`: the fused head and loss where it applies (an `Eagle3Head`), else the head
    module on the supervised rows under the training's autocast (a LoRA-wrapped head, the reference path): given to
    `ttt_loss` as its `head` for the cross entropy, or wrapped with `losses.row_losses` for another `loss`."""
    check_loss(loss)
    if not fused_head_applies(lm_head):

        def head(rows: torch.Tensor) -> torch.Tensor:
            with autocast():
                return lm_head(rows)

        if loss == "forward_kl":
            return {"head": head}

        def reference(rows: torch.Tensor, p: torch.Tensor, columns: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            log_q = torch.log_softmax(head(rows).float(), dim=-1)  # [M, Vd]
            picked = log_q if columns is None else log_q.gather(1, columns)
            return row_losses(loss, picked, p), log_q.detach().max(-1).indices

        return {"fused_head": reference}

    run = functools.partial(head_cross_entropy, compute_dtype=compute_dtype, loss=loss)

    def fused_head(
        rows: torch.Tensor, p: torch.Tensor, columns: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return lm_head(rows, run, p, columns)  # in the head's own call: FSDP2 gathers its weight around it

    return {"fused_head": fused_head}
