"""Deeper drafts: grow a (trained) draft by decoder layers that start as the identity.

A draft's depth is `Eagle3DraftConfig.num_hidden_layers`: layer 0 is the EAGLE-3 layer (``midlayer``), layers 1..N-1
(``upper_layers``) are plain pre-norm decoder layers of the family. A new layer whose attention output projection
(``o_proj``) and MLP down projection (``down_proj``) are zero adds nothing to the residual stream: it passes its input
through unchanged, so the grown draft computes exactly what the old one did, while the gradients that reach those two
projections (through the layer's other, normally initialised weights) let training make the layer useful.
"""

from __future__ import annotations

import copy

import torch

from eagle3_hf.modeling.embedding import set_embedding, stored_embedding
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel

__all__ = ["grow_draft_layers"]


def grow_draft_layers(draft: Eagle3DraftModel, num_hidden_layers: int) -> Eagle3DraftModel:
    """A new draft of depth `num_hidden_layers` holding `draft`'s weights, whose logits equal `draft`'s.

    The old layers, head, vocabulary mapping (`d2t`/`t2d`), embedding (and whether it was loaded), `training_info`,
    dtype and device carry over; `draft` itself is left as it was. The new layers are initialised as a fresh draft's
    are, except ``self_attn.o_proj`` and ``mlp.down_proj`` (weights and any biases), which are zero so that each new
    layer starts as the identity. The same depth returns a copy.

    Raises `ValueError` for a depth that is not an integer >= 1 or is smaller than `draft`'s (layers are never
    dropped: that would change what the draft computes).

    Example:

    ```python
    >>> deeper = grow_draft_layers(draft, 2)  # doctest: +SKIP
    >>> len(deeper.upper_layers), deeper.config.num_hidden_layers  # doctest: +SKIP
    (1, 2)
    ```
    """
    if hasattr(draft, "get_base_model"):  # peft.PeftModel: its adapters would not carry over
        raise ValueError(
            "grow_draft_layers needs a plain Eagle3DraftModel; merge a PEFT draft first (merge_and_unload)."
        )
    old = draft.config.num_hidden_layers
    if not isinstance(num_hidden_layers, int) or isinstance(num_hidden_layers, bool) or num_hidden_layers < 1:
        raise ValueError(f"num_hidden_layers must be an integer >= 1, got {num_hidden_layers!r}.")
    if num_hidden_layers < old:
        raise ValueError(
            f"Cannot shrink a draft of {old} decoder layers to num_hidden_layers={num_hidden_layers}: only adding "
            "layers keeps what it learnt. Give a depth >= its own."
        )
    config = copy.deepcopy(draft.config)
    config.num_hidden_layers = num_hidden_layers
    config.validate()
    reference = draft.fc.weight
    grown = type(draft)(config).to(device=reference.device, dtype=reference.dtype)
    missing, unexpected = grown.load_state_dict(draft.state_dict(), strict=False)
    new_layers = grown.upper_layers[old - 1 :]  # upper_layers[i] is layer i + 1
    expected_missing = {
        f"upper_layers.{i}.{key}"
        for i in range(old - 1, num_hidden_layers - 1)
        for key in grown.upper_layers[i].state_dict()
    }
    lost = sorted(set(missing) - expected_missing)
    if unexpected or lost:  # a subclass with other weights would lose them silently
        raise ValueError(
            f"Could not carry {type(draft).__name__}'s weights over: missing {lost}, unexpected {sorted(unexpected)}."
        )
    with torch.no_grad():
        for layer in new_layers:
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                for param in projection.parameters():
                    param.zero_()
    # Keep which weights train: the embedding stays frozen, the rest follows the old draft's choice.
    trainable = {name: p.requires_grad for name, p in draft.named_parameters()}
    for name, param in grown.named_parameters():
        param.requires_grad_(trainable.get(name, True))
    grown.embedding_loaded = draft.embedding_loaded
    if draft.embedding_loaded:  # load_state_dict cast it to the grown draft's dtype: keep it exact, as it came in
        set_embedding(grown, stored_embedding(draft))
    grown.training_info = copy.deepcopy(draft.training_info)
    grown.train(draft.training)
    return grown
