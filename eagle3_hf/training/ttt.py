"""Training-time test (TTT): the EAGLE-3 training forward and its loss.

Alignment (EAGLE-3 reference §3, with the loss mask aligned to the predicted token, pitfall 1). A batch holds tokens
``x`` ``[B, S]``, target features ``h`` ``[B, S, 3Ht]`` (the taps at each position), target logits ``[B, S, V]`` (or
already restricted to the draft vocabulary, ``[B, S, Vd]``) and ``loss_mask`` ``[B, S]``:

* position ``t`` pairs ``(h_t, x_{t+1})``; at TTT step ``j`` it is fed token ``x_{t+1+j}`` (teacher forcing) at RoPE
  position ``t + j``, with ``g_0 = fc(h_t)`` and ``g_{j+1}`` the draft's own output of step ``j``;
* it predicts ``x_{t+2+j}``, whose target distribution is ``softmax(target_logits[t+1+j])`` over the draft vocabulary
  (the target logits at the ``t2d`` ids, renormalised);
* it is supervised iff ``loss_mask[t+2+j] == 1``: the mask is read at the predicted token, so the first assistant
  token is learnt, and positions whose prediction would fall past the end of the row (or on padding) never count.

Attention at step ``j``: query ``(t, j)`` sees the step-0 keys at positions ``<= t`` (causal, and padding) plus the
keys of steps ``1..j`` at position ``t`` only, under one joint softmax. This is exactly what inference-time drafting
computes when it prefills the pairs up to ``t`` and then feeds its own state back ``j`` times (see
`tests/test_ttt.py`). The causal block is an ``[S, S]`` score matrix and the other steps add ``j`` diagonal columns
(``q·k_i`` per position), so the cost is O(S·(S+j)), never the dense ``[S, ttt·S]`` mask.

Loss: per step, soft-label cross entropy against the target distribution, averaged over the step's SUPERVISED
positions; total ``sum_j decay**j * Loss_j``. The official code divides by ``B·S`` instead, which makes the loss scale
(hence the effective learning rate) depend on prompt length and padding; a per-supervised-token mean does not. It
also drops positions whose target argmax lies outside the draft vocabulary; here every supervised position counts
(its target is still a proper distribution over the draft vocabulary).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput

from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.training.distributed import routed_forward

__all__ = [
    "TTTOutput",
    "restrict_to_draft_vocab",
    "shift_left",
    "simulated_acceptance_length",
    "step_alignment",
    "ttt_forward",
    "ttt_loss",
]


@dataclass
class TTTOutput(ModelOutput):
    """Result of [`ttt_loss`].

    Args:
        loss: scalar, ``sum_j decay**j * step_losses[j]`` (carries the graph).
        step_losses: ``[K]`` detached per-step losses (mean over supervised positions; 0 where none).
        step_correct: ``[K]`` supervised positions where the draft argmax equals the target argmax.
        step_supervised: ``[K]`` number of supervised positions per step.
    """

    loss: torch.Tensor | None = None
    step_losses: torch.Tensor | None = None
    step_correct: torch.Tensor | None = None
    step_supervised: torch.Tensor | None = None

    @property
    def step_accuracy(self) -> torch.Tensor:
        """``[K]`` share of supervised positions predicted right (0 where a step has none)."""
        return self.step_correct.float() / self.step_supervised.clamp(min=1).float()


def shift_left(x: torch.Tensor, n: int, fill: int | float = 0) -> torch.Tensor:
    """``y[:, t] = x[:, t + n]``, filled with `fill` past the end (dim 1 is the sequence)."""
    if n == 0:
        return x
    tail = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], tail], dim=1)


def step_alignment(seq_len: int, step: int) -> tuple[slice, slice, slice]:
    """Slices (draft positions ``t``, target-logit rows ``t+1+step``, loss-mask entries ``t+2+step``) of one step.

    Only positions whose predicted token ``x_{t+2+step}`` lies inside the row are kept (``t <= S-3-step``).
    """
    n = max(seq_len - 2 - step, 0)
    return slice(0, n), slice(1 + step, 1 + step + n), slice(2 + step, 2 + step + n)


def restrict_to_draft_vocab(target_logits: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target logits over the draft vocabulary ``[..., Vd]``: columns at the `t2d` ids (ascending = draft id order).

    Logits that already have ``Vd`` columns (offline features store them restricted) are returned as they are.
    """
    vocab, draft_vocab = t2d.numel(), int(t2d.sum())
    if target_logits.shape[-1] == draft_vocab:
        return target_logits
    if target_logits.shape[-1] != vocab:
        raise ValueError(
            f"target_logits has {target_logits.shape[-1]} columns; expected the target vocabulary ({vocab}) or the "
            f"draft vocabulary ({draft_vocab})."
        )
    return target_logits[..., t2d.to(target_logits.device)]


