"""Who the target is, in the form other tools load it by: a Hub id ``org/name`` (or a local folder), and its
architectures. A short name such as ``"smollm2"`` is ours alone; written into an export it sends loaders looking on
the Hub for a repo that does not exist.
"""

from __future__ import annotations

import os
from typing import Any

from eagle3_hf.utils.hub import is_hub_id

__all__ = ["local_verifier", "target_identity"]


def local_verifier(path: str | os.PathLike, config: Any) -> str:
    """The absolute path of `path`, a local folder holding the target as transformers saves it (config.json beside
    its weights), checked against the draft's `config`: a verifier that speculators loads offline.

    Raises `ValueError` naming what is wrong: no such folder, no config.json or weights in it (a GGUF file is not
    enough: speculators loads the verifier with transformers), or a model that is not the draft's target.
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(
            f"The verifier folder {folder!r} does not exist; expected a local folder holding the target as "
            "transformers saves it (config.json and its weights)."
        )
    names = sorted(os.listdir(folder))
    if "config.json" not in names or not any(n.endswith((".safetensors", ".bin")) for n in names):
        raise ValueError(
            f"The verifier folder {folder!r} holds no transformers checkpoint (config.json and .safetensors or .bin "
            f"weights; it has {names[:8]}), which speculators needs to load the verifier. Save a plain copy of the "
            "target there first, e.g. with eagle3_hf.targets.cached_plain_copy(NAME, FOLDER)."
        )
    from transformers import AutoConfig

    try:
        target_config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"The verifier folder {folder!r} has a config.json transformers cannot read: {err}") from err
    config.check_target_config(target_config)
    return os.path.abspath(folder)


def target_identity(config: Any, target_id: str | None = None) -> tuple[str, list[str]]:
    """``(name_or_path, architectures)`` of the target, as a serving tool needs them to load it.

    `target_id` overrides what the draft records. A local folder must hold the target (see `local_verifier`) and is
    given as an absolute path. Raises `ValueError` when the name is neither a Hub id nor such a folder (a short name
    such as ``"smollm2"`` sends loaders to the Hub for a repo that does not exist) or when the architectures are
    unknown.
    """
    name = target_id or config.target_name_or_path
    if name and not is_hub_id(name) and os.path.isdir(name):
        name = local_verifier(name, config)
    elif not is_hub_id(name):
        raise ValueError(
            f"The draft records its target as {name!r}, which is neither a Hub id ('org/name') nor a local folder, "
            "so a serving tool could not load the target from it; pass the target's Hub id (target_id='org/name', "
            "or `eagle3-hf convert --target-id org/name`) or a local folder holding it (`--verifier-path DIR`)."
        )
    architectures = list(config.target_architectures or [])
    if not architectures:
        raise ValueError(
            "The draft does not record its target's architectures (e.g. ['LlamaForCausalLM']), which the "
            "speculators config names; load the draft with its target (from_pretrained(path, target=target), or "
            "`eagle3-hf convert --target NAME_OR_PATH`)."
        )
    return str(name), architectures
