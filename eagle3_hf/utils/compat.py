"""Small shims over the transformers versions this package supports (see pyproject.toml).

transformers 5.24 renamed the `past_key_values` argument and output field to `cache`;
older 5.x releases only know `past_key_values`.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers.models.llama.modeling_llama import LlamaModel

CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """`{CACHE_KWARG: cache}`, to pass a cache to a transformers forward under its current name."""
    return {CACHE_KWARG: cache}


def generate_output_cache_field() -> str:
    """Name of the cache field of `GenerateDecoderOnlyOutput` in this transformers release."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