def _joint_attention(
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


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, kv, S, d]`` -> ``[B, kv*groups, S, d]`` (GQA: each kv head serves `groups` query heads)."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def _ttt_step(draft: Eagle3DraftModel, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_layer_step` of `draft`'s layer, run through the layer's call (not its methods): a layer sharded by FSDP2
    gathers its weights and reduces their gradients in the hooks of that call."""
    layer = draft.midlayer
    with routed_forward(layer, functools.partial(_layer_step, layer)):
        return layer(*tensors)


def _layer_step(
    layer: nn.Module,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mask: torch.Tensor,
    *previous: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One TTT step: the draft layer over ``[embeds | hidden]`` attending to the earlier steps' keys/values.

    `previous` is ``(k_0, v_0, k_1, v_1, ...)`` of the earlier steps, ``[B, kv, S, d]`` each (kv heads, not repeated).
    Returns (layer output ``[B, S, H]``, this step's k and v). A plain-tensor signature so that activation
    checkpointing can recompute it.
    """
    attn = layer.self_attn
    x, residual = layer.layer_input(embeds, hidden)  # [B, S, 2H], [B, S, H]
    q, k, v = layer.qkv(x, (cos, sin))  # [B, heads, S, d], [B, kv, S, d] x2
    keys = [*previous[0::2], k]
    values = [*previous[1::2], v]
    groups = attn.num_key_value_groups
    out = _joint_attention(
        q,
        [_repeat_kv(t, groups) for t in keys],
        [_repeat_kv(t, groups) for t in values],
        mask,
        attn.scaling,
        getattr(attn, "attn_logit_softcapping", None),
    )
    out = out.transpose(1, 2).reshape(*embeds.shape[:-1], -1)  # [B, S, heads*d]
    return layer.finish(residual, attn.o_proj(out)), k, v


