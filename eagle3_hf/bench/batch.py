"""`eagle3-hf bench --batch-size 1,4,8`: batched EAGLE-3 against plain batched generate().

For each batch size the prompts are grouped, in order, into left-padded batches of mixed lengths (cycled when there
are fewer prompts than rows). Each batch is decoded greedily by plain batched `generate()` in fp32 and in bf16, and by
EAGLE-3 (`generate(assistant_model=draft)` at its defaults: the hybrid tree, sized by the cost model over the rows;
named `eagle3_tree_<precision>` in the report) at the speculative precision, interleaved per batch after
a warm-up, `repeats` times. Tokens/s count every row's generated tokens up to and including its EOS (the padding
after it is not output), over the whole batch; the medians over repeats are reported, with each EAGLE-3 row compared
with plain decoding's row at the same precision.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from eagle3_hf.utils.precision import short_name

__all__ = ["format_batch_table", "left_padded_batches", "run_batch_benchmark"]


def left_padded_batches(prompts: list[torch.Tensor], size: int, pad_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive groups of `size` prompts as `(ids, mask)` `[size, longest]`, left-padded with `pad_id`."""
    if size < 1:
        raise ValueError(f"batch sizes must be >= 1, got {size}.")
    count = max(1, len(prompts) // size)
    cycled = [prompts[i % len(prompts)] for i in range(count * size)]
    batches = []
    for start in range(0, len(cycled), size):
        group = cycled[start : start + size]
        width = max(p.shape[1] for p in group)
        ids = torch.full((size, width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):
            ids[row, width - prompt.shape[1] :] = prompt[0]
            mask[row, width - prompt.shape[1] :] = 1
        batches.append((ids, mask))
    return batches


def _generated(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
        rows.append(row[:end])
    return rows


def run_batch_benchmark(
    targets: dict[torch.dtype, Any],
    draft: Any,
    spec_dtype: torch.dtype,
    prompts: list[torch.Tensor],
    batch_sizes: list[int],
    max_new_tokens: int,
    tree_kwargs: dict[str, Any],
    repeats: int,
    pad_id: int,
    corpus: Any = None,
) -> dict[str, Any]:
    """Tokens/s per batch size and configuration (`plain_fp32`, `plain_bf16`, `eagle3_tree_<spec>`), and how many
    EAGLE-3 rows equal plain decoding's at the speculative precision. `corpus` (a `CorpusIndex` or its file) is
    handed to EAGLE-3's `generate()`, whose hybrid tree then proposes from it too."""
    eos = targets[spec_dtype].generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    names = {f"plain_{short_name(d)}": d for d in sorted(targets, key=str)}
    eagle_name = f"eagle3_tree_{short_name(spec_dtype)}"
    report: dict[str, Any] = {"batch_sizes": {}, "max_new_tokens": max_new_tokens, "repeats": repeats}
    eagle_options = dict(tree_kwargs, **({} if corpus is None else {"corpus": corpus}))
    if corpus is not None:
        report["corpus"] = str(corpus) if isinstance(corpus, (str, os.PathLike)) else type(corpus).__name__
    for size in batch_sizes:
        batches = left_padded_batches(prompts, size, pad_id)

        def decode(name: str, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
            options = dict(attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=pad_id)
            if name == eagle_name:
                return targets[spec_dtype].generate(ids, assistant_model=draft, **options, **eagle_options)
            return targets[names[name]].generate(ids, **options)

        configs = [*names, eagle_name]
        for name in configs:  # warm-up: first calls pay for allocations and kernel choices
            decode(name, *batches[0], 8)
        seconds = {name: [0.0] * repeats for name in configs}
        tokens = {name: [0] * repeats for name in configs}
        outputs: dict[str, list[list[int]]] = {name: [] for name in configs}
        for repeat in range(repeats):
            for ids, mask in batches:
                for name in configs:
                    t0 = time.perf_counter()
                    out = decode(name, ids, mask, max_new_tokens)
                    seconds[name][repeat] += time.perf_counter() - t0
                    rows = _generated(out, ids.shape[1], eos)
                    tokens[name][repeat] += sum(len(row) for row in rows)
                    if repeat == 0:
                        outputs[name] += rows
        rates = {name: statistics.median(t / s for t, s in zip(tokens[name], seconds[name])) for name in configs}
        reference = outputs[f"plain_{short_name(spec_dtype)}"]
        same = sum(a == b for a, b in zip(outputs[eagle_name], reference))
        fastest = max(rates[name] for name in names)
        report["batch_sizes"][str(size)] = {
            "tokens_per_s": rates,
            "vs_fastest_plain": rates[eagle_name] / fastest,
            "rows_identical_to_plain": f"{same}/{len(reference)}",
            "batches": len(batches),
        }
    return report


def format_batch_table(report: dict[str, Any]) -> str:
    """A markdown table: one line per batch size, tokens/s per configuration, EAGLE-3 against the fastest plain."""
    sizes = report["batch_sizes"]
    configs = list(next(iter(sizes.values()))["tokens_per_s"])
    lines = [
        "| batch | " + " | ".join(f"`{name}` tokens/s" for name in configs) + " | EAGLE-3 vs fastest plain | rows "
        "identical to plain |",
        "|---" * (len(configs) + 3) + "|",
    ]
    for size, entry in sizes.items():
        rates = " | ".join(f"{entry['tokens_per_s'][name]:.1f}" for name in configs)
        lines.append(f"| {size} | {rates} | {entry['vs_fastest_plain']:.2f}x | {entry['rows_identical_to_plain']} |")
    return "\n".join(lines)
