"""The training batches: conversations right-padded into rows, or packed several to a row (``--packing``).

Padding makes every row as long as the batch's longest conversation, and the draft's TTT steps (and an online
target's forward) pay for every padded position. Packing places the batch's conversations one after another in rows
of at most ``max_length`` tokens (first fit, in the batch's order), so the batch has fewer, fuller rows. Each
conversation stays on its own: ``position_ids`` restart at 0 with it, and from them the target's forward (HF's packed
sequence masks), the TTT attention (`eagle3_hf.training.ttt_attention`: keys of the same conversation only), the
RoPE positions and the loss (a position never predicts a token of the next conversation) each keep to it, so the loss
and its gradients are those of the padded batch of the same conversations (tested). The padding after a row's last
conversation gets positions of its own, from 0, and ``attention_mask`` 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FEATURE_KEYS = ("target_hidden_states", "target_top_logits", "target_top_ids")
_FLOAT_FEATURES = ("target_hidden_states", "target_top_logits")  # kept in their stored dtype by the collator

__all__ = ["FEATURE_KEYS", "Eagle3DataCollator", "pack_rows"]


def pack_rows(lengths: list[int], capacity: int | None) -> list[list[int]]:
    """First fit: the indices of the conversations each packed row holds, in order, at most `capacity` tokens a row
    (`None`: one row). A conversation longer than `capacity` must have been cut to it.

    Example:

    ```python
    >>> from eagle3_hf.training.collator import pack_rows
    >>> pack_rows([5, 3, 4, 2], capacity=8)
    [[0, 1], [2, 3]]
    >>> pack_rows([6, 5, 2], capacity=8)
    [[0, 2], [1]]
    ```
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for index, length in enumerate(lengths):
        if capacity is not None and length > capacity:
            raise ValueError(f"A conversation of {length} tokens cannot be packed into rows of {capacity}.")
        row = next((r for r, free in enumerate(room) if free >= length), None) if capacity is not None else 0
        if row is None or not rows:
            rows.append([])
            room.append(capacity if capacity is not None else 0)
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= length
    return rows


@dataclass
class Eagle3DataCollator:
    """Right-pad rows into a batch; ``loss_mask`` and ``attention_mask`` are 0 on padding, features 0. With
    `packing`, several conversations share a row (`pack_rows`) and the batch also holds ``position_ids``.

    Rows hold ``input_ids`` and ``loss_mask`` (lists or tensors), optionally ``attention_mask`` and the offline
    features ``target_hidden_states`` ``[S, 3Ht]`` / ``target_top_logits`` / ``target_top_ids`` ``[S, k]``; other keys
    (``id``) are dropped. Each is first cut to `max_length`.

    Example:

    ```python
    >>> from eagle3_hf.training.trainer import Eagle3DataCollator
    >>> rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    >>> batch = Eagle3DataCollator()(rows)
    >>> batch["input_ids"].tolist(), batch["loss_mask"].tolist(), batch["attention_mask"].tolist()
    ([[5, 6, 7], [8, 0, 0]], [[0, 1, 1], [1, 0, 0]], [[1, 1, 1], [1, 0, 0]])
    >>> packed = Eagle3DataCollator(max_length=4, packing=True)(rows)
    >>> packed["input_ids"].tolist(), packed["position_ids"].tolist()
    ([[5, 6, 7, 8]], [[0, 1, 2, 0]])
    ```
    """

    pad_token_id: int = 0
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    packing: bool = False

    def __call__(self, rows: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("Cannot collate an empty list of rows.")
        for index, row in enumerate(rows):
            missing = {"input_ids", "loss_mask"} - set(row)
            if missing:
                raise ValueError(f"Row {index} lacks {sorted(missing)}; it has {sorted(row)}.")
        lengths = [min(len(r["input_ids"]), self.max_length or len(r["input_ids"])) for r in rows]
        groups = pack_rows(lengths, self.max_length) if self.packing else [[i] for i in range(len(rows))]
        filled = [sum(lengths[i] for i in group) for group in groups]
        width = max(filled)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: dict[str, torch.Tensor] = {}
        keys = ["input_ids", "attention_mask", "loss_mask"] + [k for k in FEATURE_KEYS if k in rows[0]]
        for key in keys:
            values = []
            for row, n in zip(rows, lengths):
                if key == "attention_mask" and key not in row:
                    value = torch.ones(n, dtype=torch.long)
                else:
                    value = torch.as_tensor(row[key])[:n]
                    value = value if key in _FLOAT_FEATURES else value.long()
                values.append(value)
            fill = self.pad_token_id if key == "input_ids" else 0
            out = values[0].new_full((len(groups), width, *values[0].shape[1:]), fill)
            for r, group in enumerate(groups):
                out[r, : filled[r]] = torch.cat([values[i] for i in group])
            batch[key] = out
        if self.packing:  # each conversation from 0, and the padding after them as one more
            batch["position_ids"] = torch.stack(
                [
                    torch.cat([torch.arange(n) for n in [*(lengths[i] for i in group), width - fill_]])
                    for group, fill_ in zip(groups, filled)
                ]
            )
        return batch
