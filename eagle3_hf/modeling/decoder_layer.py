"""The draft's decoder layers: the target family's attention, MLP and norms; the first one's q/k/v widened to 2H.

Layer 0 (the EAGLE-3 layer, ``midlayer``) reads ``[input_layernorm(embed(x)) | hidden_norm(g)]`` (``[B, S, 2H]``);
its residual is ``g`` (or ``hidden_norm(g)`` with ``norm_before_residual``). Layers 1.. of a deeper draft are the
family's ordinary pre-norm layers over the layer below's output ``o``: input ``input_layernorm(o)`` (``[B, S, H]``),
residual ``o``, no ``hidden_norm`` (as vLLM's multi-layer Llama EAGLE-3 draft builds them).

Every caller runs the layer's own forward. What differs between them is the attention kernel and where its keys and
values live: by default the family's attention module with a transformers `Cache`; given a `DraftAttention`, the
layer computes q/k/v itself (`qkv`, the family's projections, norms and rotation) and the attention object attends
(decoding over a preallocated buffer of tree nodes, `eagle3_hf.generation.draft_step`; the training-time-test step's
joint attention over earlier steps' keys, `eagle3_hf.training.ttt_layer`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.families import get_family
from eagle3_hf.utils.compat import cache_kwargs

__all__ = ["DraftAttention", "Eagle3DecoderLayer"]


class DraftAttention(Protocol):
    """The attention a caller gives the draft's forward in place of the family's attention module and cache.

    Called once per decoder layer with that layer, its rotated query ``[B, heads, S, d]``, key and value
    ``[B, kv_heads, S, d]`` (kv heads, not repeated) and the `attention_mask` the forward was given (the object
    defines its form); returns the attention output ``[B, S, heads * d]``, before `o_proj`. It may keep the keys and
    values (``layer.layer_idx`` says whose they are). Under activation checkpointing a layer runs again in the backward
    pass with the same object, which must then compute the same output.
    """

    def __call__(
        self,
        layer: Eagle3DecoderLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor: ...


class Eagle3DecoderLayer(nn.Module):
    """One draft decoder layer, built from the target family's transformers classes.

    Args:
        config: the draft's config.
        layer_idx: its place in the draft, in `[0, config.num_hidden_layers)`: 0 is the EAGLE-3 layer (2H-wide
            q/k/v, `hidden_norm`), any other an ordinary layer of the family. Its attention caches under this index.
    """

    def __init__(self, config: Eagle3DraftConfig, layer_idx: int = 0) -> None:
        super().__init__()
        depth = config.num_hidden_layers
        if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < depth:
            raise ValueError(f"layer_idx must be an integer in [0, num_hidden_layers={depth}), got {layer_idx!r}.")
        family = get_family(config.layer_type)
        layer_config = config.layer_config()
        hidden = config.hidden_size
        self.layer_idx = layer_idx
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = family.attention_class(layer_config, layer_idx=layer_idx)
        if layer_idx == 0:
            # EAGLE-3 widens q/k/v to read [normed embedding | normed hidden] (2H wide).
            for name in ("q_proj", "k_proj", "v_proj"):
                old = getattr(self.self_attn, name)
                setattr(self.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.mlp = family.mlp_class(layer_config)
        norm = family.norm_class
        self.input_layernorm = norm(hidden, eps=config.rms_norm_eps)
        if layer_idx == 0:  # later layers read the layer below's output alone, normed by input_layernorm
            self.hidden_norm = norm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm(hidden, eps=config.rms_norm_eps)

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (attention input, residual `[B, S, H]`).

        Layer 0: input `[B, S, 2H]` from the token embeddings `embeds` and the fused or fed-back state `hidden`.
        Later layers: input `input_layernorm(hidden)` `[B, S, H]` over the layer below's output; `embeds` is unused.
        """
        if self.layer_idx > 0:
            return self.input_layernorm(hidden), hidden
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1), residual

    def finish(self, residual: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
        """Residual add after attention, then the MLP block."""
        hidden = residual + attn_output
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def qkv(
        self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projected, normed (q/k norms where the family has them) and rotated q, k, v `[B, heads, S, d]`.

        The same computation the family's attention class does before its attention kernel; the layer uses it when
        it is given a `DraftAttention`.
        """
        attn = self.self_attn
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape)
        k = attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        attention: DraftAttention | None = None,
    ) -> torch.Tensor:
        """The layer's output `[B, S, H]` over `embeds` `[B, S, H]` and `hidden` `[B, S, H]`: the family's attention
        module (with `cache`, a transformers `Cache`) by default, `attention` instead when given (`DraftAttention`:
        the layer's projected and rotated q/k/v, and `attention_mask` as the caller gave it)."""
        x, residual = self.layer_input(embeds, hidden)
        if attention is not None:
            q, k, v = self.qkv(x, position_embeddings)  # [B, heads, S, d], [B, kv, S, d] x2
            return self.finish(residual, self.self_attn.o_proj(attention(self, q, k, v, attention_mask)))
        attn_output, _ = self.self_attn(
            hidden_states=x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **cache_kwargs(cache),
        )
        return self.finish(residual, attn_output)
