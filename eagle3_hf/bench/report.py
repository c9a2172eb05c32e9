"""What `eagle3-hf bench` reports: acceptance by depth, where a cycle's time goes, where bf16 outputs diverge,
the environment, and the text and markdown tables."""

from __future__ import annotations

import math
import os
import platform
import sys
from typing import Any

import torch

from eagle3_hf.bench.cards import format_rates
from eagle3_hf.utils.precision import NATIVE_BF16_FLAGS, cpu_flags, cpu_name

__all__ = [
    "NEAR_TIE_ULPS",
    "acceptance_by_depth",
    "cycle_breakdown",
    "divergence",
    "environment",
    "format_markdown",
    "format_table",
    "plot_acceptance",
    "ulp",
]


def acceptance_by_depth(accept_lengths: list[int], max_depth: int) -> list[float | None]:
    """n-alpha: share of cycles whose accepted path reached at least depth d, for d = 1..max_depth, given that
    the cycle reached depth d-1 (the paper's acceptance rate at position d). None where no cycle reached d-1:
    there the rate is unmeasured, not zero."""
    rates = []
    for d in range(1, max_depth + 1):
        reached_prev = sum(1 for a in accept_lengths if a - 1 >= d - 1)
        reached = sum(1 for a in accept_lengths if a - 1 >= d)
        rates.append(reached / reached_prev if reached_prev else None)
    return rates


def cycle_breakdown(
    seconds: float, tokens: int, cycles: int, prompts: int, prefill_s: float, draft_s: float, verify_s: float
) -> dict[str, float]:
    """Where an EAGLE-3 configuration's time goes, in milliseconds per verification cycle: drafting the tree, the
    target's verify forward with acceptance and cache compaction, and everything else generate() does around them
    (token bookkeeping, stopping criteria, logits processors, setup); the prompt's prefill is kept apart."""
    per = 1000.0 / cycles
    other = seconds - prefill_s - draft_s - verify_s
    return {
        "draft": draft_s * per,
        "verify": verify_s * per,
        "other": other * per,
        "tokens_per_cycle": tokens / cycles,
        "prefill_per_prompt": 1000.0 * prefill_s / prompts,
    }


# A reduced-precision run may flip a greedy choice only where the fp32 target's top two logits are this close, in
# units of the decoded precision's spacing (ulp) at the top logit: the logits are rounded to that spacing, a tree
# forward rounds differently from a one-token step, and the cache entries of accepted nodes carry those differences
# into later steps. Measured in bf16: SmolLM2 (10 MT-bench prompts x 128 tokens, 32-node trees) flipped only at
# 0.49-0.93 ulp, a tiny random 4-layer Llama with large weights at up to ~7 ulp. A flip at a wider margin is a bug.
NEAR_TIE_ULPS = 16.0


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers around `value` (its unit in the last place)."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(value), info.tiny)))


@torch.no_grad()
def divergence(
    scorer: Any, prompt_ids: torch.Tensor, reference: list[int], other: list[int], same_precision: Any = None
) -> dict[str, Any] | None:
    """Where greedy output `other` first leaves `reference` (both continuations of `prompt_ids` `[1, P]`), and how
    close the target's choice was there; None when neither leaves the other.

    `scorer` (the target in fp32) is run over the prompt and the common prefix: `top2_margin` is its gap between
    its two best logits at the first differing position, `token_gap` its gap between the two tokens that were
    chosen (`reference`'s minus `other`'s). With `same_precision` (the target in the precision that was decoded),
    its gap between the two chosen tokens over the same prefix is reported too (`token_gap_same_precision`), and
    `margin_ulps` is `top2_margin` in units of that precision's spacing at the top logit: a reduced-precision run
    can only flip a choice within rounding (below `NEAR_TIE_ULPS`); a flip at a clear margin is a bug.
    """
    common = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), None)
    if common is None:
        if len(reference) == len(other):
            return None
        common = min(len(reference), len(other))  # one stopped where the other went on
    ref_token = reference[common] if common < len(reference) else None
    other_token = other[common] if common < len(other) else None
    device = next(scorer.parameters()).device
    ids = torch.cat([prompt_ids.to(device), torch.tensor([reference[:common]], dtype=torch.long, device=device)], 1)

    def last_logits(model: Any) -> torch.Tensor:
        return model(ids, attention_mask=torch.ones_like(ids), logits_to_keep=1).logits[0, -1].float()  # [V]

    logits = last_logits(scorer)
    top = logits.topk(2)
    report: dict[str, Any] = {
        "position": common,
        "reference_token": ref_token,
        "other_token": other_token,
        "top_logit": float(top.values[0]),
        "top2_margin": float(top.values[0] - top.values[1]),
        "fp32_choice": int(top.indices[0]),
        "margin_ulps": None,
        "token_gap": None,
        "token_gap_same_precision": None,
    }
    if same_precision is not None:
        report["margin_ulps"] = report["top2_margin"] / ulp(
            float(top.values[0]), next(same_precision.parameters()).dtype
        )
    if ref_token is not None and other_token is not None:
        report["token_gap"] = float(logits[ref_token] - logits[other_token])
        if same_precision is not None:
            low = last_logits(same_precision)
            report["token_gap_same_precision"] = float(low[ref_token] - low[other_token])
    return report


