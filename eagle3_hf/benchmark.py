"""The benchmark behind `eagle3-hf bench` (`eagle3_hf.commands.bench`): plain greedy, prompt lookup, EAGLE-3
chain and EAGLE-3 tree, side by side.

All methods run in one process after a warm-up, interleaved per prompt (these machines are noisy:
interleaving spreads any slowdown over every method), with the torch thread count fixed and
reported. Prints a table and writes JSON (and optionally a PNG of acceptance by depth).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from eagle3_hf.model_card import format_rates

METHODS = ("plain", "prompt_lookup", "eagle3_chain", "eagle3_tree")


def read_prompts(path: str, tokenizer: Any, num_prompts: int | None) -> list[torch.Tensor]:
    """Prompts from MT-bench `question.jsonl` (`turns`, first turn used) or JSONL with `prompt` or `messages`,
    rendered with the tokenizer's chat template."""
    prompts: list[list[dict]] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "turns" in record:
                messages = [{"role": "user", "content": record["turns"][0]}]
            elif "messages" in record:  # the conversation up to its first assistant turn (system prompt kept)
                first_answer = next(
                    (i for i, m in enumerate(record["messages"]) if m.get("role") == "assistant"), None
                )
                messages = record["messages"][:first_answer]
            elif "prompt" in record:
                messages = [{"role": "user", "content": record["prompt"]}]
            else:
                raise ValueError(
                    f"{path}:{line_no}: expected a record with 'turns' (MT-bench), 'prompt' or 'messages'; "
                    f"got keys {sorted(record)}."
                )
            prompts.append(messages)
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
    if not prompts:
        raise ValueError(f"No prompts found in {path}.")
    return [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        for m in prompts
    ]


@dataclass
class MethodResult:
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)  # drafted cycles only
    cycles: int = 0  # all verification cycles, drafted or not
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


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


def cycle_breakdown(r: MethodResult) -> dict[str, float]:
    """Where an EAGLE-3 method's time goes, in milliseconds per verification cycle: drafting the tree, the target's
    verify forward with acceptance and cache compaction, and everything else generate() does around them (token
    bookkeeping, stopping criteria, logits processors, setup); the prompt's prefill is kept apart."""
    per = 1000.0 / r.cycles
    other = r.seconds - r.prefill_s - r.draft_s - r.verify_s
    return {
        "draft": r.draft_s * per, "verify": r.verify_s * per, "other": other * per,
        "tokens_per_cycle": r.tokens / r.cycles, "prefill_per_prompt": 1000.0 * r.prefill_s / len(r.outputs),
    }


