"""One draft layer's training-time-test step: its joint attention over the earlier TTT steps' keys and values.

`eagle3_hf.training.ttt` explains the structure: at TTT step ``j`` query ``(t, j)`` sees the step-0 keys at positions
``<= t`` (causal, and padding) plus the keys of steps ``1..j`` at position ``t`` only, under one joint softmax. Each
decoder layer of the draft keeps its own earlier keys/values; `ttt_forward` calls `routed_layer_step` once per layer
and step, through the layer's own call so that FSDP2 gathers that layer's weights around it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from eagle3_hf.training.distributed import routed_forward

__all__ = ["joint_attention", "layer_step", "repeat_kv", "routed_layer_step"]


def joint_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of q ``[B, h, S, d]`` over the causal keys ``keys[0]`` ``[B, h, S, d]`` and the diagonal keys.

    `keys[1:]` (steps 1..j) are seen only at the query's own position: their scores are ``(q * k_i).sum(-1)``, appended
    as extra columns ``[B, h, S, j]`` before one softmax. `mask` is the additive ``[B, 1, S, S]`` causal/padding mask.
    Returns ``[B, h, S, d]``.
    """
    scores = torch.matmul(q, keys[0].transpose(-1, -2))  # [B, h, S, S]
    if len(keys) > 1:
        diagonal = torch.stack([(q * k).sum(-1) for k in keys[1:]], dim=-1)  # [B, h, S, j]
        scores = torch.cat([scores, diagonal], dim=-1)  # [B, h, S, S+j]
    scores = scores * scaling
    if softcap is not None:  # Gemma-style logit soft-capping, as the family's eager attention does
        scores = torch.tanh(scores / softcap) * softcap
    if len(keys) > 1:
        mask = torch.nn.functional.pad(mask, (0, len(keys) - 1))  # the diagonal columns are always visible
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(values[0].dtype)
    seq = keys[0].shape[-2]
    out = torch.matmul(probs[..., :seq], values[0])  # [B, h, S, d]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., seq + i, None] * v
    return out


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv, S, d]`` -> ``[B, kv*groups, S, d]`` (GQA: each kv head serves `groups` query heads)."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def routed_layer_step(layer: nn.Module, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`layer_step` of one draft layer, run through the layer's call (not its methods): a layer sharded by FSDP2
    gathers its weights and reduces their gradients in the hooks of that call."""
    with routed_forward(layer, functools.partial(layer_step, layer)):
        return layer(*tensors)


def layer_step(
    layer: nn.Module,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    *previous: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step of one draft layer (over ``[embeds | hidden]`` for layer 0, over ``hidden``, the layer below's
    output, for the others) attending to that layer's keys/values of the earlier steps.

    `previous` is ``(k_0, v_0, k_1, v_1, ...)`` of the earlier steps, ``[B, kv, S, d]`` each (kv heads, not repeated).
    Returns (layer output ``[B, S, H]``, this step's k and v). A plain-tensor signature so that activation
    checkpointing can recompute it.
    """
    attn = layer.self_attn
    x, residual = layer.layer_input(embeds, hidden)  # [B, S, 2H] (layer 0) or [B, S, H], and [B, S, H]
    q, k, v = layer.qkv(x, (cos, sin))  # [B, heads, S, d], [B, kv, S, d] x2
    keys = [*previous[0::2], k]
    values = [*previous[1::2], v]
    groups = attn.num_key_value_groups
    out = joint_attention(
        q,
        [repeat_kv(t, groups) for t in keys],
        [repeat_kv(t, groups) for t in values],
        mask,
        attn.scaling,
        getattr(attn, "attn_logit_softcapping", None),
    )
    out = out.transpose(1, 2).reshape(*embeds.shape[:-1], -1)  # [B, S, heads*d]
    return layer.finish(residual, attn.o_proj(out)), k, v
