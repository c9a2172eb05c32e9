"""The draft at decoding time: its own forward attending over a preallocated KV buffer, for A rows.

Drafting a tree calls the draft once per level on a handful of nodes per row, where per-call overheads cost as much
as the matmuls: a `DynamicCache` concatenates its whole history on every update and is cropped again after each tree,
the attention module goes through transformers' dispatch, and the mask is rebuilt in full. So decoding runs
`Eagle3DraftModel.forward` with a `DraftKVAttention` as its `attention`: each layer's keys and values are written into
a `DraftKV` buffer at chosen slots, and the layer attends over the buffer under the caller's additive mask; slots past
`length` hold a tree's nodes and are simply overwritten by the next tree. A deeper draft writes every layer's
keys/values at the same slots, so one `length` serves them all. Rows of a batch share the slots column by column
(drafting.py's `DraftState.valid` says which columns are a row's own). `draft_forward` is that call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3_hf.modeling.decoder_layer import Eagle3DecoderLayer
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel

__all__ = ["DraftKV", "DraftKVAttention", "draft_forward"]


class DraftKV:
    """Keys and values of the draft's layers, `[num_layers, rows, kv_heads, capacity, head_dim]`, grown by doubling:
    slots `[0, length)` hold verified columns, the rest is the trees' scratch space (see the module docstring)."""

    def __init__(self, draft: Eagle3DraftModel, capacity: int = 512, rows: int = 1) -> None:
        """An empty buffer for `draft`'s layers (its depth, validated by its config) in its dtype and device."""
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"DraftKV needs rows >= 1 (one per prompt of the batch), got {rows!r}.")
        kv_heads = draft.config.num_key_value_heads or draft.config.num_attention_heads
        head_dim, weight = draft.midlayer.self_attn.head_dim, draft.lm_head.weight
        shape = (len(draft.draft_layers()), rows, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def write(
        self, slot: int, keys: torch.Tensor, values: torch.Tensor, layer: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer`'s `[rows, kv_heads, S, d]` keys/values at slots `[slot, slot + S)`; return that layer's
        every key/value up to there (`[rows, kv_heads, slot + S, d]`). Growing the buffer grows every layer's."""
        end = slot + keys.shape[2]
        capacity = self.capacity
        if end > capacity:
            grown = max(end, 2 * capacity)
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:3], grown, old.shape[4])
                new[:, :, :, :capacity] = old
                setattr(self, name, new)
        self.keys[layer, :, :, slot:end] = keys
        self.values[layer, :, :, slot:end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the rows `rows` (indices into the current rows), e.g. when others finished."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]

    def gather_columns(self, index: torch.Tensor) -> None:
        """Keep, per row, the columns `index` `[rows, n]` (in that order) as columns `0..n-1`."""
        n = index.shape[1]
        layers, rows, heads, _, dim = self.keys.shape
        gather = index[None, :, None, :, None].expand(layers, rows, heads, n, dim)
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            buffer[:, :, :, :n] = buffer.gather(3, gather)  # gather copies first: source and target may overlap
        self.length = n


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """GQA attention of q `[A, h, S, d]` over keys/values `[A, kv, L, d]` without repeating them: the `g = h / kv`
    query heads that share a kv head are stacked along the query axis (`[A, kv, g*S, d]`); additive mask
    `[A, S, L]`, `[S, L]` (every row the same) or None. Returns `[A, h, S, d]`."""
    rows, heads, seq, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = q.reshape(rows, kv_heads, groups * seq, dim)
    if mask is not None:
        mask = mask.repeat(groups, 1) if mask.dim() == 2 else mask.repeat(1, groups, 1)[:, None]  # [(A,1,) g*S, L]
    if softcap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    else:  # Gemma-style logit soft-capping, which the fused kernel has no option for
        scores = torch.tanh(torch.matmul(q, keys.transpose(-1, -2)) * scaling / softcap) * softcap
        if mask is not None:
            scores = scores + mask
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype), values)
    return out.reshape(rows, heads, seq, dim)


class DraftKVAttention:
    """The draft's attention at decoding time (a `DraftAttention`): each layer writes its keys/values into `kv` at
    slots ``[slot, slot + S)`` and attends over ``[0, slot + S)`` under the forward's mask (see `draft_forward`)."""

    __slots__ = ("kv", "slot")

    def __init__(self, kv: DraftKV, slot: int) -> None:
        self.kv, self.slot = kv, slot

    def __call__(
        self, layer: Eagle3DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        attn = layer.self_attn
        keys, values = self.kv.write(self.slot, k, v, layer.layer_idx)
        attended = _attend(q, keys, values, mask, attn.scaling, getattr(attn, "attn_logit_softcapping", None))
        return attended.transpose(1, 2).reshape(*q.shape[:1], q.shape[2], -1)  # [A, S, heads*d]


def draft_forward(
    draft: Eagle3DraftModel,
    kv: DraftKV,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slot: int,
    mask: torch.Tensor | None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft step over `S` new columns of A rows: the draft's forward over `kv`, without the head.

    Args:
        input_ids: `[A, S]` the target ids that follow each hidden state.
        hidden: `[A, S, H]` fused target features (`draft.fuse(...)`) or the draft's fed-back state.
        positions: `[A, S]` RoPE positions (the nodes of one tree level share one per row).
        slot: where in `kv` the S new keys/values go; each row attends to slots `[0, slot + S)` under `mask`.
        mask: additive `[A, S, slot + S]` (or `[S, slot + S]`, the same for every row) in `hidden`'s dtype, or None
            to attend to every slot.
        rotary: RoPE (cos, sin) for `positions`, when the caller has them already (a tree's levels take theirs from
            one table); computed from `positions` otherwise.

    Returns:
        (the normed output `[A, S, H]`, for the head; the state to feed back `[A, S, H]`).
    """
    out = draft(
        input_ids,
        hidden_states=hidden,
        position_ids=positions,
        attention_mask=mask,
        attention=DraftKVAttention(kv, slot),
        position_embeddings=rotary,
        skip_logits=True,
    )
    return out.normed_hidden_state, out.last_hidden_state
