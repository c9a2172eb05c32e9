"""EAGLE-3 speculative decoding for Hugging Face transformers.

The public names load on first use (PEP 562), so that `import eagle3_hf` and `eagle3-hf --help` stay instant: torch
and transformers are imported only when a name such as `Eagle3DraftModel` is first read. That first read registers
`Eagle3DraftConfig` / `Eagle3DraftModel` with `AutoConfig` and `AutoModel` (model_type "eagle3_draft"); that is
the package's only side effect. `bind_target(draft, target)` makes `target.generate(..., assistant_model=draft)`
run EAGLE-3 on that one target instance.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_PUBLIC = {
    "ContextLookup": "eagle3_hf.generation.decoding",
    "bind_target": "eagle3_hf.generation.decoding",
    "SUPPORTED_LAYER_TYPES": "eagle3_hf.modeling.configuration_eagle3",
    "Eagle3DraftConfig": "eagle3_hf.modeling.configuration_eagle3",
    "default_target_layer_ids": "eagle3_hf.modeling.configuration_eagle3",
    "Eagle3DraftModel": "eagle3_hf.modeling.modeling_eagle3",
    "Eagle3DraftOutput": "eagle3_hf.modeling.modeling_eagle3",
    "Eagle3PreTrainedModel": "eagle3_hf.modeling.modeling_eagle3",
}

__all__ = [*sorted(_PUBLIC), "__version__"]


def _load() -> None:
    """Import the public names and register the model with the Auto classes."""
    from transformers import AutoConfig, AutoModel

    from eagle3_hf.generation import decoding
    from eagle3_hf.modeling import configuration_eagle3, modeling_eagle3

    AutoConfig.register(
        configuration_eagle3.Eagle3DraftConfig.model_type, configuration_eagle3.Eagle3DraftConfig, exist_ok=True
    )
    AutoModel.register(configuration_eagle3.Eagle3DraftConfig, modeling_eagle3.Eagle3DraftModel, exist_ok=True)
    modules = {
        "eagle3_hf.modeling.configuration_eagle3": configuration_eagle3,
        "eagle3_hf.modeling.modeling_eagle3": modeling_eagle3,
        "eagle3_hf.generation.decoding": decoding,
    }
    globals().update({name: getattr(modules[module], name) for name, module in _PUBLIC.items()})


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'eagle3_hf' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