def ttt_forward(
    draft: Eagle3DraftModel,
    input_ids: torch.Tensor,
    target_hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    ttt_length: int = 7,
) -> list[torch.Tensor]:
    r"""Run `ttt_length` TTT steps of `draft`; return the per-step draft logits, each ``[B, S, Vd]``.

    Args:
        draft: the draft (a PEFT-wrapped one is unwrapped; its LoRA layers stay active).
        input_ids: ``[B, S]`` the tokens ``x`` (NOT shifted: position ``t`` of step ``j`` is fed ``x_{t+1+j}``).
        target_hidden_states: ``[B, S, 3*Ht]`` target taps at each position.
        attention_mask: ``[B, S]`` 1 on real tokens (right padding); `None` means no padding.
        ttt_length: number of steps K (step ``j`` predicts ``x_{t+2+j}``).

    Logits of step ``j`` at position ``t`` are what inference-time drafting produces after prefilling pairs up to
    ``t`` and feeding back its own state ``j`` times with the true tokens.

    Example:

    ```python
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from eagle3_hf import Eagle3DraftModel
    >>> from eagle3_hf.training.ttt import ttt_forward, ttt_loss
    >>> target = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    ...                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    >>> draft = Eagle3DraftModel.from_target(target)
    >>> ids = torch.randint(0, 100, (2, 10))
    >>> out = target(ids, output_hidden_states=True)
    >>> logits = ttt_forward(draft, ids, draft.target_features(out.hidden_states), ttt_length=3)
    >>> len(logits), logits[0].shape
    (3, torch.Size([2, 10, 100]))
    >>> ttt_loss(logits, out.logits.detach(), torch.ones(2, 10), draft.t2d).loss.shape
    torch.Size([])
    ```
    """
    if hasattr(draft, "get_base_model"):  # peft.PeftModel
        draft = draft.get_base_model()
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}.")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}.")
    if target_hidden_states.shape[:2] != input_ids.shape:
        raise ValueError(
            f"target_hidden_states has shape {tuple(target_hidden_states.shape)}; expected [batch, seq] = "
            f"{tuple(input_ids.shape)} followed by 3*target_hidden_size."
        )
    if not draft.embedding_loaded:
        raise ValueError("The draft has no token embedding; load it with `draft.load_target_embedding(target)`.")
    batch, seq = input_ids.shape
    dtype = draft.fc.weight.dtype
    hidden = draft.fuse(target_hidden_states.to(dtype))  # g_0 [B, S, H]
    # Under autocast the layer computes in bf16/fp16: build the mask and RoPE tables in that dtype.
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    mask = draft.causal_mask(batch, seq, 0, attention_mask, compute_dtype, hidden.device)  # [B, 1, S, S]
    positions = torch.arange(seq, device=input_ids.device)[None].expand(batch, seq)
    checkpointing = draft.gradient_checkpointing and draft.training and torch.is_grad_enabled()
    previous: list[torch.Tensor] = []
    logits = []
    for step in range(ttt_length):
        # Teacher forcing: step j at position t reads x_{t+1+j}; positions past the end read id 0 (never supervised).
        embeds = draft.embed_tokens(shift_left(input_ids, 1 + step)).to(dtype)
        cos, sin = draft.rotary_emb(hidden, positions + step)  # RoPE position t + j
        args = (draft, embeds, hidden, cos, sin, mask, *previous)
        if checkpointing:
            out, k, v = draft._gradient_checkpointing_func(_ttt_step, *args)
        else:
            out, k, v = _ttt_step(*args)
        previous += [k, v]
        normed = draft.norm(out)
        logits.append(draft.lm_head(normed))
        hidden = normed if draft.config.norm_output else out
    return logits


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor | None = None,
    decay: float = 0.8,
) -> TTTOutput:
    """The TTT loss and per-step accuracy counts.

    Args:
        step_logits: per step ``[B, S, Vd]`` draft logits (from `ttt_forward`).
        target_logits: ``[B, S, V]`` target logits (restricted through `t2d`) or ``[B, S, Vd]`` already restricted.
        loss_mask: ``[B, S]`` 1 where the token is supervised (assistant tokens), 0 elsewhere and on padding.
        t2d: ``[V]`` bool draft-vocabulary membership; needed only when `target_logits` has ``V`` columns.
        decay: weight of step ``j`` is ``decay**j``.
    """
    if not step_logits:
        raise ValueError("step_logits is empty; run at least one TTT step.")
    if t2d is not None:
        target_logits = restrict_to_draft_vocab(target_logits, t2d)
    draft_vocab = step_logits[0].shape[-1]
    if target_logits.shape[-1] != draft_vocab:
        raise ValueError(
            f"target_logits has {target_logits.shape[-1]} columns but the draft predicts {draft_vocab} tokens; "
            "pass t2d to restrict full-vocabulary target logits."
        )
    if loss_mask.shape != target_logits.shape[:2]:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)}, expected {tuple(target_logits.shape[:2])} (batch, seq)."
        )
    seq = loss_mask.shape[1]
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    losses, correct, supervised = [], [], []
    for step, logits in enumerate(step_logits):
        draft_pos, target_rows, mask_pos = step_alignment(seq, step)
        selected = loss_mask[:, mask_pos].bool()  # [B, n]
        # Gather the supervised positions first: the softmaxes then cost O(#supervised * Vd), not O(B*S*Vd).
        log_q = torch.log_softmax(logits[:, draft_pos][selected].float(), dim=-1)  # [N, Vd]
        target = target_logits[:, target_rows][selected].float()  # [N, Vd]
        p = torch.softmax(target, dim=-1)
        count = selected.sum()
        step_loss = -(p * log_q).sum() / count.clamp(min=1)
        total = total + decay**step * step_loss
        losses.append(step_loss.detach())
        correct.append((log_q.argmax(-1) == target.argmax(-1)).sum())
        supervised.append(count)
    return TTTOutput(
        loss=total,
        step_losses=torch.stack(losses),
        step_correct=torch.stack(correct),
        step_supervised=torch.stack(supervised),
    )


def simulated_acceptance_length(step_accuracy: torch.Tensor | list[float]) -> float:
    """Chain acceptance length implied by per-step accuracies: ``1 + sum_j prod_{i<=j} acc_i`` (bonus included)."""
    acc = torch.as_tensor(step_accuracy, dtype=torch.float64)
    return float(1 + torch.cumprod(acc, dim=0).sum())
