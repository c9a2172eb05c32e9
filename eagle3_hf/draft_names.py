"""Which draft a `--draft` value names, and how a target name finds its draft: a folder, a shipped draft's name, a
Hub id, the draft shipped for the target (`modeling.shipped`), a fresh random one, or the model-free lookup.

Nothing here imports torch at module level: the command line checks a `--draft` value with `check_draft_option`
before any model loads.
"""

from __future__ import annotations

import os
from typing import Any

from eagle3_hf.modeling.checkpoint_check import check_checkpoint_folder
from eagle3_hf.modeling.shipped import shipped_draft_folder, shipped_draft_path, unknown_draft_hint
from eagle3_hf.utils.hub import hub_kwargs_for, is_hub_id

RANDOM_DRAFT = "random"
LOOKUP_DRAFT = "lookup"  # no draft model: the model-free context-lookup tree


def check_draft_option(target_name: str, draft: str | None) -> None:
    """Refuse a `--draft` value that names nothing, before anything loads: it must be a folder holding a checkpoint,
    a shipped draft's name, a Hub id, "random" or "lookup" (`None`, the shipped draft for `target_name`, must
    exist)."""
    if draft is None:
        shipped_draft_path(target_name)
    elif draft not in (RANDOM_DRAFT, LOOKUP_DRAFT):
        check_checkpoint_name(draft, "--draft", (RANDOM_DRAFT, LOOKUP_DRAFT))


def check_checkpoint_name(name: str, what: str, others: tuple[str, ...] = ()) -> None:
    """Refuse, in one line naming `what` (the option), a draft checkpoint `name` that cannot load: a folder without
    a readable config.json and weights, a file, or a name that is no folder, shipped draft or Hub id (`others`: the
    option's other values, offered when close), or a Hub id that can neither be fetched nor found in the cache."""
    if os.path.isdir(name):
        check_checkpoint_folder(name, what)
    elif shipped_draft_folder(name) is not None:
        return
    elif os.path.exists(name):
        raise ValueError(f"{what} {name!r} is a file; expected a draft folder (holding config.json).")
    elif not is_hub_id(name):
        raise ValueError(
            f"{what} {name!r}: no such folder, shipped draft or Hub id 'org/name' ({unknown_draft_hint(name, others)})."
        )
    else:
        hub_kwargs_for(name, "the draft")  # offline: a draft the cache lacks is refused now, not after the target


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
