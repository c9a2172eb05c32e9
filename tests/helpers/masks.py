"""Attention masks the draft-step tests build by hand."""

import torch

from eagle3_hf.modeling.masks import additive_mask


def causal_block(prefix, seq, dtype, device):
    """Additive mask `[seq, prefix + seq]`: every query sees the prefix and the new positions up to its own."""
    return additive_mask(torch.ones(seq, prefix + seq, dtype=torch.bool, device=device).tril(diagonal=prefix), dtype)
