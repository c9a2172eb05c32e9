"""Which draft a `--draft` value names, and how a target name finds its draft: a folder, a shipped draft's name, a
Hub id, the draft shipped for the target (`modeling.shipped`), a fresh random one, or the model-free lookup.

Nothing here imports torch at module level: the command line checks a `--draft` value with `check_draft_option`
before any model loads.
"""

from __future__ import annotations

import os
from typing import Any

from eagle3_hf.modeling.shipped import shipped_draft_folder, shipped_draft_path, unknown_draft_hint
from eagle3_hf.utils.hub import is_hub_id

RANDOM_DRAFT = "random"
LOOKUP_DRAFT = "lookup"  # no draft model: the model-free context-lookup tree


def check_draft_option(target_name: str, draft: str | None) -> None:
    """Refuse a `--draft` value that names nothing, before anything loads: it must be a folder, a shipped draft's
    name, a Hub id, "random" or "lookup" (`None`, the shipped draft for `target_name`, must exist)."""
    if draft is None:
        shipped_draft_path(target_name)
    elif draft in (RANDOM_DRAFT, LOOKUP_DRAFT) or os.path.isdir(draft) or shipped_draft_folder(draft) is not None:
        return
    elif os.path.exists(draft):
        raise ValueError(f"--draft {draft!r} is a file; expected a draft folder (holding config.json).")
    elif not is_hub_id(draft):
        raise ValueError(
            f"--draft {draft!r}: no such folder, shipped draft or Hub id 'org/name' ("
            f"{unknown_draft_hint(draft, (RANDOM_DRAFT, LOOKUP_DRAFT))})."
        )


def load_draft_for(target_name: str, target: Any, draft: str | None = None) -> Any:
    """The draft to use with `target`: a folder, a shipped draft's name or a Hub id, the one shipped for
    `target_name` (`None`), a fresh random one (`"random"`), or no model at all (`"lookup"`: a `ContextLookup`,
    the context lookup's tree alone); `target.generate` is bound to it (`bind_target`)."""
    from eagle3_hf import ContextLookup, Eagle3DraftModel, bind_target

    if draft == LOOKUP_DRAFT:
        return ContextLookup().bind(target)
    if draft == RANDOM_DRAFT:
        return bind_target(Eagle3DraftModel.from_target(target).eval(), target)
    path = shipped_draft_path(target_name) if draft is None else draft
    return bind_target(Eagle3DraftModel.from_pretrained(path, target=target).eval(), target)
