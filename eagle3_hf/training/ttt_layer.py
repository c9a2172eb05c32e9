"""The training-time-test step's attention: each draft layer's joint attention over the earlier TTT steps' keys.

`eagle3_hf.training.ttt` explains the structure: at TTT step ``j`` query ``(t, j)`` sees the step-0 keys at positions
``<= t`` of its conversation (causal, no padding) plus the keys of steps ``1..j`` at position ``t`` only, under one joint softmax. Each
TTT step is one call of the draft's own forward with a `TTTAttention` as its `attention`; every decoder layer then
attends this way over its own earlier steps' keys/values, which the object keeps.
"""

from __future__ import annotations

import torch

from eagle3_hf.modeling.decoder_layer import Eagle3DecoderLayer
from eagle3_hf.training.ttt_attention import ttt_attention

__all__ = ["TTTAttention", "repeat_kv"]


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv, S, d]`` -> ``[B, kv*groups, S, d]`` (GQA: each kv head serves `groups` query heads)."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


class TTTAttention:
    """One TTT step's attention (a `DraftAttention` for the draft's forward): each layer's query attends jointly over
    that layer's step-0 keys (causal, within the conversation: the forward is given the ``[B, S]`` conversation ids
    of `eagle3_hf.training.ttt_attention.attention_segments` as its mask) and its own position's keys of steps
    ``1..j`` (`ttt_attention`, without a score tensor).

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
        batch, _, count, _ = q.shape
        query_index = torch.arange(count, device=q.device)[None].expand(batch, count)
        softcap = getattr(attn, "attn_logit_softcapping", None)
        # `mask` is the ``[B, S]`` conversation id of each position (`ttt_attention`), not an additive mask.
        out = ttt_attention(q, keys, values, query_index, mask, attn.scaling, softcap)  # [B, heads, S, d]
        self.current[layer.layer_idx] = (k, v)
        return out.transpose(1, 2).reshape(*q.shape[:1], q.shape[2], -1)  # [B, S, heads*d]

    def next_step(self) -> TTTAttention:
        """The next step's attention: the earlier steps' keys/values and this step's, per layer."""
        if any(kv is None for kv in self.current):
            raise ValueError("The TTT step has not run every draft layer; run the draft's forward with it first.")
        return TTTAttention([[*earlier, *kv] for earlier, kv in zip(self.earlier, self.current)])
