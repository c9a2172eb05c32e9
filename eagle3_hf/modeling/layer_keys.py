"""Names of the draft's decoder layers in our state dict and in numbered (speculators) checkpoints.

Ours: layer 0 is ``midlayer.*`` (the official and SpecForge name, so that one-layer checkpoints keep their keys) and
layer ``i >= 1`` is ``upper_layers.{i-1}.*``. Speculators, like vLLM, numbers them ``layers.{i}.*``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["check_layers_present", "from_numbered", "layer_of", "to_numbered"]

_NUMBERED = re.compile(r"layers\.(\d+)\.")
_OURS = re.compile(r"(?:midlayer|upper_layers\.(\d+))\.")


def from_numbered(key: str) -> str:
    """``layers.0.x`` -> ``midlayer.x``, ``layers.{i}.x`` -> ``upper_layers.{i-1}.x``; any other key unchanged."""
    match = _NUMBERED.match(key)
    if match is None:
        return key
    index, rest = int(match.group(1)), key[match.end() :]
    return f"midlayer.{rest}" if index == 0 else f"upper_layers.{index - 1}.{rest}"


def to_numbered(key: str) -> str:
    """Our layer key -> ``layers.{i}.*`` (the inverse of `from_numbered`); any other key unchanged."""
    match = _OURS.match(key)
    if match is None:
        return key
    index = 0 if match.group(1) is None else int(match.group(1)) + 1
    return f"layers.{index}.{key[match.end() :]}"


def layer_of(key: str) -> int | None:
    """The draft layer index of one of our keys, `None` for a weight outside the decoder layers."""
    match = _OURS.match(key)
    if match is None:
        return None
    return 0 if match.group(1) is None else int(match.group(1)) + 1


def check_layers_present(depth: int, keys: Iterable[str], where: str) -> None:
    """Raise `ValueError` unless the weights `keys` (ours) hold exactly the decoder layers ``0..depth-1``."""
    present = sorted({i for i in map(layer_of, keys) if i is not None})
    if present != list(range(depth)):
        raise ValueError(
            f"The {where} config has num_hidden_layers={depth}, but its weights hold decoder layer(s) {present} "
            f"(layers.{{i}}.* / midlayer.*): expected layers 0..{depth - 1}, each with its weights."
        )
