"""Left-padded batches of prompts and each row's unpadded output."""

import torch

from helpers.generation import (
    smollm2,  # noqa: F401 (the SmolLM2 fixture)
)
from helpers.sampling import (
    models,  # noqa: F401 (the sampling fixture)
)


def left_padded(prompts, pad=0, extra=0):
    """`(ids, mask)` `[B, longest + extra]`: each prompt right-aligned after `pad` ids."""
    width = max(p.shape[1] for p in prompts) + extra
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :] = prompt[0]
        mask[row, width - prompt.shape[1] :] = 1
    return ids, mask


def unpadded(sequences, mask, row):
    width = mask.shape[1]
    return sequences[row, width - int(mask[row].sum()) :].tolist()