def run_benchmark(
    target: Any,
    draft: Any,
    prompts: list[torch.Tensor],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    tree_kwargs: dict[str, Any] | None = None,
    methods: tuple[str, ...] = METHODS,
    warmup_tokens: int = 16,
) -> dict[str, Any]:
    """Measure every method on every prompt (interleaved); return the report dict."""
    tree_kwargs = dict(tree_kwargs or {})
    sample = temperature > 0
    common: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": sample}
    if sample:
        common.update(temperature=temperature, top_k=0)
    depth = tree_kwargs.get("tree_depth", draft.config.tree_depth)
    chain_kwargs = {k: v for k, v in tree_kwargs.items() if k not in ("tree_top_k", "tree_total_tokens")}

    def call(method: str, ids: torch.Tensor, max_new: int) -> Any:
        kwargs = dict(common, max_new_tokens=max_new, attention_mask=torch.ones_like(ids))
        if method == "plain":
            return target.generate(ids, **kwargs)
        if method == "prompt_lookup":
            return target.generate(ids, prompt_lookup_num_tokens=10, **kwargs)
        if method == "eagle3_chain":  # a fixed-depth chain: every cycle drafts `depth` tokens (the paper's n-alpha)
            return target.generate(
                ids, assistant_model=draft, return_dict_in_generate=True, tree_top_k=1,
                tree_total_tokens=depth + 1, **dict(chain_kwargs, adaptive_tree=False), **kwargs,
            )
        return target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **tree_kwargs, **kwargs)

    results = {m: MethodResult() for m in methods}
    with torch.no_grad():
        for m in methods:  # warm-up: first calls pay for allocations and lazy initialisation
            call(m, prompts[0].to(target.device), warmup_tokens)
        for ids in tqdm(prompts, desc="Benchmark", unit="prompt"):
            ids = ids.to(target.device)
            for m in methods:
                torch.manual_seed(0)
                start = time.perf_counter()
                out = call(m, ids, max_new_tokens)
                seconds = time.perf_counter() - start
                sequences = out.sequences if hasattr(out, "sequences") else out
                new = sequences[0, ids.shape[1] :].tolist()
                r = results[m]
                r.seconds += seconds
                r.tokens += len(new)
                r.outputs.append(new)
                if getattr(out, "accept_lengths", None) is not None:
                    # cycles that verified a drafted tree (the cost model may verify the root alone)
                    r.accept_lengths.extend(a for a, n in zip(out.accept_lengths, out.tree_sizes) if n > 1)
                    r.cycles += len(out.accept_lengths)
                    r.prefill_s += out.prefill_time
                    r.draft_s += out.draft_time
                    r.verify_s += out.verify_time
    report: dict[str, Any] = {"tokens_per_s": {m: results[m].tokens_per_s for m in methods}}
    plain = results.get("plain")
    tree = results.get("eagle3_tree")
    if tree is not None:
        drafted = tree.accept_lengths
        report["tau"] = sum(drafted) / len(drafted) if drafted else 0.0
        report["drafted_cycle_share"] = len(drafted) / tree.cycles if tree.cycles else 0.0
    if "eagle3_chain" in results and results["eagle3_chain"].accept_lengths:
        chain = results["eagle3_chain"].accept_lengths
        report["tau_chain"] = sum(chain) / len(chain)
        report["acceptance_by_depth"] = acceptance_by_depth(chain, depth)
        # how many cycles each rate is measured over (those that reached depth d-1): deep rates rest on few
        report["acceptance_by_depth_cycles"] = [sum(1 for a in chain if a - 1 >= d - 1) for d in range(1, depth + 1)]
    if plain is not None and tree is not None:
        report["speedup"] = tree.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
        if not sample:
            same = sum(a == b for a, b in zip(plain.outputs, tree.outputs))
            report["identical"] = same / len(plain.outputs)
    if plain is not None:
        report["speedup_by_method"] = {
            m: (results[m].tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0) for m in methods
        }
    report["time_per_cycle_ms"] = {m: cycle_breakdown(results[m]) for m in methods if results[m].cycles}
    if plain is not None and plain.tokens:
        report["plain_ms_per_token"] = 1000 * plain.seconds / plain.tokens
    report["tokens"] = {m: results[m].tokens for m in methods}
    report["seconds"] = {m: results[m].seconds for m in methods}
    return report


def environment() -> dict[str, Any]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'method':<16}{'tokens/s':>10}{'speedup':>9}"]
    for m, tps in report["tokens_per_s"].items():
        speedup = report.get("speedup_by_method", {}).get(m)  # absent without plain to compare with
        lines.append(f"{m:<16}{tps:>10.2f}" + (f"{speedup:>8.2f}x" if speedup is not None else f"{'-':>9}"))
    if "tau" in report:
        lines.append(
            f"tau (tree, incl. bonus, over drafted cycles): {report['tau']:.2f}; "
            f"drafted cycles {report.get('drafted_cycle_share', 0):.0%}"
        )
    if "tau_chain" in report:
        lines.append(f"tau (chain, incl. bonus): {report['tau_chain']:.2f}")
    if "identical" in report:
        lines.append(f"greedy outputs identical to plain: {report['identical']:.0%}")
    if "acceptance_by_depth" in report:
        lines.append("acceptance by depth (chain): " + format_rates(report["acceptance_by_depth"], " "))
        if "acceptance_by_depth_cycles" in report:
            lines.append("  measured over cycles: " + " ".join(str(n) for n in report["acceptance_by_depth_cycles"]))
    for m, b in report.get("time_per_cycle_ms", {}).items():
        lines.append(
            f"{m} per cycle: draft {b['draft']:.1f} ms, verify {b['verify']:.1f} ms, other {b['other']:.1f} ms; "
            f"{b['tokens_per_cycle']:.2f} tokens/cycle"
        )
    if "plain_ms_per_token" in report and report.get("time_per_cycle_ms"):
        lines.append(f"plain: {report['plain_ms_per_token']:.1f} ms per token")
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
