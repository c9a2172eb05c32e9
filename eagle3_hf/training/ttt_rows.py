"""Sampled deep TTT steps: run TTT steps ``1..K-1`` on a random share of the positions, step 0 on all of them.

Why it is exact where it runs: at TTT step ``j >= 1`` query ``(t, j)`` attends to the step-0 keys at positions
``<= t`` and to its OWN position's keys of steps ``1..j`` (`eagle3_hf.training.ttt`). So the chain of deep steps at
one position depends on no other position's deep steps: running steps ``1..K-1`` only at a subset of positions
gives, at those positions, exactly the states and logits of the full unroll. Step 0 still runs everywhere (its keys
are every later step's causal context, and it is the step acceptance depends on most).

What it saves: after the target's forward, the draft's cost grows with the rows it unrolls, ``K`` times the
sequence in the full unroll; with a share ``f`` of the positions it is ``1 + f * (K - 1)`` times. Each deep step's
loss is then the mean over the sampled positions it supervises, an unbiased estimate (as a ratio) of the full step's
mean: deep steps see fewer positions per conversation, step 0 all of them. What it costs: the deep steps' gradients
also teach step 0, so a conversation teaches less (measured in docs/research/training-cost.md: at K=4, f=0.25 no
gain at equal CPU time).

Positions are sampled per row among those where at least one deep step is supervised, at the same rate in every
row; with ``fraction=1`` every such position is taken and the loss equals the full unroll's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_hf.training.arguments import check_deep_fraction

__all__ = [
    "DeepRows", "check_deep_rows", "deep_candidates", "deep_step_selection", "deep_step_tokens", "sample_deep_rows",
    "take_deep_rows",
]


@dataclass
class DeepRows:
    """The positions at which TTT steps ``1..K-1`` run.

    Args:
        positions: ``[B, r]`` long, the positions ``t`` of each row (distinct, ascending among the valid ones).
        valid: ``[B, r]`` bool; rows sampled fewer than ``r`` positions fill the rest with positions that are
            computed but never supervised.
    """

    positions: torch.Tensor
    valid: torch.Tensor


def deep_candidates(loss_mask: torch.Tensor, ttt_length: int) -> torch.Tensor:
    """``[B, S]`` bool: positions ``t`` where some step ``j`` in ``1..K-1`` is supervised (``loss_mask[t+2+j]``)."""
    supervised = loss_mask.bool()
    seq = supervised.shape[1]
    candidates = torch.zeros_like(supervised)
    for step in range(1, ttt_length):
        shift = 2 + step
        if shift < seq:
            candidates[:, : seq - shift] |= supervised[:, shift:]
    return candidates


def sample_deep_rows(
    loss_mask: torch.Tensor,
    ttt_length: int,
    fraction: float,
    generator: torch.Generator | None = None,
) -> DeepRows:
    """Sample ``ceil(fraction * n_b)`` of the ``n_b`` candidate positions of each row b (`deep_candidates`).

    Args:
        loss_mask: ``[B, S]`` 1 where the token is supervised.
        ttt_length: TTT steps K (at least 2: with one step there is no deep step to sample).
        fraction: share of each row's candidates to take, in ``(0, 1]``.
        generator: random source (default: torch's global one, which the Trainer seeds and checkpoints).

    Example:

    ```python
    >>> import torch
    >>> from eagle3_hf.training.ttt_rows import sample_deep_rows
    >>> mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])
    >>> rows = sample_deep_rows(mask, ttt_length=3, fraction=1.0)
    >>> rows.positions.tolist(), rows.valid.all().item()
    ([[0, 1, 2, 3, 4, 5, 6]], True)
    >>> sample_deep_rows(mask, ttt_length=3, fraction=0.5).valid.sum().item()
    4
    ```
    """
    if not isinstance(ttt_length, int) or ttt_length < 2:
        raise ValueError(f"Sampling deep TTT steps needs ttt_length >= 2, got {ttt_length!r}.")
    check_deep_fraction(fraction)
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, seq], got shape {tuple(loss_mask.shape)}.")
    candidates = deep_candidates(loss_mask, ttt_length)  # [B, S]
    batch, seq = candidates.shape
    counts = candidates.sum(1)  # [B]
    take = torch.ceil(counts.double() * fraction).long().clamp(max=counts)  # [B]
    width = max(int(take.max()) if batch else 0, 1)  # at least one column, so the deep steps keep their shapes
    # Random keys, candidates first: the first take[b] of each row's order are a uniform sample of its candidates.
    keys = torch.rand(batch, seq, generator=generator, device=loss_mask.device)
    keys = torch.where(candidates, keys, keys + 2)
    chosen = keys.argsort(dim=1)[:, :width]  # [B, r] distinct positions
    valid = torch.arange(width, device=loss_mask.device)[None] < take[:, None]  # [B, r]
    # Ascending positions, valid ones first (only locality and a stable row order depend on it).
    order = torch.where(valid, chosen, chosen + seq).argsort(dim=1)
    return DeepRows(positions=chosen.gather(1, order), valid=valid.gather(1, order))


def check_deep_rows(deep_rows: DeepRows, batch: int, seq: int, step_outputs: torch.Tensor | None = None) -> None:
    """Raise `ValueError` unless `deep_rows` indexes positions of a ``[batch, seq]`` batch (and `step_outputs`, a
    deep step's outputs when given, were computed at them)."""
    positions, valid = deep_rows.positions, deep_rows.valid
    if positions.dim() != 2 or positions.shape[0] != batch or valid.shape != positions.shape:
        raise ValueError(
            f"deep_rows.positions {tuple(positions.shape)} and .valid {tuple(valid.shape)} must both be "
            f"[batch={batch}, r]."
        )
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= seq):
        low, high = int(positions.min()), int(positions.max())
        raise ValueError(f"deep_rows.positions must lie in [0, {seq}), got {low}..{high}.")
    if step_outputs is not None and step_outputs.shape[:2] != positions.shape:
        raise ValueError(
            f"Step 1's outputs have shape {tuple(step_outputs.shape)}, not [batch, r] = {tuple(positions.shape)}: "
            "pass ttt_forward the same deep_rows."
        )


def take_deep_rows(
    deep_rows: DeepRows, hidden: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled positions' rows of the step-0 state ``[B, S, H] -> [B, r, H]`` and of the additive mask
    ``[B, 1, S, S] -> [B, 1, r, S]`` (their causal view of the step-0 keys), and the positions ``[B, r]``."""
    index = deep_rows.positions.to(hidden.device)
    hidden = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    mask = mask.gather(2, index[:, None, :, None].expand(-1, 1, -1, mask.shape[-1]))
    return hidden, mask, index


def deep_step_tokens(input_ids: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
    """``[B, r]`` the token ``x_{t+1+step}`` each sampled position ``t`` reads at TTT step `step` (id 0 past the end,
    where nothing is supervised)."""
    seq = input_ids.shape[1]
    read = positions + 1 + step
    return torch.where(read < seq, input_ids.gather(1, read.clamp(max=seq - 1)), 0)


def deep_step_selection(
    deep_rows: DeepRows, loss_mask: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which sampled rows TTT step `step` supervises: ``selected`` ``[B, r]`` bool (valid, and the predicted token
    ``x_{t+2+step}`` inside the row and supervised), and for those rows, in row-major order, their batch index and
    the target-logit row ``t+1+step`` (``[N]`` each)."""
    seq = loss_mask.shape[1]
    positions = deep_rows.positions.to(loss_mask.device)
    predicted = positions + 2 + step  # the loss-mask entry of the token each sampled position predicts
    selected = deep_rows.valid.to(loss_mask.device) & (predicted < seq)
    selected &= loss_mask.gather(1, predicted.clamp(max=seq - 1)).bool()
    batch_index, column = selected.nonzero(as_tuple=True)
    return selected, batch_index, positions[batch_index, column] + 1 + step
