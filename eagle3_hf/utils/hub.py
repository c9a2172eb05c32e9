"""The Hub, as far as this package needs it without a network: whether a name reads as a Hub repo id."""

from __future__ import annotations

import os

__all__ = ["is_hub_id"]


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
