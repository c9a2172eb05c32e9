"""The draft's one decoder layer: the target family's attention, MLP and norms, q/k/v widened to 2H.

Input is ``[input_layernorm(embed(x)) | hidden_norm(g)]`` (``[B, S, 2H]``); the residual is ``g`` (or
``hidden_norm(g)`` with ``norm_before_residual``). `qkv` exposes the projection and rotation alone, for the
training-time-test loop, which attends with its own mask structure.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle3_hf.modeling._compat import cache_kwargs
from eagle3_hf.modeling.configuration_eagle3 import Eagle3DraftConfig
from eagle3_hf.modeling.families import get_family

__all__ = ["Eagle3DecoderLayer"]


class Eagle3DecoderLayer(nn.Module):
    """The draft's single decoder layer, built from the target family's transformers classes."""

    def __init__(self, config: Eagle3DraftConfig) -> None:
        super().__init__()
        family = get_family(config.layer_type)
        layer_config = config.layer_config()
        hidden = config.hidden_size
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = family.attention_class(layer_config, layer_idx=0)
        # EAGLE-3 widens q/k/v to read [normed embedding | normed hidden] (2H wide).
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        self.mlp = family.mlp_class(layer_config)
        norm = family.norm_class
        self.input_layernorm = norm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = norm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = norm(hidden, eps=config.rms_norm_eps)

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (attention input `[B, S, 2H]`, residual `[B, S, H]`)."""
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

        The same computation the family's attention class does before its attention kernel; the
        training-time-test loop uses it to attend with its own cheap mask structure.
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
    ) -> torch.Tensor:
        x, residual = self.layer_input(embeds, hidden)
        attn_output, _ = self.self_attn(
            hidden_states=x,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **cache_kwargs(cache),
        )
        return self.finish(residual, attn_output)
