"""Who the target is, in the form other tools load it by: a Hub id ``org/name`` (or a local folder), and its
architectures. A short name such as ``"smollm2"`` is ours alone; written into an export it sends loaders looking on
the Hub for a repo that does not exist.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["is_hub_id", "target_identity"]


def is_hub_id(name: str | None) -> bool:
    """Whether `name` reads as a Hub repo id ``org/name`` (and is not a local path), such as serving tools resolve."""
    if not name or name.count("/") != 1 or os.path.exists(name) or name.startswith((".", "/", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def target_identity(config: Any, target_id: str | None = None) -> tuple[str, list[str]]:
    """``(name_or_path, architectures)`` of the target, as a serving tool needs them to load it.

    `target_id` overrides what the draft records. Raises `ValueError` when the name is neither a Hub id nor an
    existing local folder (a short name such as ``"smollm2"`` sends loaders to the Hub for a repo that does not
    exist) or when the architectures are unknown.
    """
    name = target_id or config.target_name_or_path
    if not (is_hub_id(name) or (name and os.path.isdir(name))):
        raise ValueError(
            f"The draft records its target as {name!r}, which is neither a Hub id ('org/name') nor a local folder, "
            "so a serving tool could not load the target from it; pass the target's Hub id (target_id='org/name', "
            "or `eagle3-hf convert --target-id org/name`)."
        )
    architectures = list(config.target_architectures or [])
    if not architectures:
        raise ValueError(
            "The draft does not record its target's architectures (e.g. ['LlamaForCausalLM']), which the "
            "speculators config names; load the draft with its target (from_pretrained(path, target=target), or "
            "`eagle3-hf convert --target NAME_OR_PATH`)."
        )
    return str(name), architectures
