"""Soft labels: the target's top-k logits, and the distribution over a draft vocabulary the TTT loss trains towards.

Online training and offline features keep the same top-k of the target's logits per position (`target_top_k`); the
loss restricts them to the draft vocabulary (`draft_vocab_targets`): the target's top token, whether the draft
vocabulary holds it (only then does the position carry loss), and the softmax of the kept logits over the draft ids.
`eagle3_hf.training.ttt` re-exports both.
"""

from __future__ import annotations

import torch

__all__ = ["draft_vocab_targets", "target_top_k"]


def target_top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's `k` largest logits over its FULL vocabulary and their ids: ``([..., k], int32 [..., k])``.

    Sorted in descending order, so column 0 is the target's top token. Online training and offline features both
    keep exactly this (`k` is capped at the vocabulary size); the loss then restricts it to a draft vocabulary with
    `draft_vocab_targets`, so one set of features serves any draft vocabulary.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"The number of target logits to keep (top-k) must be a positive integer, got {k!r}.")
    values, ids = torch.topk(logits, min(k, logits.shape[-1]), dim=-1, sorted=True)
    return values, ids.to(torch.int32)


def draft_vocab_targets(
    target_logits: torch.Tensor, target_ids: torch.Tensor | None, t2d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: the target's top token, whether the draft vocabulary holds it, and the soft label.

    Args:
        target_logits: ``[N, k]`` target logits of the ids `target_ids`, or ``[N, V]`` over the whole vocabulary.
        target_ids: ``[N, k]`` the target ids of the columns (`target_top_k`'s), or `None` for ``[N, V]``.
        t2d: ``[V]`` bool draft-vocabulary membership.

    Returns ``(top [N] target ids, in_vocab [N] bool, p [M, Vd])``: `p` is, for the ``M`` positions whose top token
    is in the draft vocabulary, the softmax of their logits restricted to draft-vocabulary ids (every other id, and
    every id outside the top k, at -inf), float32, in draft-id order.
    """
    t2d = t2d.to(target_logits.device)
    if target_ids is None:
        top = target_logits.argmax(-1)  # [N]
        in_vocab = t2d[top]
        return top, in_vocab, torch.softmax(target_logits[in_vocab][:, t2d].float(), dim=-1)
    top, in_vocab, columns, p = _sparse_targets(target_logits, target_ids, t2d)
    dense = p.new_zeros(p.shape[0], int(t2d.sum()))
    return top, in_vocab, dense.scatter_add_(1, columns, p)


def _sparse_targets(
    target_logits: torch.Tensor, target_ids: torch.Tensor, t2d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`draft_vocab_targets` for top-k logits, with the soft label kept sparse: ``(top [N], in_vocab [N],
    columns [M, k] draft ids, p [M, k])``. `p` is zero at the columns whose id lies outside the draft vocabulary
    (their `columns` entry is 0, a placeholder), so the loss is ``-(p * log_q.gather(1, columns)).sum()``: O(M*k)
    instead of a product over the whole ``[M, Vd]``."""
    t2d = t2d.to(target_logits.device)
    ids = target_ids.long()
    top = ids.gather(-1, target_logits.argmax(-1, keepdim=True))[:, 0]  # column 0 when sorted, any order works
    in_vocab = t2d[top]
    ids, logits = ids[in_vocab], target_logits[in_vocab].float()  # [M, k]
    member = t2d[ids]
    draft_index = torch.cumsum(t2d.long(), 0) - 1  # [V] draft id of each in-vocabulary target id
    columns = torch.where(member, draft_index[ids], 0)
    p = torch.softmax(torch.where(member, logits, float("-inf")), dim=-1)  # the top id is a member: no all -inf row
    return top, in_vocab, columns, p
