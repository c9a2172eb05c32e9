"""The draft's attention masks: additive float masks (0 where a query may attend, the dtype's minimum elsewhere).

`Eagle3DraftModel.forward` builds the causal one (with padding) for the family's attention module; the training-time
test builds it once per batch for its joint attention. Decoding builds its own over tree nodes (`additive_mask`).
"""

from __future__ import annotations

import torch

__all__ = ["additive_mask", "causal_mask"]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = attend) -> additive float mask (0 / finfo.min), right for eager and sdpa."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_mask(
    batch: int,
    seq: int,
    past: int,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive `[B, 1, S, past+S]` mask: causal, plus the 2D padding mask `[B, past+S]` (1 = token) when given."""
    q_pos = torch.arange(past, past + seq, device=device)[:, None]
    allowed = torch.arange(past + seq, device=device)[None, :] <= q_pos  # [S, past+S]
    allowed = allowed[None, None].expand(batch, 1, seq, past + seq)
    if attention_mask is not None:
        if attention_mask.shape != (batch, past + seq):
            raise ValueError(
                f"A 2D attention_mask must have shape (batch, past+seq)=({batch}, {past + seq}), "
                f"got {tuple(attention_mask.shape)}."
            )
        allowed = allowed & attention_mask[:, None, None, :].bool()
    return additive_mask(allowed, dtype)
