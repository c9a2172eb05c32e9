"""A draft fitted to its target: the one draft-fits-target check and the target's token embedding taken or compared.

`Eagle3DraftModel.from_pretrained(..., target=)`, `from_target` and `eagle3_hf.bind_target` run `check_target` once
each (a `generate()` call checks once more, in `eagle3_decoding`). Routing `target.generate` to EAGLE-3 is not done
here: it needs the decoding loop, which lives above `modeling/` (`generation.decoding.bind_target`).
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from eagle3_hf.modeling.configuration_eagle3 import _TARGET_TO_LAYER_TYPE, Eagle3DraftConfig, default_target_layer_ids
from eagle3_hf.modeling.embedding import embedding_mismatch, finer, stored_embedding, target_embedding

__all__ = ["check_target", "take_target_embedding"]


def check_target(config: Eagle3DraftConfig, target: PreTrainedModel) -> None:
    """The one draft-fits-target check (run once per load or bind: `from_pretrained(..., target=)`, `from_target`,
    `bind_target`):
    the target's family is supported and its config is the one the draft was built for; then fill in the target
    facts the draft's config does not record."""
    text = target.config.get_text_config()
    model_type = getattr(text, "model_type", None)
    if model_type not in _TARGET_TO_LAYER_TYPE:
        raise ValueError(
            f"Unsupported target architecture model_type={model_type!r} "
            f"({getattr(target.config, 'architectures', None)}); eagle3_hf supports targets of type "
            f"{sorted(_TARGET_TO_LAYER_TYPE)}."
        )
    config.check_target_config(target.config)
    if config.target_num_hidden_layers is None:
        config.target_num_hidden_layers = text.num_hidden_layers
    if config.target_layer_ids is None:
        config.target_layer_ids = default_target_layer_ids(text.num_hidden_layers)
    if config.target_name_or_path is None:
        config.target_name_or_path = getattr(target.config, "_name_or_path", None) or None
    if config.target_model_type is None:
        config.target_model_type = model_type
    if config.target_architectures is None:
        config.target_architectures = getattr(target.config, "architectures", None)
    config.validate()


def take_target_embedding(draft: Any, target: PreTrainedModel, source: str, replace: bool = False) -> None:
    """Give the draft the target's embedding where it has none; refuse one that differs unless `replace`."""
    config = draft.config
    target_weight = target_embedding(target)
    if not draft.embedding_loaded or replace:
        if config.hidden_size != config.target_hidden_size:
            raise ValueError(
                f"{source}: the target's token embedding (width {config.target_hidden_size}) cannot serve a draft of "
                f"hidden_size={config.hidden_size}; such a draft needs its own embedding in the checkpoint."
            )
        draft.load_target_embedding(target)
    elif tuple(draft.embed_tokens.weight.shape) == tuple(target_weight.shape):
        ours = stored_embedding(draft)
        why = embedding_mismatch(ours, target_weight)
        if why is not None:
            raise ValueError(
                f"{source}: the draft's token embedding {why}. Pass use_target_embedding=True to use the "
                "target's embedding instead (exports sometimes carry a re-initialised random one, which silently "
                "ruins acceptance)."
            )
        if finer(target_weight.dtype, ours.dtype):
            # A cast copy (the target's rounded to a narrower dtype): the embedding is the target's, so take its own.
            draft.load_target_embedding(target)
