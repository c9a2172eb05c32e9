"""A folder's manifest: what the run that writes the folder was given, so that a later run into the same folder with
other data or settings is refused, naming what differs, instead of skipping work or mixing two runs' outputs.

`precompute_features` (``features.json``: a fingerprint of the token rows and the feature settings) and
`regenerate_responses` (``.regenerate.json``: a fingerprint of the prompts and the generation settings) use it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from eagle3_hf.utils.atomic import replace_path

__all__ = ["check_manifest", "write_manifest"]


def check_manifest(
    output_dir: str, name: str, manifest: dict[str, Any], what: str, ignore: tuple[str, ...] = ()
) -> bool:
    """Raise `ValueError` when ``output_dir/name`` records other values than `manifest` (keys in `ignore` aside);
    `what` says what the folder holds ("features"). Returns whether the folder has a manifest."""
    path = os.path.join(output_dir, name)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); delete the folder {output_dir!r} to start over.") from err
    if not isinstance(old, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(old).__name__}.")
    changed = [k for k in manifest if k not in ignore and old.get(k) != manifest[k]]
    if changed:
        differences = ", ".join(f"{k}: {old.get(k)!r} -> {manifest[k]!r}" for k in changed)
        raise ValueError(
            f"{output_dir!r} already holds {what} of another run ({differences}); "
            "use another folder, or delete this one to start over."
        )
    return True


def write_manifest(output_dir: str, name: str, manifest: dict[str, Any]) -> None:
    """Write ``output_dir/name`` whole (a temporary sibling renamed into place)."""
    path = os.path.join(output_dir, name)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    replace_path(temporary, path)
