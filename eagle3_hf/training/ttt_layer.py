"""The training-time-test step's attention: each draft layer's joint attention over the earlier TTT steps' keys.

`eagle3_hf.training.ttt` explains the structure: at TTT step ``j`` query ``(t, j)`` sees the step-0 keys at positions
``<= t`` (causal, and padding) plus the keys of steps ``1..j`` at position ``t`` only, under one joint softmax. Each
TTT step is one call of the draft's own forward with a `TTTAttention` as its `attention`; every decoder layer then
attends this way over its own earlier steps' keys/values, which the object keeps.
"""

from __future__ import annotations

import torch

from eagle3_hf.modeling.decoder_layer import Eagle3DecoderLayer

__all__ = ["TTTAttention", "joint_attention", "repeat_kv"]


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


class TTTAttention:
    """One TTT step's attention (a `DraftAttention` for the draft's forward): each layer's query attends jointly over
    that layer's step-0 keys (causal, under the additive mask ``[B, 1, S, S]`` the forward is given) and its own
    position's keys of steps ``1..j`` (`joint_attention`).

    Args:
        earlier: per draft layer, the keys and values of the earlier steps, ``[k_0, v_0, k_1, v_1, ...]``,
            ``[B, kv, S, d]`` each (kv heads, not repeated); empty lists at step 0.

    The object only reads `earlier`, and keeps this step's keys and values apart (`next_step` adds them for the
    next step): a checkpointed layer that is run again in the backward pass computes the same step again.
    """

    def __init__(self, earlier: list[list[torch.Tensor]]) -> None:
        self.earlier = earlier
        self.current: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(earlier)
        self.needs_grad = torch.is_grad_enabled()

    def __call__(
        self, layer: Eagle3DecoderLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self.needs_grad and not torch.is_grad_enabled():
            # Reentrant checkpointing runs the layer without a graph: the keys kept for the later steps would pass
            # them no gradient.
            raise ValueError(
                "The TTT step ran a draft layer without gradients inside a step that needs them: reentrant activation "
                "checkpointing is not supported; enable it with {'use_reentrant': False} (the default)."
            )
        attn = layer.self_attn
        previous = self.earlier[layer.layer_idx]
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
        self.current[layer.layer_idx] = (k, v)
        return out.transpose(1, 2).reshape(*q.shape[:1], q.shape[2], -1)  # [B, S, heads*d]

    def next_step(self) -> TTTAttention:
        """The next step's attention: the earlier steps' keys/values and this step's, per layer."""
        if any(kv is None for kv in self.current):
            raise ValueError("The TTT step has not run every draft layer; run the draft's forward with it first.")
        return TTTAttention([[*earlier, *kv] for earlier, kv in zip(self.earlier, self.current)])
