"""Target-derived initialisation of a fresh draft: start from what the target already knows.

The draft's head predicts the target's next-next token from a state that (after `fc` and one layer) plays the role of
the target's last hidden state, so the target's own output-head rows for the draft vocabulary and its final norm are
a far better start than random values (the official trainer and SpecForge both start from the target's head). Each
copy happens only where the shapes match; otherwise it is skipped with a log line, so the default stays safe for
drafts whose width differs from the target's.

`init_head_from_target` copies the head and the final norm; `init_layer_from_target` (separate, off by default)
copies a target decoder layer's MLP, attention output projection and norms into the draft's first layer (a deeper
draft's other layers keep their initialisation);
`remap_draft_vocab` moves a trained draft to another vocabulary: shared tokens keep their rows, new ones start at zero.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from eagle3_hf.modeling.checkpoints import whole_tensor
from eagle3_hf.modeling.head import Eagle3Head
from eagle3_hf.modeling.vocab_mapping import draft_to_target_ids, validate_vocab_mapping

logger = logging.getLogger(__name__)

__all__ = ["init_head_from_target", "init_layer_from_target", "remap_draft_vocab"]


def _decoder(target: PreTrainedModel) -> nn.Module:
    """The target's decoder stack (the module holding ``layers`` and the final ``norm``)."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        raise ValueError(
            f"Cannot find the decoder layers of {type(target).__name__}: expected `get_decoder()` or `.model` "
            "with `.layers`."
        )
    return decoder


def _copy(name: str, destination: torch.Tensor, source: torch.Tensor, copied: list[str]) -> None:
    source = whole_tensor(source)  # a weight of an FSDP2-sharded target
    if tuple(destination.shape) != tuple(source.shape):
        logger.warning(
            "Target-derived init: %s skipped, the draft's is %s and the target's %s.",
            name,
            tuple(destination.shape),
            tuple(source.shape),
        )
        return
    with torch.no_grad():
        destination.copy_(source.detach().to(destination.device, destination.dtype))
    copied.append(name)


def init_head_from_target(draft: Any, target: PreTrainedModel) -> list[str]:
    """Copy the target's output-head rows at the draft vocabulary's ids into ``lm_head``, and its final norm into
    ``norm``. Returns the names of the draft weights written.

    The draft vocabulary must be installed first (`set_draft_vocab`): row ``i`` of the draft head becomes the
    target's row for target id ``d2t``-mapped ``i``.

    Example:

    ```python
    >>> draft.set_draft_vocab(vocab.d2t, vocab.t2d)  # doctest: +SKIP
    >>> init_head_from_target(draft, target)  # doctest: +SKIP
    ['lm_head.weight', 'norm.weight']
    ```
    """
    head = target.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(target).__name__} has no output embeddings (get_output_embeddings() is None).")
    ids = draft_to_target_ids(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device), draft.d2t)
    copied: list[str] = []
    rows = whole_tensor(head.weight)
    _copy("lm_head.weight", draft.lm_head.weight, rows[ids.to(rows.device)], copied)
    norm = getattr(_decoder(target), "norm", None)
    if norm is not None and hasattr(norm, "weight"):
        _copy("norm.weight", draft.norm.weight, norm.weight, copied)
    else:
        logger.warning("Target-derived init: the target has no final norm weight; the draft's norm is kept.")
    logger.info("Target-derived init: copied %s from the target.", ", ".join(copied) or "nothing")
    return copied


def init_layer_from_target(draft: Any, target: PreTrainedModel, layer_index: int = -1) -> list[str]:
    """Copy target decoder layer `layer_index`'s MLP, attention ``o_proj`` and norms into the draft's first layer
    (``midlayer``); the upper layers of a deeper draft are left as they are.

    The draft's ``input_layernorm`` (over the token embedding) and ``hidden_norm`` (over the fused state) both take
    the target layer's ``input_layernorm``; q/k/v are not copied (the draft's are twice as wide). Returns the names
    of the draft weights written; weights whose shapes differ are skipped with a log line.
    """
    layers = _decoder(target).layers
    if not -len(layers) <= layer_index < len(layers):
        raise ValueError(f"layer_index must index the target's {len(layers)} layers, got {layer_index}.")
    source, layer = layers[layer_index], draft.midlayer
    copied: list[str] = []
    for prefix, theirs, ours in (
        ("mlp", source.mlp, layer.mlp),
        ("self_attn.o_proj", source.self_attn.o_proj, layer.self_attn.o_proj),
    ):
        own = dict(ours.named_parameters())
        for name, param in theirs.named_parameters():
            if name in own:
                _copy(f"midlayer.{prefix}.{name}", own[name], param, copied)
            else:
                logger.warning("Target-derived init: the draft layer has no %s.%s; skipped.", prefix, name)
    norms = [
        ("input_layernorm", "input_layernorm"),
        ("input_layernorm", "hidden_norm"),
        ("post_attention_layernorm", "post_attention_layernorm"),
    ]
    for their_norm, our_norm in norms:
        if hasattr(source, their_norm):
            _copy(
                f"midlayer.{our_norm}.weight",
                getattr(layer, our_norm).weight,
                getattr(source, their_norm).weight,
                copied,
            )
    logger.info("Target-derived init: copied %s from target layer %d.", ", ".join(copied) or "nothing", layer_index)
    return copied


def remap_draft_vocab(draft: Any, d2t: torch.Tensor, t2d: torch.Tensor) -> int:
    """Move a (trained) draft to another draft vocabulary, in place; returns how many ids the two share.

    The head of a token in both vocabularies keeps its trained row (so its logit is unchanged); a new token's row
    starts at zero, a logit of 0 until training moves it, so the remapped draft drafts what it drafted before
    wherever its best shared logit is positive. Rows copied from the target's head do not do that: a trained
    SmolLM2 draft's rows are ~0.6x the size of the target's rows of the same tokens, and even scaled to match,
    the 8,848 new (mostly rare) tokens took enough top places to halve step-0 accuracy on MT-bench (0.48 -> 0.22;
    zero rows: 0.48). The new vocabulary may be larger, smaller or just different.
    """
    validate_vocab_mapping(d2t, t2d, draft.config.vocab_size)
    old_head = draft.lm_head.weight  # [Vd_old, H]
    old_ids = draft_to_target_ids(torch.arange(old_head.shape[0], device=draft.d2t.device), draft.d2t)
    new_ids = draft_to_target_ids(torch.arange(d2t.numel()), d2t.long().cpu()).to(old_head.device)
    head = Eagle3Head(old_head.shape[1], d2t.numel(), bias=False, device=old_head.device, dtype=old_head.dtype)
    with torch.no_grad():
        head.weight.zero_()
    # old_index[target id] = its row in the old head, -1 where the old vocabulary did not hold it
    old_index = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=old_head.device)
    old_index[old_ids.to(old_head.device)] = torch.arange(old_head.shape[0], device=old_head.device)
    source = old_index[new_ids]
    shared = source >= 0
    with torch.no_grad():
        head.weight[shared] = old_head.detach()[source[shared]]
    head.weight.requires_grad_(old_head.requires_grad)
    draft.lm_head = head
    draft.config.draft_vocab_size = d2t.numel()
    draft.register_buffer("d2t", d2t.to(draft.t2d.device, torch.long).clone())
    draft.t2d.copy_(t2d.to(draft.t2d.device, torch.bool))
    logger.info(
        "Draft vocabulary remapped: %d ids kept their head rows, %d new ones start at zero.",
        int(shared.sum()),
        int((~shared).sum()),
    )
    return int(shared.sum())
