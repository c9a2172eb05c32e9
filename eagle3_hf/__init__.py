"""EAGLE-3 speculative decoding for Hugging Face transformers.

Importing the package registers `Eagle3DraftConfig` / `Eagle3DraftModel` with `AutoConfig` and
`AutoModel` (model_type "eagle3_draft"); that is its only side effect.
"""

from transformers import AutoConfig, AutoModel

from eagle3_hf.modeling.configuration_eagle3 import SUPPORTED_LAYER_TYPES, Eagle3DraftConfig, default_target_layer_ids
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, Eagle3DraftOutput, Eagle3PreTrainedModel

# Registers `bind_target` as what `Eagle3DraftModel.bind` runs (the model does not import generation).
from eagle3_hf import generation as _generation  # noqa: E402,F401

__version__ = "0.1.0"

AutoConfig.register(Eagle3DraftConfig.model_type, Eagle3DraftConfig, exist_ok=True)
AutoModel.register(Eagle3DraftConfig, Eagle3DraftModel, exist_ok=True)

__all__ = [
    "SUPPORTED_LAYER_TYPES",
    "Eagle3DraftConfig",
    "Eagle3DraftModel",
    "Eagle3DraftOutput",
    "Eagle3PreTrainedModel",
    "default_target_layer_ids",
    "__version__",
]
