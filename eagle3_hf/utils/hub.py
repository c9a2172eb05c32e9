"""The Hub, as far as this package needs it: whether a name reads as a Hub repo id, and whether the Hub can be
reached at all, so that a machine without a network is answered at once rather than after huggingface_hub's retries
(five, with back-off: 52 s for a target's config.json)."""

from __future__ import annotations

import functools
import os
import socket
from typing import Any
from urllib.parse import urlparse

__all__ = ["hub_kwargs_for", "hub_unreachable", "is_hub_id"]

# Seconds to wait for the Hub's host to accept a connection: a reachable Hub answers in well under one.
HUB_PROBE_SECONDS = 2.0
# Behind one of these the Hub's host is not reached directly, so a failed direct connection says nothing.
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


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


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached from this process (offline mode set, or its host refusing a connection within
    `HUB_PROBE_SECONDS`), or None when it can be, or when a proxy stands between (then only a request can tell).
    Asked once per process."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return None
    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_PROBE_SECONDS).close()
    except OSError as err:
        return f"{host}: {err.strerror or err}"
    return None


def hub_kwargs_for(repo_id: str, what: str, filename: str = "config.json", hint: str = "") -> dict[str, Any]:
    """`from_pretrained` keyword arguments for loading `repo_id` (a Hub id) here: none when the Hub can be reached,
    ``local_files_only=True`` when it cannot but the local Hugging Face cache holds the repo's `filename`. Raises
    `ValueError` (naming `what`, e.g. "the target", and adding `hint`) when it can neither be fetched nor found."""
    reason = hub_unreachable()
    if reason is None:
        return {}
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, filename), str):
        return {"local_files_only": True}
    raise ValueError(
        f"Cannot load {what} {repo_id!r}: the Hub cannot be reached ({reason}) and the local Hugging Face cache does "
        f"not hold it.{' ' + hint if hint else ''}"
    )
