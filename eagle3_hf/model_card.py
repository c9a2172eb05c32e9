"""Model cards for trained drafts, rendered from `model_cards/TEMPLATE.md`."""

from __future__ import annotations

import json
import os
from typing import Any

# The template lives in the repository (model_cards/), next to the package of an editable install.
_TEMPLATE_CANDIDATES = (os.path.join(os.path.dirname(os.path.dirname(__file__)), "model_cards", "TEMPLATE.md"),)


EVALUATION_NAME = "evaluation.json"  # in a draft folder: {set label: evaluate_draft metrics}


def format_evaluation_table(results: dict[str, dict[str, Any]], first_column: str = "evaluation set") -> str:
    """A markdown table of `evaluate_draft` metrics, one row per entry (a draft, or an evaluation set)."""
    steps = sorted({int(k[4:]) for m in results.values() for k in m if k.startswith("acc_") and k[4:].isdigit()})
    lines = [f"| {first_column} | " + " | ".join(f"acc_{j}" for j in steps)
             + " | coverage | simulated acceptance length | tokens |", "|---|" + "---|" * (len(steps) + 3)]  # fmt: skip
    for name, m in results.items():
        accs = " | ".join("n/a" if f"acc_{j}" not in m else f"{m[f'acc_{j}']:.3f}" for j in steps)
        tail = f"{m['coverage']:.3f} | {m['sim_accept_len']:.2f} | {m['supervised_tokens']}"
        lines.append(f"| {name} | {accs} | {tail} |")
    return "\n".join(lines)


def format_rates(rates: list[float | None], sep: str) -> str:
    """Acceptance rates as text, two decimals each, "n/a" where there is none (a depth never reached)."""
    return sep.join("n/a" if a is None else f"{a:.2f}" for a in rates)


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "n/a"


def render_model_card(fields: dict[str, Any], template_path: str | None = None) -> str:
    """Fill the template's `{field}` slots; fields not given read "n/a" (never a silently wrong number)."""
    path = template_path or next((p for p in _TEMPLATE_CANDIDATES if os.path.isfile(p)), None)
    if path is None:
        raise ValueError(f"No model card template found (looked for {list(_TEMPLATE_CANDIDATES)}).")
    with open(path) as f:
        template = f.read()
    return template.format_map(_Missing({k: v for k, v in fields.items() if v is not None}))


def card_fields(draft_dir: str, report: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """Collect card fields from a draft folder (config, training_info.json if present) and a bench report."""
    with open(os.path.join(draft_dir, "config.json")) as f:
        config = json.load(f)
    fields: dict[str, Any] = {
        "target_name_or_path": config.get("target_name_or_path"),
        "target_layer_ids": config.get("target_layer_ids"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "vocab_size": config.get("vocab_size"),
    }
    info_path = os.path.join(draft_dir, "training_info.json")
    if os.path.isfile(info_path):
        with open(info_path) as f:
            fields.update(json.load(f))
    evaluation_path = os.path.join(draft_dir, EVALUATION_NAME)  # written by `eagle3-hf evaluate --record LABEL`
    if os.path.isfile(evaluation_path):
        with open(evaluation_path) as f:
            fields["evaluation"] = format_evaluation_table(json.load(f))
    if report:
        env = report.get("environment", {})
        cfg = report.get("config", {})
        fields.update(
            tau=f"{report['tau']:.2f}" if "tau" in report else None,
            speedup=f"{report['speedup']:.2f}x" if "speedup" in report else None,
            identical=f"{report['identical']:.0%}" if "identical" in report else None,
            tau_chain=f"{report['tau_chain']:.2f}" if "tau_chain" in report else None,
            acceptance_by_depth=format_rates(report["acceptance_by_depth"], " / ")
            if "acceptance_by_depth" in report else None,
            hardware=f"{env.get('cuda') or env.get('cpu')} ({env.get('threads')} thread"
            + ("" if env.get("threads") == 1 else "s") + ")",
            dtype=cfg.get("dtype"),
            prompts=f"{cfg.get('num_prompts')} MT-bench turn-1 prompts x {cfg.get('max_new_tokens')} new tokens",
            transformers_version=env.get("transformers"),
            torch_version=env.get("torch"),
        )
    fields.update({k: v for k, v in extra.items() if v is not None})
    return fields
