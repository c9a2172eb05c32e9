"""The model card a draft folder carries (README.md), made with `huggingface_hub.ModelCard`.

The template is package data (`templates/model_card.md`), read with `importlib.resources` so that it is found in an
installed wheel as well as in a source tree. The metadata is a `ModelCardData`: ``base_model`` is the target's Hub id
when the draft records one (never a short name or a local path), ``library_name`` and tags say what the model is,
``datasets`` lists Hub datasets it was trained on, and measured acceptance goes into ``model-index`` results.
`Eagle3DraftModel.save_pretrained` and `push_to_hub` write it; `eagle3-hf bench --model-card` adds measurements.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from eagle3_hf.utils.hub import is_hub_id

LIBRARY_NAME = "eagle3_hf"
TAGS = ["eagle3", "speculative-decoding", "draft-model"]
TEMPLATE = "templates/model_card.md"
CARD_NAME = "README.md"
# The norm flags a card names, with what each does (a draft with none is plain EAGLE-3, and its card says nothing).
NORM_FLAGS = {
    "fc_norm": "an RMSNorm on each tap before fc",
    "norm_before_fc": "one RMSNorm over the taps before fc",
    "norm_before_residual": "the residual normed",
    "norm_output": "the post-norm state fed back",
}
# What a card's benchmark results are measured on (model-index needs a dataset for each result).
_BENCH_DATASET = {"dataset_type": "mt_bench", "dataset_name": "MT-bench (first turns)"}

__all__ = ["CARD_NAME", "LIBRARY_NAME", "TAGS", "build_model_card", "is_our_card", "template_text"]


def template_text() -> str:
    """The card template shipped inside the package."""
    return resources.files("eagle3_hf.modeling").joinpath(TEMPLATE).read_text(encoding="utf-8")


def _eval_results(metrics: Mapping[str, Any]) -> list[EvalResult]:
    results = []

    def add(metric_type: str, metric_name: str, value: Any) -> None:
        if value is not None:
            results.append(
                EvalResult(
                    task_type="text-generation",
                    task_name="speculative decoding",
                    metric_type=metric_type,
                    metric_name=metric_name,
                    metric_value=round(float(value), 4),
                    **_BENCH_DATASET,
                )
            )

    add("mean_accepted_tokens", "tau (tree)", metrics.get("tau"))
    add("mean_accepted_tokens_chain", "tau (chain)", metrics.get("tau_chain"))
    add("speedup", "speedup vs plain generate", metrics.get("speedup"))
    for depth, rate in enumerate(metrics.get("acceptance_by_depth") or [], 1):
        add(f"acceptance_rate_depth_{depth}", f"acceptance rate at depth {depth}", rate)
    return results


def architecture_line(config: Mapping[str, Any]) -> str | None:
    """The card's line for a draft's norm flags (``EAGLE-3.1: `fc_norm` (...), ...``); None for plain EAGLE-3."""
    flags = [f"`{flag}` ({what})" for flag, what in NORM_FLAGS.items() if config.get(flag)]
    if not flags:
        return None
    return ("EAGLE-3.1" if config.get("fc_norm") and config.get("norm_output") else "EAGLE-3") + ": " + ", ".join(flags)


def build_model_card(
    config: Mapping[str, Any] | Any,
    info: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    text: Mapping[str, Any] | None = None,
) -> ModelCard:
    """The card of a draft.

    Args:
        config: the draft's config (an `Eagle3DraftConfig` or its dict).
        info: what training recorded (``training_info.json``): ``data``, ``steps``, ``ttt_length``,
            ``training_hardware``, ``command``, ``target_revision``, ``coverage``; ``datasets``: Hub dataset ids.
        metrics: measured numbers (``tau``, ``tau_chain``, ``speedup``, ``acceptance_by_depth``), as model-index
            results in the metadata.
        text: strings for the card's body (the benchmark's table cells, ``bench_command``, versions).
    """
    config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    info, metrics, text = dict(info or {}), dict(metrics or {}), dict(text or {})
    target = config.get("target_name_or_path")
    base_model = target if is_hub_id(target) else None
    datasets = [d for d in (info.get("datasets") or []) if is_hub_id(d)] or None
    name = f"EAGLE-3 draft for {target or 'its target'}"
    results = _eval_results(metrics)
    card_data = ModelCardData(
        base_model=base_model,
        library_name=LIBRARY_NAME,
        tags=list(TAGS),
        datasets=datasets,
        model_name=name if results else None,
        eval_results=results or None,
    )
    fields = {
        "target_name": target or "an unrecorded target",
        "target_architectures": ", ".join(config.get("target_architectures") or []),
        "target_layer_ids": config.get("target_layer_ids"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "vocab_size": config.get("vocab_size"),
        "num_hidden_layers": config.get("num_hidden_layers") or 1,  # the draft's depth (configs before it: 1)
        "architecture": architecture_line(config),
        "repo_hint": "path/to/this/draft",
        **{k: v for k, v in info.items() if v is not None},
        **{k: v for k, v in text.items() if v is not None},
    }
    return ModelCard.from_template(card_data, template_str=template_text(), **fields)


def is_our_card(path: str | os.PathLike) -> bool:
    """Whether the card at `path` was written by this library (so that re-saving may replace it)."""
    try:
        card = ModelCard.load(path)
    except (OSError, ValueError):
        return False
    return card.data.library_name == LIBRARY_NAME