# The CPU flags that decide what a CPU decodes fast: vector widths (fp32 matmuls) and bf16 units.
VECTOR_CPU_FLAGS = ("avx2", "avx512f", "amx_tile", "neon", "asimd", "sve")


def environment() -> dict[str, Any]:
    import datetime

    import transformers

    import eagle3_hf

    flags = cpu_flags()
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "eagle3_hf": eagle3_hf.__version__,
        "python": sys.version.split()[0],
        "threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "bf16_cpu_flags": sorted(f for f in NATIVE_BF16_FLAGS if f in flags),
        "vector_cpu_flags": [f for f in VECTOR_CPU_FLAGS if f in flags],
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def format_table(report: dict[str, Any]) -> str:
    fastest = report.get("fastest_plain")
    lines = [f"{'configuration':<22}{'tokens/s':>10}{'vs fastest plain':>18}"]
    for name, tps in report["tokens_per_s"].items():
        speedup = report.get("speedup_by_method", {}).get(name)  # absent without a plain configuration
        mark = "  (fastest plain)" if name == fastest else ""
        lines.append(f"{name:<22}{tps:>10.2f}" + (f"{speedup:>17.2f}x" if speedup is not None else f"{'-':>18}") + mark)
    if "speedup" in report:
        lines.append(
            f"EAGLE-3 tree: {report['speedup']:.2f}x the fastest plain configuration ({fastest}), "
            f"{report['speedup_same_precision']:.2f}x plain at its own precision"
        )
    if "tau" in report:
        lines.append(
            f"tau (tree, incl. bonus, over drafted cycles): {report['tau']:.2f}; "
            f"drafted cycles {report.get('drafted_cycle_share', 0):.0%}"
        )
    if "tau_chain" in report:
        lines.append(f"tau (chain, incl. bonus): {report['tau_chain']:.2f}")
    for name, counts in report.get("accepted_by_source", {}).items():
        if any(value for key, value in counts.items() if key != "draft"):  # a tree with a lookup source
            lines.append(
                f"{name}: accepted tokens from {source_text(counts)}; tau {report['tau_by_method'][name]:.2f} "
                f"over drafted cycles{field_tau_text(report, name)}"
            )
    if "best_prompt_lookup" in report:
        versus = [
            f"; {m.replace('_', ' ')} {report[f'{m}_vs_best_prompt_lookup']:.2f}x it"
            for m in ("lookup_tree", "corpus_tree")
            if f"{m}_vs_best_prompt_lookup" in report
        ]
        lines.append(f"fastest prompt lookup: {report['best_prompt_lookup']}" + "".join(versus))
    if "identical" in report:
        lines.append(f"greedy tree outputs identical to plain at the same precision: {report['identical']:.0%}")
    if "row_exact" in report:
        lines.append(f"row-invariance probe: {report['row_exact']['description']}")
        if "verification" in report["row_exact"]:
            lines.append(
                f"verification: {report['row_exact']['verification']} ({report['row_exact']['verification_reason']})"
            )
    for d in report.get("divergences", []):
        gap = "n/a" if d["token_gap"] is None else f"{d['token_gap']:.3f}"
        ulps = d.get("margin_ulps")
        verdict = (
            ""
            if ulps is None
            else f" = {ulps:.2f} ulp"
            + ("" if ulps < NEAR_TIE_ULPS else f": NOT a near-tie (>= {NEAR_TIE_ULPS:g} ulp), a bug")
        )
        lines.append(
            f"  prompt {d['prompt']} (repeat {d['repeat']}) diverges at token {d['position']}: "
            f"{d['reference_token']} -> {d['other_token']}, fp32 top-2 margin {d['top2_margin']:.3f}{verdict}, "
            f"fp32 gap {gap}"
        )
    if "acceptance_by_depth" in report:
        lines.append("acceptance by depth (chain): " + format_rates(report["acceptance_by_depth"], " "))
        if "acceptance_by_depth_cycles" in report:
            lines.append("  measured over cycles: " + " ".join(str(n) for n in report["acceptance_by_depth_cycles"]))
    for m, b in report.get("time_per_cycle_ms", {}).items():
        lines.append(
            f"{m} per cycle: draft {b['draft']:.1f} ms, verify {b['verify']:.1f} ms, other {b['other']:.1f} ms; "
            f"{b['tokens_per_cycle']:.2f} tokens/cycle"
        )
    return "\n".join(lines)


def source_text(counts: dict[str, int]) -> str:
    """Accepted tokens by source, from a report of this version (draft, context, corpus, several) or an older one
    (draft, lookup, both: the context lookup then was the only lookup source)."""
    if "several" not in counts:
        return f"the draft {counts['draft']}, the lookup {counts['lookup']}, both {counts['both']}"
    return (
        f"the draft {counts['draft']}, the context {counts['context']}, the corpus {counts['corpus']}, several "
        f"{counts['several']}"
    )


