"""Model cards for trained drafts with measurements: a `bench` report -> the card's metadata and table.

The card itself (template, metadata) is `eagle3_hf.modeling.model_card`, which `save_pretrained` also uses; this
module adds what only the benchmark knows.
"""

from __future__ import annotations

import json
import os
from typing import Any

from huggingface_hub import ModelCard

from eagle3_hf.modeling.model_card import CARD_NAME, build_model_card
from eagle3_hf.utils.outputs import staged_file

__all__ = ["EVALUATION_NAME", "bench_card", "format_evaluation_table", "format_rates", "write_bench_card"]

EVALUATION_NAME = "evaluation.json"  # in a draft folder: {set label: evaluate_draft metrics}


def format_evaluation_table(results: dict[str, dict[str, Any]], first_column: str = "evaluation set") -> str:
    """A markdown table of `evaluate_draft` metrics, one row per entry (a draft, or an evaluation set)."""
    steps = sorted({int(k[4:]) for m in results.values() for k in m if k.startswith("acc_") and k[4:].isdigit()})
    lines = [
        f"| {first_column} | "
        + " | ".join(f"acc_{j}" for j in steps)
        + " | coverage | simulated acceptance length | tokens |",
        "|---|" + "---|" * (len(steps) + 3),
    ]
    for name, m in results.items():
        accs = " | ".join("n/a" if f"acc_{j}" not in m else f"{m[f'acc_{j}']:.3f}" for j in steps)
        tail = f"{m['coverage']:.3f} | {m['sim_accept_len']:.2f} | {m['supervised_tokens']}"
        lines.append(f"| {name} | {accs} | {tail} |")
    return "\n".join(lines)


def format_rates(rates: list[float | None], sep: str) -> str:
    """Acceptance rates as text, two decimals each, "n/a" where there is none (a depth never reached)."""
    return sep.join("n/a" if a is None else f"{a:.2f}" for a in rates)


def bench_card(draft_dir: str, report: dict[str, Any] | None = None, **text: Any) -> ModelCard:
    """The card of the draft in `draft_dir` (its config.json, training_info.json if any) with a bench report."""
    config_path = os.path.join(draft_dir, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{draft_dir!r} holds no config.json: expected a draft folder.")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    info: dict[str, Any] = {}
    info_path = os.path.join(draft_dir, "training_info.json")
    if os.path.isfile(info_path):
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
    evaluation_path = os.path.join(draft_dir, EVALUATION_NAME)  # written by `eagle3-hf evaluate --record LABEL`
    if os.path.isfile(evaluation_path):
        with open(evaluation_path, encoding="utf-8") as f:
            text.setdefault("evaluation", format_evaluation_table(json.load(f)))
    metrics = {k: (report or {}).get(k) for k in ("tau", "tau_chain", "speedup", "acceptance_by_depth")}
    if report:
        env, cfg = report.get("environment", {}), report.get("config", {})
        threads = env.get("threads")
        text = {
            "tau": f"{report['tau']:.2f}" if "tau" in report else None,
            "speedup": f"{report['speedup']:.2f}x" if "speedup" in report else None,
            "identical": f"{report['identical']:.0%}" if "identical" in report else None,
            "tau_chain": f"{report['tau_chain']:.2f}" if "tau_chain" in report else None,
            "acceptance_by_depth": format_rates(report["acceptance_by_depth"], " / ")
            if "acceptance_by_depth" in report
            else None,
            "hardware": f"{env.get('cuda') or env.get('cpu')} ({threads} thread{'' if threads == 1 else 's'})",
            "dtype": cfg.get("dtype"),
            "prompts": f"{cfg.get('num_prompts')} prompts ({cfg.get('prompts', 'MT-bench turn 1')}) x "
            f"{cfg.get('max_new_tokens')} new tokens"
            + (
                f", median of {cfg['repeats']} runs"
                if cfg.get("repeats", 0) > 1
                else ", one run"
                if cfg.get("repeats") == 1
                else ""
            ),
            "transformers_version": env.get("transformers"),
            "torch_version": env.get("torch"),
            **text,
        }
    return build_model_card(config, info, metrics, text)


def write_bench_card(draft_dir: str, report: dict[str, Any], **text: Any) -> str:
    """Write `bench_card` as the draft folder's README.md (to a temporary sibling, then renamed); return its path."""
    path = os.path.join(draft_dir, CARD_NAME)
    card = bench_card(draft_dir, report, **text)
    with staged_file(path) as temporary:
        card.save(temporary)
    return path
