"""Training-time test (TTT): the EAGLE-3 training forward and its loss.

Alignment (EAGLE-3 reference §3, with the loss mask aligned to the predicted token, pitfall 1). A batch holds tokens
``x`` ``[B, S]``, target features ``h`` ``[B, S, 3Ht]`` (the taps at each position), target logits (the full
``[B, S, V]``, or the top-k ``[B, S, k]`` with their ids, `target_top_k`) and ``loss_mask`` ``[B, S]``:

* position ``t`` pairs ``(h_t, x_{t+1})``; at TTT step ``j`` it is fed token ``x_{t+1+j}`` (teacher forcing) at RoPE
  position ``t + j``, with ``g_0 = fc(h_t)`` and ``g_{j+1}`` the draft's own output of step ``j``;
* it predicts ``x_{t+2+j}``, whose target distribution is ``softmax(target_logits[t+1+j])`` over the draft vocabulary
  (the target logits at the ``t2d`` ids among those kept, renormalised; `draft_vocab_targets`);
* it is supervised iff ``loss_mask[t+2+j] == 1``: the mask is read at the predicted token, so the first assistant
  token is learnt, and positions whose prediction would fall past the end of the row (or on padding) never count.

Attention at step ``j``: query ``(t, j)`` sees the step-0 keys at positions ``<= t`` (causal, and padding) plus the
keys of steps ``1..j`` at position ``t`` only, under one joint softmax. This is exactly what inference-time drafting
computes when it prefills the pairs up to ``t`` and then feeds its own state back ``j`` times (see
`tests/test_ttt.py`). The other steps add ``j`` diagonal scores (``q·k_i`` per position) to the causal block, merged
in log space chunk by chunk of queries (`eagle3_hf.training.ttt_attention`): memory O(S), never an ``[S, S]`` score
tensor. Packed rows (``position_ids`` restarting per conversation) keep each conversation's attention, RoPE
positions and loss to itself (`eagle3_hf.training.collator`). Each step is one call of
the draft's own forward with that attention (`eagle3_hf.training.ttt_layer.TTTAttention`): a deeper draft runs all its
layers at every step, each attending this way over its own earlier steps' keys/values; layer ``l > 0`` reads layer
``l - 1``'s output of the same step.

Loss: per step, soft-label cross entropy against the target distribution, averaged over the step's SUPERVISED
positions that carry loss (see below); total ``sum_j decay**j * Loss_j``. The official code divides by ``B·S``
instead, which makes the loss scale (hence the effective learning rate) depend on prompt length and padding; a
per-supervised-token mean does not. As in the official code and SpecForge, positions whose target top token lies
outside the draft vocabulary carry no loss: greedy verification rejects every draft token there, so training them
towards the best in-vocabulary token only takes capacity. They still count in the accuracy, as misses: accuracy is measured against the target's top
token over its FULL vocabulary, which is what acceptance measures.

Cost: the head over a 16k-id draft vocabulary and its softmax are most of a step's work, and neither prompts nor
out-of-vocabulary positions need them, so training runs the head inside the loss on the rows that carry loss
(``ttt_forward(return_hidden=True)`` + ``ttt_loss(head=...)``), and top-k soft labels stay sparse (``[M, k]``).
The trainer goes one step further (``ttt_loss(fused_head=...)``, `eagle3_hf.training.head_loss`): one call runs the
head and the loss over every step's rows at once, with the same loss and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput

from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.training.soft_labels import _sparse_targets, draft_vocab_targets, target_top_k
from eagle3_hf.training.ttt_attention import attention_segments
from eagle3_hf.training.ttt_layer import TTTAttention

# (rows [M, H], p [M, k] or [M, Vd], columns [M, k] or None) -> (row_loss [M], argmax draft id [M])
FusedHead = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]

__all__ = [
    "TTTOutput",
    "draft_vocab_targets",
    "shift_left",
    "simulated_acceptance_length",
    "step_alignment",
    "target_top_k",
    "ttt_forward",
    "ttt_loss",
]


@dataclass
class TTTOutput(ModelOutput):
    """Result of [`ttt_loss`].

    Args:
        loss: scalar, ``sum_j decay**j * step_losses[j]`` (carries the graph).
        step_losses: ``[K]`` detached per-step losses (mean over the supervised in-vocabulary positions; 0 if none).
        step_correct: ``[K]`` supervised positions where the draft's top token (as a target id) is the target's
            top token over its full vocabulary.
        step_supervised: ``[K]`` number of supervised positions per step.
        step_in_vocab: ``[K]`` supervised positions whose target top token is in the draft vocabulary (the only ones
            that carry loss).
    """

    loss: torch.Tensor | None = None
    step_losses: torch.Tensor | None = None
    step_correct: torch.Tensor | None = None
    step_supervised: torch.Tensor | None = None
    step_in_vocab: torch.Tensor | None = None

    @property
    def step_accuracy(self) -> torch.Tensor:
        """``[K]`` share of supervised positions predicted right, out-of-vocabulary ones as misses (0 if none)."""
        return self.step_correct.float() / self.step_supervised.clamp(min=1).float()

    @property
    def step_coverage(self) -> torch.Tensor:
        """``[K]`` share of supervised positions whose target top token the draft vocabulary holds (0 if none)."""
        return self.step_in_vocab.float() / self.step_supervised.clamp(min=1).float()


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


def ttt_forward(
    draft: nn.Module,
    input_ids: torch.Tensor,
    target_hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    ttt_length: int = 7,
    return_hidden: bool = False,
    position_ids: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    r"""Run `ttt_length` TTT steps of `draft`; return the per-step draft logits, each ``[B, S, Vd]``.

    Args:
        draft: the draft, a PEFT model around it (its base model is called, LoRA layers active), or DDP around
            either: each step is one call of it, so the forward of the module DDP wraps runs (and syncs gradients).
        input_ids: ``[B, S]`` the tokens ``x`` (NOT shifted: position ``t`` of step ``j`` is fed ``x_{t+1+j}``).
        target_hidden_states: ``[B, S, 3*Ht]`` target taps at each position.
        attention_mask: ``[B, S]`` 1 on real tokens (right padding); `None` means no padding.
        ttt_length: number of steps K (step ``j`` predicts ``x_{t+2+j}``).
        return_hidden: return each step's head input (the normed state, ``[B, S, H]``) instead of its logits; pass
            ``head=draft.lm_head`` to `ttt_loss`, which then runs the head on the supervised positions only (the
            head over a draft vocabulary of 16k ids is most of a step's cost, and prompts carry no loss).
        position_ids: ``[B, S]`` for packed rows, each conversation's positions from 0: attention stays inside each
            conversation and RoPE restarts with it (pass the same to `ttt_loss`); `None`: ``0..S-1``.

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
    model, draft = _step_model(draft)
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
    # Which step-0 keys each query sees: a conversation id per position (`TTTAttention` reads it as its mask).
    segments = attention_segments(attention_mask, position_ids, batch, seq, target_hidden_states.device)  # [B, S]
    positions = torch.arange(seq, device=input_ids.device)[None].expand(batch, seq)
    if position_ids is not None:  # packed rows: RoPE restarts with each conversation
        positions = position_ids.to(input_ids.device)
    attention = TTTAttention([[] for _ in draft.draft_layers()])  # per layer: k, v of each earlier step
    features, hidden = target_hidden_states.to(dtype), None  # step 0 starts from g_0 = fc(h_t), later ones from g_j
    outputs = []
    for step in range(ttt_length):
        # Teacher forcing: step j at position t reads x_{t+1+j}; positions past the end read id 0 (never supervised).
        out = model(
            shift_left(input_ids, 1 + step),
            target_hidden_states=features if step == 0 else None,
            hidden_states=hidden,
            position_ids=positions + step,  # RoPE position t + j
            attention_mask=segments,
            attention=attention,
            skip_logits=return_hidden,
        )
        outputs.append(out.normed_hidden_state if return_hidden else out.logits)
        hidden = out.last_hidden_state
        attention = attention.next_step()
    return outputs


def _step_model(model: nn.Module) -> tuple[nn.Module, Eagle3DraftModel]:
    """(what each TTT step calls, the draft): DDP itself (its forward syncs gradients), else the draft (PEFT's base)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    draft = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return (model if inner is not model else draft), draft


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor | None = None,
    decay: float = 0.8,
    target_ids: torch.Tensor | None = None,
    head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fused_head: FusedHead | None = None,
    position_ids: torch.Tensor | None = None,
) -> TTTOutput:
    """The TTT loss, and per-step accuracy against the target's full-vocabulary top token.

    Args:
        step_logits: per step ``[B, S, Vd]`` draft logits (from `ttt_forward`).
        target_logits: ``[B, S, V]`` full target logits, or ``[B, S, k]`` the target's top-k logits (with
            `target_ids`, e.g. from `target_top_k` or offline features).
        loss_mask: ``[B, S]`` 1 where the token is supervised (assistant tokens), 0 elsewhere and on padding.
        t2d: ``[V]`` bool draft-vocabulary membership; may be left out only when the draft predicts all ``V`` ids.
        decay: weight of step ``j`` is ``decay**j``.
        target_ids: ``[B, S, k]`` the target ids of the `target_logits` columns (top-k); `None` when they are the
            full vocabulary.
        head: with `ttt_forward(..., return_hidden=True)`'s head inputs as `step_logits`, the draft head
            (``draft.lm_head``, ``[M, H] -> [M, Vd]``), run here on the supervised in-vocabulary positions only.
        fused_head: instead of `head`, the head and per-row loss in one call over every step's rows at once,
            ``(rows [M, H], p, columns) -> (row_loss [M], argmax [M])`` (`head_cross_entropy` with the head's
            weight): the same loss and gradients, without the per-step ``[M, Vd]`` log-softmax passes.
        position_ids: ``[B, S]`` of packed rows (`ttt_forward`'s): a position predicting a token of the next
            conversation is not supervised, as past the end of a padded row.

    A supervised position whose target top token lies outside the draft vocabulary carries no loss (greedy
    verification rejects every draft token there) but counts as a miss in the accuracy, so that ``step_accuracy``
    is the share of the target's tokens the draft gets, as acceptance measures it; ``step_coverage`` is the share of
    supervised positions whose target top token the draft vocabulary holds.
    """
    if not step_logits:
        raise ValueError("step_logits is empty; run at least one TTT step.")
    if head is not None and fused_head is not None:
        raise ValueError("Pass ttt_loss a head or a fused_head, not both.")
    on_rows = head is not None or fused_head is not None  # step_logits are head inputs
    if on_rows and t2d is None:
        raise ValueError("ttt_loss with a head needs t2d (the draft vocabulary over the target's ids).")
    draft_vocab = int(t2d.sum()) if on_rows else step_logits[0].shape[-1]
    if t2d is None:
        if target_ids is not None or target_logits.shape[-1] != draft_vocab:
            raise ValueError(
                f"The draft predicts {draft_vocab} tokens: pass t2d (its vocabulary over the target's ids) to "
                "compare it with the target."
            )
        t2d = torch.ones(draft_vocab, dtype=torch.bool)
    t2d = t2d.to(step_logits[0].device)
    if int(t2d.sum()) != draft_vocab:
        raise ValueError(f"t2d marks {int(t2d.sum())} ids but the draft predicts {draft_vocab} tokens.")
    if target_ids is None and target_logits.shape[-1] != t2d.numel():
        raise ValueError(
            f"target_logits has {target_logits.shape[-1]} columns; expected the target vocabulary ({t2d.numel()}), "
            "or pass target_ids for top-k logits."
        )
    if target_ids is not None and target_ids.shape != target_logits.shape:
        raise ValueError(
            f"target_ids has shape {tuple(target_ids.shape)}, expected that of target_logits "
            f"{tuple(target_logits.shape)}."
        )
    if loss_mask.shape != target_logits.shape[:2]:
        raise ValueError(
            f"loss_mask has shape {tuple(loss_mask.shape)}, expected {tuple(target_logits.shape[:2])} (batch, seq)."
        )
    draft_to_target = torch.nonzero(t2d)[:, 0]  # [Vd] target id of each draft id (d2t as absolute ids)
    seq = loss_mask.shape[1]
    segments = None
    if position_ids is not None:
        segments = attention_segments(None, position_ids.to(loss_mask.device), *loss_mask.shape, loss_mask.device)
    steps = [
        _step_targets(outputs, step, target_logits, target_ids, loss_mask, t2d, seq, segments)
        for step, outputs in enumerate(step_logits)
    ]
    if fused_head is not None:
        losses, predictions = _fused_step_losses(steps, fused_head)
    else:
        losses, predictions = [], []
        for rows, _, _, columns, p, _ in steps:
            draft_logits = head(rows) if head is not None else rows  # [M, Vd]
            if draft_logits.shape[-1] != draft_vocab:
                raise ValueError(f"The head gives {draft_logits.shape[-1]} logits; t2d marks {draft_vocab} draft ids.")
            log_q = torch.log_softmax(draft_logits.float(), dim=-1)  # [M, Vd]
            picked = log_q if columns is None else log_q.gather(1, columns)  # [M, Vd] or [M, k]
            losses.append(-(p * picked).sum() / max(rows.shape[0], 1))
            predictions.append(log_q.detach().max(-1).indices)  # [M]; max is faster than argmax here
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    correct, supervised, in_vocab_counts = [], [], []
    for step, ((_, top, in_vocab, _, _, selected), step_loss, predicted) in enumerate(zip(steps, losses, predictions)):
        total = total + decay**step * step_loss
        correct.append((draft_to_target[predicted] == top[in_vocab]).sum())
        supervised.append(selected)
        in_vocab_counts.append(in_vocab.sum())
    return TTTOutput(
        loss=total,
        step_losses=torch.stack([loss.detach() for loss in losses]),
        step_correct=torch.stack(correct),
        step_supervised=torch.stack(supervised),
        step_in_vocab=torch.stack(in_vocab_counts),
    )


_StepTargets = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


def _step_targets(
    outputs: torch.Tensor,
    step: int,
    target_logits: torch.Tensor,
    target_ids: torch.Tensor | None,
    loss_mask: torch.Tensor,
    t2d: torch.Tensor,
    seq: int,
    segments: torch.Tensor | None = None,
) -> _StepTargets:
    """One step's rows that carry loss and their labels: ``(rows [M, Vd or H], top [N], in_vocab [N], columns [M, k]
    or None, p [M, k or Vd], number of supervised positions N)``."""
    draft_pos, target_rows, mask_pos = step_alignment(seq, step)
    selected = loss_mask[:, mask_pos].bool()  # [B, n]
    if segments is not None:  # packed rows: the predicted token must be of the position's own conversation
        selected &= segments[:, mask_pos] == segments[:, draft_pos]
    # Gather the supervised positions first: the head and softmaxes then cost O(#supervised * Vd), not O(B*S*Vd).
    rows = outputs[:, draft_pos][selected]  # [N, Vd] logits, or [N, H] head inputs
    targets = target_logits[:, target_rows][selected]
    ids = None if target_ids is None else target_ids[:, target_rows][selected]
    if ids is not None:
        top, in_vocab, columns, p = _sparse_targets(targets, ids, t2d)
    else:
        (top, in_vocab, p), columns = draft_vocab_targets(targets, None, t2d), None
    # An out-of-vocabulary target is a certain miss and carries no loss: only in-vocabulary rows need the head.
    return rows[in_vocab], top, in_vocab, columns, p, selected.sum()


def _fused_step_losses(
    steps: list[_StepTargets], fused_head: FusedHead
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every step's mean loss and argmax from one `fused_head` call over all their rows (one cast of the head's
    weight, one gradient for it, and larger matmuls than step by step)."""
    counts = [rows.shape[0] for rows, *_ in steps]
    rows = torch.cat([rows for rows, *_ in steps])  # [sum M, H]
    p = torch.cat([p for *_, p, _ in steps])
    columns = None if steps[0][3] is None else torch.cat([s[3] for s in steps])
    row_loss, predicted = fused_head(rows, p, columns)  # [sum M] x2
    losses = [part.sum() / max(n, 1) for part, n in zip(row_loss.split(counts), counts)]
    return losses, list(predicted.split(counts))


def simulated_acceptance_length(step_accuracy: torch.Tensor | list[float]) -> float:
    """Chain acceptance length implied by per-step accuracies: ``1 + sum_j prod_{i<=j} acc_i`` (bonus included)."""
    acc = torch.as_tensor(step_accuracy, dtype=torch.float64)
    return float(1 + torch.cumprod(acc, dim=0).sum())