def field_tau_text(report: dict[str, Any], name: str) -> str:
    """ "; tau ... the field's way" where the report has it (reports of this version)."""
    tau = report.get("tau_field_by_method", {}).get(name)
    return "" if tau is None else f", {tau:.2f} the field's way (accepted draft tokens + 1, per cycle)"


def format_markdown(report: dict[str, Any]) -> str:
    """The README's results: one table of every configuration, its tokens/s, its ratio to the fastest plain
    configuration and to transformers' prompt lookup at its best setting, and its tau (accepted draft tokens + 1 per
    cycle, every cycle: the field's way), then what it was measured on (the CPU, its flags, threads, date, prompts,
    versions) and how the trees fared, from this one report. Where each tree's accepted tokens came from is the
    text table's (`format_table`)."""
    env, cfg = report.get("environment", {}), report.get("config", {})
    rates, fastest, best = report["tokens_per_s"], report.get("fastest_plain"), report.get("best_prompt_lookup")
    taus = report.get("tau_field_by_method", {})  # reports of this version only
    header = f"| configuration | tokens/s (median) | vs {f'`{fastest}` ' if fastest else ''}(fastest plain) |" + (
        f" vs `{best}` (prompt lookup at its best) |" if best in rates else ""
    )
    header += " tau (accepted draft tokens + 1 per cycle) |" if taus else ""
    lines = [header, "|---" * header.count(" |") + "|"]
    for name, tps in rates.items():
        speedup = report.get("speedup_by_method", {}).get(name)
        row = f"| `{name}` | {tps:.2f} | {'-' if speedup is None else f'{speedup:.2f}x'} |"
        row += f" {tps / rates[best]:.2f}x |" if best in rates else ""
        row += (f" {taus[name]:.2f} |" if name in taus else " - |") if taus else ""
        lines.append(row)
    threads = env.get("threads")
    vector = f"; vector units: {', '.join(env['vector_cpu_flags'])}" if env.get("vector_cpu_flags") else ""
    date = f", measured {env['date']}" if env.get("date") else ""
    lines += [
        "",
        f"Hardware: {env.get('cuda') or env.get('cpu')} ({env.get('machine')}, {env.get('cores')} cores; bf16 "
        f"units: {', '.join(env.get('bf16_cpu_flags') or []) or 'none'}), {threads} thread{'s' * (threads != 1)}"
        f"{vector}{date}. "
        f"Speculative precision: {cfg.get('spec_dtype')}"
        + (" (weights prepacked for oneDNN)" if cfg.get("prepacked") else "")
        + ". "
        f"Prompts: {cfg.get('num_prompts')} ({cfg.get('prompts')}) x {cfg.get('max_new_tokens')} new tokens, "
        f"greedy; {cfg.get('repeats')} repeats, configurations interleaved per prompt, medians over repeats. "
        f"Versions: torch {env.get('torch')}, transformers {env.get('transformers')}, eagle3_hf "
        f"{env.get('eagle3_hf')}, Python {env.get('python')}.",
    ]
    if "speedup" in report:
        lines.append(
            f"EAGLE-3 tree: {report['speedup']:.2f}x the fastest plain configuration (`{report['fastest_plain']}`), "
            f"{report['speedup_same_precision']:.2f}x plain at its own precision; tau {report.get('tau', 0):.2f} "
            f"over the {report.get('drafted_cycle_share', 0):.0%} of cycles that drafted; greedy outputs identical to "
            f"plain at the same precision: {report.get('identical', 0):.0%}."
        )
    if "row_exact" in report:
        lines.append(f"Row-invariance probe: {report['row_exact']['description']}.")
        if "verification" in report["row_exact"]:
            lines.append(f"Verification: {report['row_exact']['verification']}.")
    flips = [d["margin_ulps"] for d in report.get("divergences", []) if d.get("margin_ulps") is not None]
    if flips:
        lines.append(
            f"Each differing output left plain decoding where the fp32 target's top two tokens nearly tie: fp32 "
            f"top-2 margin{'s of ' + format(min(flips), '.2f') + '-' if len(flips) > 1 else ' of '}{max(flips):.2f} ulp "
            f"of the decoded precision "
            f"({len(flips)} divergence{'s' * (len(flips) != 1)}; above {NEAR_TIE_ULPS:g} ulp would be a bug)."
        )
    return "\n".join(lines)


def plot_acceptance(report: dict[str, Any], path: str, fmt: str | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("--plot needs matplotlib: pip install 'eagle3-hf[plot]' (or matplotlib).") from err
    rates = report["acceptance_by_depth"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(range(1, len(rates) + 1), [0.0 if a is None else a for a in rates])
    for d, a in enumerate(rates, 1):
        if a is None:  # no cycle got this deep: mark it rather than draw a zero bar
            ax.text(d, 0.02, "n/a", ha="center", fontsize=8)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"EAGLE-3 acceptance by depth (tau {report.get('tau', 0):.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format=fmt)  # fmt: the file name may not say (a temporary name)
