"""Where one EAGLE-3 cycle's time goes, step by step, measured inside a real decoding loop.

Runs greedy tree decoding of SmolLM2 (bf16, prepacked weights, the shipped draft, row-exact verification unless
`--no-exact-verify`) over a few MT-bench prompts with fixed trees of `--nodes` nodes (`adaptive_tree=False`, so every
cycle verifies the same number of nodes and drafts the same number of levels). The decoding loop times nothing for
it: this script wraps the loop's steps (`eagle3_hf/generation/engine.py`'s propose, verify, accept, keep_paths,
emit; the draft's forward and catch-up; the row-exact attention's prefix copies and kernel calls) with its own clocks
for the length of the run, and the loop's `eagle3_observer` hands it a `cycle.CycleRecord` per cycle (its tree,
and the draft and verify times the cost model measures anyway). It reports, in ms per cycle:

* the verify step (from the end of drafting to the accepted path's features being queued), cut into: the target
  forward (its mask included; inside it the row-exact attention's prefix copies and kernel calls), acceptance, cache
  compaction, and what is left (Python, feature gathering, the proposer's update);
* drafting: per cycle, the catch-up forward and one drafting level (the draft's forward);
* references outside the loop at the loop's median context, from the first prompt's own tokens: a bare target
  forward over the same tree (one tree-masked call, and row-exact), and a plain one-token step (forward, fp32 logits,
  argmax); plus plain greedy `generate()`'s time per token on the same prompts, and whether its output equals the
  tree's.

    python scripts/research/cycle_profile.py --num-prompts 3 --max-new-tokens 64 --threads 2 --json profile.json

Timings are wall-clock (`time.perf_counter`): run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import time
from collections.abc import Iterator

import torch
from exact_verify_cost import verify_forward  # this script's folder: scripts/research
from transformers import DynamicCache

from eagle3_hf.bench.runner import read_prompts
from eagle3_hf.draft_names import load_draft_for
from eagle3_hf.generation import drafting, engine, exact_attention, proposers
from eagle3_hf.generation.cycle import CycleRecord
from eagle3_hf.generation.exact_attention import exact_verification
from eagle3_hf.generation.target_cache import crop_cache
from eagle3_hf.generation.tree import tree_depths
from eagle3_hf.modeling.packed_linear import prepack_linears
from eagle3_hf.modeling.shipped import default_prompts_path
from eagle3_hf.targets import load_target, load_tokenizer
from eagle3_hf.utils.compat import cache_kwargs

# (module, attribute, section): what the clocks wrap for a run
WRAPPED = [
    (engine, "prefill", "prefill"),
    (engine, "verify", "target forward"),
    (engine, "accept", "acceptance"),
    (engine, "keep_paths", "cache compaction"),
    (engine, "emit", "emit (outside verify)"),
    (proposers, "catch_up", "draft: catch-up forward"),
    (drafting, "draft_forward", "draft: forward"),
    (exact_attention.ExactAttention, "layer_keys", "exact: prefix copies"),
    (exact_attention, "_decode_step_sdpa", "exact: attention kernel"),
]
VERIFY = ["target forward", "acceptance", "cache compaction"]
EXACT = ["exact: prefix copies", "exact: attention kernel"]


class Clocks:
    """Seconds and calls per section, per cycle: the open cycle's sections are closed by the loop's observer."""

    def __init__(self) -> None:
        self.cycles: list[dict] = []
        self.sections: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def timed(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sections[name] = self.sections.get(name, 0.0) + time.perf_counter() - start
                self.counts[name] = self.counts.get(name, 0) + 1
                if name == "prefill":  # forget what ran before the first cycle (the prefill's emit)
                    self.sections, self.counts = {}, {}

        return wrapper

    def observe(self, record: CycleRecord) -> None:
        info = dict(
            past=record.past,
            nodes=max(record.tree_sizes),
            accepted=sum(record.emitted) - len(record.rows),
            draft_s=record.draft_s,
            verify_s=record.verify_s,
            parents=record.parents[0],
        )
        self.cycles.append({"info": info, "sections": self.sections, "counts": self.counts})
        self.sections, self.counts = {}, {}

    @contextlib.contextmanager
    def wrapping(self) -> Iterator[None]:
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in WRAPPED]
        try:
            for (owner, name, section), (_, _, fn) in zip(WRAPPED, originals):
                setattr(owner, name, self.timed(section, fn))
            yield
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)


def median_ms(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def mean_ms(cycles: list[dict], name: str) -> float:
    return 1e3 * sum(c["sections"].get(name, 0.0) for c in cycles) / max(len(cycles), 1)


def summarize(cycles: list[dict]) -> dict:
    """Per-cycle means (ms) of the verify step's and the drafting's sections."""
    verify = {name: mean_ms(cycles, name) for name in VERIFY}
    exact = {name: mean_ms(cycles, name) for name in EXACT}
    total = 1e3 * statistics.mean(c["info"]["verify_s"] for c in cycles)
    verify["target forward: the rest (projections, MLP, norms, head, cache, mask)"] = verify["target forward"] - sum(
        exact.values()
    )
    verify["Python and other (total minus the sections)"] = total - sum(verify[name] for name in VERIFY)
    # the draft's forwards: one per level, plus the catch-up's own
    forwards = sum(c["counts"].get("draft: forward", 0) for c in cycles)
    catch_ups = sum(c["counts"].get("draft: catch-up forward", 0) for c in cycles)
    levels = (forwards - catch_ups) / len(cycles)
    level_ms = (
        mean_ms(cycles, "draft: forward") * len(cycles)
        - 1e3 * sum(c["sections"].get("draft: catch-up forward", 0.0) for c in cycles)
    ) / max(forwards - catch_ups, 1)
    return {
        "cycles": len(cycles),
        "verify_ms": total,
        "verify_sections_ms": verify,
        "exact_attention_sections_ms": exact,
        "accepted_per_cycle": statistics.mean(c["info"]["accepted"] for c in cycles) + 1,
        "draft_ms": 1e3 * statistics.mean(c["info"]["draft_s"] for c in cycles),
        "draft_levels_per_cycle": levels,
        "draft_level_ms": level_ms,
        "catch_up_ms": mean_ms(cycles, "draft: catch-up forward"),
        "emit_ms": mean_ms(cycles, "emit (outside verify)"),
    }


@torch.no_grad()
def references(model, ids: torch.Tensor, context: int, parents: list[int], repeats: int) -> dict:
    """Bare forwards outside the loop at `context` tokens of `ids`: the same tree in one call and row-exact, and a
    plain one-token step (forward, fp32 logits of the one row, argmax), ms."""
    parents_t = torch.tensor(parents)
    depths = tree_depths(parents_t)
    tokens = ids[:, context : context + len(parents)]
    tokens = torch.cat([tokens, ids[:, : len(parents) - tokens.shape[1]]], dim=1)  # any tokens will do
    out = {}
    with exact_verification(model) as state:
        cache = DynamicCache()
        model(ids[:, :context], use_cache=True, **cache_kwargs(cache), eagle3_exact=state)

        def tree_forward(exact: bool) -> None:
            verify_forward(model, state, cache, tokens, parents_t, depths, context, exact)

        def plain_step() -> None:
            logits = model(ids[:, context : context + 1], use_cache=True, eagle3_exact=state, **cache_kwargs(cache))
            logits.logits[:, -1].float().argmax()
            crop_cache(cache, context)

        out["tree_one_call_ms"] = median_ms(lambda: tree_forward(False), repeats)
        out["tree_row_exact_ms"] = median_ms(lambda: tree_forward(True), repeats)
        out["plain_step_ms"] = median_ms(plain_step, repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default=None, help="draft folder (default: the shipped draft for the target)")
    parser.add_argument("--prompts", default=None, help="MT-bench question.jsonl or JSONL prompts (default: MT-bench)")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--every", type=int, default=8, help="take every n-th prompt (8: one per MT-bench category)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=16, help="tree size verified every cycle, root included")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--no-exact-verify", action="store_true", help="verify each tree in one tree-masked call")
    parser.add_argument("--repeats", type=int, default=10, help="repeats of each reference forward (median)")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    if args.nodes < 2 or args.depth < 2 or args.top_k < 1:
        raise ValueError("--nodes and --depth must be >= 2 and --top-k >= 1")
    torch.set_num_threads(args.threads)
    model = load_target(args.target, dtype=torch.bfloat16)
    draft = load_draft_for(args.target, model, args.draft)
    prepack_linears(model)
    prepack_linears(draft)
    prompts = read_prompts(
        args.prompts or default_prompts_path(), load_tokenizer(args.target), args.num_prompts, args.every
    )
    tree_kwargs = dict(
        assistant_model=draft,
        adaptive_tree=False,
        tree_total_tokens=args.nodes,
        tree_depth=args.depth,
        tree_top_k=args.top_k,
        exact_verify=not args.no_exact_verify,
        do_sample=False,
        max_new_tokens=args.max_new_tokens,
        return_dict_in_generate=True,
    )
    model.generate(prompts[0], **{**tree_kwargs, "max_new_tokens": 8})  # warm-up
    model.generate(prompts[0], max_new_tokens=8, do_sample=False)
    cycles, identical, plain_token_s, outputs = [], [], [], []
    for ids in prompts:
        clocks = Clocks()
        with clocks.wrapping():
            tree_out = model.generate(ids, eagle3_observer=clocks.observe, **tree_kwargs)
        cycles += [c for c in clocks.cycles if c["info"]["nodes"] == args.nodes]
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        plain = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        new = plain.shape[1] - ids.shape[1]
        plain_token_s.append((time.perf_counter() - start - prefill) / max(new - 1, 1))
        identical.append(torch.equal(plain, tree_out.sequences))
        outputs.append(tree_out.sequences)
    if not cycles:
        raise ValueError(f"no cycle verified {args.nodes} nodes (the draft proposed fewer): lower --nodes")
    report = summarize(cycles)
    context = int(statistics.median(c["info"]["past"] for c in cycles))
    ids = outputs[0]
    context = min(context, ids.shape[1] - 1)
    report["references"] = references(model, ids, context, cycles[-1]["info"]["parents"], args.repeats)
    report["references"]["context"] = context
    report["references"]["plain_generate_per_token_ms"] = 1e3 * statistics.median(plain_token_s)
    report["identical_to_plain"] = identical
    report["settings"] = {k: v for k, v in vars(args).items() if k != "json"}
    report["settings"]["torch"] = torch.__version__
    print_report(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def print_report(report: dict, args: argparse.Namespace) -> None:
    ref = report["references"]
    plain = ref["plain_step_ms"]
    mode = "one tree-masked call" if args.no_exact_verify else "row-exact"
    print(
        f"{report['cycles']} cycles of {args.nodes} nodes ({mode}), {args.threads} threads, median context "
        f"{ref['context']}; {report['accepted_per_cycle']:.2f} tokens per cycle; greedy output identical to plain: "
        f"{sum(report['identical_to_plain'])}/{len(report['identical_to_plain'])}"
    )
    print(f"\nverify step: {report['verify_ms']:.2f} ms = {report['verify_ms'] / plain:.2f}x a plain step")
    for name, ms in report["verify_sections_ms"].items():
        print(f"  {name:<66} {ms:7.2f}")
    for name, ms in report["exact_attention_sections_ms"].items():
        print(f"    {name:<64} {ms:7.2f}")
    print(
        f"\ndrafting: {report['draft_ms']:.2f} ms per cycle, {report['draft_levels_per_cycle']:.1f} levels; "
        f"one level {report['draft_level_ms']:.2f} ms"
    )
    print(f"  catch-up forward per cycle {report['catch_up_ms']:.2f} ms; emit per cycle {report['emit_ms']:.2f} ms")
    print(
        f"\nreferences at context {ref['context']}: plain one-token step {plain:.2f} ms; the same tree bare, one call "
        f"{ref['tree_one_call_ms']:.2f} ms, row-exact {ref['tree_row_exact_ms']:.2f} ms; plain generate() "
        f"{ref['plain_generate_per_token_ms']:.2f} ms per token"
    )


if __name__ == "__main__":
    main()
