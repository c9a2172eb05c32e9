"""The benchmark behind `eagle3-hf bench` (`eagle3_hf.commands.bench`): EAGLE-3 against the fastest plain configuration on this machine.

Configurations, each named `<method>_<precision>`:

* plain greedy `generate` in fp32 and in bf16: which one is faster depends on the hardware (on a CPU, one-token
  steps can be faster in fp32 while wide forwards are much cheaper in bf16), and a speedup only counts against
  the faster one;
* EAGLE-3 chain (fixed depth) and tree (cost-model sized) at the speculative precision: `--dtype auto` picks bf16
  where the hardware has native bf16 matmul and fp32 elsewhere (`eagle3_hf.utils.precision`);
* optionally: transformers' prompt lookup at the speculative precision (`prompt_lookup`: 10 tokens per lookup;
  `prompt_lookup_sweep`: 3, 5 and 10, the report naming the fastest); the hybrid tree (`hybrid_tree`: the draft's
  tree with the context lookup's continuations grafted in, `context_lookup=True`, and the corpus's when one is given
  or saved beside the draft); the model-free lookup tree (`lookup_tree`: `ContextLookup`, no draft); and the
  model-free context + corpus tree (`corpus_tree`: `ContextLookup(corpus=...)`, needs a corpus). Tree methods report
  how many accepted tokens came from the draft, the context lookup, the corpus, or several of them, and tau counted
  both ways: over the cycles that drafted (`tau_by_method`), and the field's way, accepted draft tokens + 1 per
  cycle over every cycle (`tau_field_by_method`), which compares with published acceptance lengths.

They run in one process after a warm-up, interleaved per prompt (these machines are noisy: interleaving spreads a
slowdown over every configuration), `--repeats` times; tokens/s are medians over the repeats. Where a greedy EAGLE-3
output differs from plain decoding at its precision, the report says where, and how close the fp32 target's
choice was there (`bench_report.divergence`). Prints a table and writes JSON (and optionally markdown and a PNG).
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from eagle3_hf.bench.report import (  # noqa: F401  (re-exported: the benchmark's public pieces)
    acceptance_by_depth,
    cycle_breakdown,
    divergence,
    environment,
    format_markdown,
    format_table,
    plot_acceptance,
)
from eagle3_hf.modeling.chat_template import apply_chat_template
from eagle3_hf.utils.precision import short_name

METHODS = (
    "plain",
    "prompt_lookup",
    "prompt_lookup_sweep",
    "eagle3_chain",
    "eagle3_tree",
    "hybrid_tree",
    "lookup_tree",
    "corpus_tree",
)
DEFAULT_METHODS = ("plain", "eagle3_chain", "eagle3_tree")
PLAIN_DTYPES = (torch.float32, torch.bfloat16)
PROMPT_LOOKUP_SWEEP = (3, 5, 10)  # prompt_lookup_num_tokens tried by `prompt_lookup_sweep`
DRAFT_METHODS = ("eagle3_chain", "eagle3_tree", "hybrid_tree")  # the methods that need a draft
TREE_METHODS = (*DRAFT_METHODS, "lookup_tree", "corpus_tree")  # decoded by our tree loop (they report cycles)
SOURCES = ("draft", "context", "corpus", "several")  # where accepted tokens came from (hybrid.SOURCE_NAMES)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmarked configuration: a decoding method at a precision (and, for prompt lookup, its tokens)."""

    method: str
    dtype: torch.dtype
    lookup_tokens: int | None = None  # prompt_lookup_num_tokens of a swept prompt-lookup configuration

    @property
    def name(self) -> str:
        tokens = "" if self.lookup_tokens is None else str(self.lookup_tokens)
        return f"{self.method}{tokens}_{short_name(self.dtype)}"


def plain_dtypes_for(device: str | torch.device, native_bf16: bool) -> tuple[torch.dtype, ...]:
    """The precisions plain decoding is benchmarked in: fp32 and bf16 (`PLAIN_DTYPES`), but fp32 alone on a CPU
    without native bf16 matmul (`native_bf16`: `eagle3_hf.utils.precision.has_native_bf16_matmul()`), where bf16 runs
    emulated, an order of magnitude slower than fp32: such a run would take most of the benchmark's time and could
    never be the fastest plain configuration."""
    if torch.device(device).type == "cpu" and not native_bf16:
        return (torch.float32,)
    return PLAIN_DTYPES


def bench_configs(
    spec_dtype: torch.dtype,
    methods: tuple[str, ...] = DEFAULT_METHODS,
    plain_dtypes: tuple[torch.dtype, ...] = PLAIN_DTYPES,
) -> list[BenchConfig]:
    """The configurations to run: plain in every `plain_dtypes` (and `spec_dtype`), the others at `spec_dtype`."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"Unknown method(s) {unknown}; choose from {list(METHODS)}.")
    configs: list[BenchConfig] = []
    if "plain" in methods:
        configs += [BenchConfig("plain", d) for d in dict.fromkeys((*plain_dtypes, spec_dtype))]
    for m in METHODS:
        if m == "prompt_lookup_sweep" and m in methods:
            configs += [BenchConfig("prompt_lookup", spec_dtype, n) for n in PROMPT_LOOKUP_SWEEP]
        elif m != "plain" and m in methods:
            configs.append(BenchConfig(m, spec_dtype))
    return configs


def read_prompts(
    path: str, tokenizer: Any, num_prompts: int | None, every: int = 1, enable_thinking: bool | None = None
) -> list[torch.Tensor]:
    """Prompts from MT-bench `question.jsonl` (`turns`, first turn used) or JSONL with `prompt` or `messages`,
    rendered with the tokenizer's chat template (its thinking switch `enable_thinking`; None: the template's
    default): every `every`-th record (MT-bench lists its 8 categories in
    blocks of 10, so every 8th question covers them all), at most `num_prompts` of them."""
    if every < 1:
        raise ValueError(f"every must be >= 1 (take every n-th prompt), got {every}.")
    prompts: list[list[dict]] = []
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    for line_no, line in lines[::every]:
        record = json.loads(line)
        if "turns" in record:
            messages = [{"role": "user", "content": record["turns"][0]}]
        elif "messages" in record:  # the conversation up to its first assistant turn (system prompt kept)
            first_answer = next((i for i, m in enumerate(record["messages"]) if m.get("role") == "assistant"), None)
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
        apply_chat_template(
            tokenizer,
            m,
            enable_thinking=enable_thinking,
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        for m in prompts
    ]


@dataclass
class ConfigResult:
    tokens: list[int] = field(default_factory=list)  # per repeat, over all prompts
    seconds: list[float] = field(default_factory=list)  # per repeat
    outputs: list[list[list[int]]] = field(default_factory=list)  # [repeat][prompt] new tokens
    accept_lengths: list[int] = field(default_factory=list)  # drafted cycles only, all repeats
    cycles: int = 0  # all verification cycles, drafted or not
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    sources: list[int] = field(default_factory=lambda: [0] * len(SOURCES))  # accepted tokens by source, as SOURCES

    @property
    def rates(self) -> list[float]:
        return [t / s if s else 0.0 for t, s in zip(self.tokens, self.seconds)]

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0


def run_benchmark(
    targets: dict[torch.dtype, Any],
    drafts: dict[torch.dtype, Any],
    prompts: list[torch.Tensor],
    configs: list[BenchConfig],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    tree_kwargs: dict[str, Any] | None = None,
    repeats: int = 1,
    warmup_tokens: int = 16,
    lookup_kwargs: dict[str, Any] | None = None,
    corpus: Any = None,
) -> dict[str, Any]:
    """Measure every configuration on every prompt (interleaved), `repeats` times; return the report dict.

    `targets` maps each precision to the target loaded in it, `drafts` each speculative precision to the draft bound
    to that target. The fp32 target, when given, also scores where greedy outputs diverge. `lookup_kwargs` go to the
    lookup tree (`tree_depth`, `tree_total_tokens`, `lookup_branches` of `ContextLookup`) and, as `lookup_depth` /
    `lookup_branches`, to the hybrid tree. `corpus` (a `CorpusIndex` or its file): the corpus of `corpus_tree`, used
    by `hybrid_tree` too (without one, `hybrid_tree` uses the draft's own corpus file, if it has one).
    """
    from eagle3_hf.generation.decoding import ContextLookup

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}.")
    missing = sorted(
        {str(c.dtype) for c in configs if c.dtype not in targets}
        | {str(c.dtype) for c in configs if c.method in DRAFT_METHODS and c.dtype not in drafts}
    )
    if missing:
        raise ValueError(f"No target or draft given for precision(s) {missing} that the configurations need.")
    if corpus is None and any(c.method == "corpus_tree" for c in configs):
        raise ValueError("corpus_tree needs a corpus: pass corpus= (a CorpusIndex or a file of `eagle3-hf corpus`).")
    tree_kwargs = dict(tree_kwargs or {})
    sample = temperature > 0
    common: dict[str, Any] = {"do_sample": sample}
    if sample:
        common.update(temperature=temperature, top_k=0)
    eagle = next((c for c in configs if c.method in DRAFT_METHODS), None)
    depth = tree_kwargs.get("tree_depth", drafts[eagle.dtype].config.tree_depth) if eagle else 0
    # the draft-only methods name `context_lookup=False` and `corpus=False`, since generate() grafts the lookup in by
    # default, and the corpus a draft's folder holds
    chain_kwargs = {k: v for k, v in tree_kwargs.items() if k not in ("tree_top_k", "tree_total_tokens")}
    chain_kwargs.update(context_lookup=False, corpus=False)  # the draft alone
    lookup_kwargs = dict(lookup_kwargs or {})
    hybrid_kwargs = dict(
        tree_kwargs,
        context_lookup=True,
        **{
            k: v
            for k, v in (
                ("lookup_depth", lookup_kwargs.get("tree_depth")),
                ("lookup_branches", lookup_kwargs.get("lookup_branches")),
            )
            if v is not None
        },
        **({} if corpus is None else {"corpus": corpus}),
    )
    # the lookup tree is sized by its own options; it shares the verification options with the draft trees
    lookup_tree_kwargs = {k: v for k, v in tree_kwargs.items() if k in ("adaptive_tree", "exact_verify")}
    lookup_tree_kwargs.update(lookup_kwargs)
    lookups = {
        (m, d): ContextLookup(corpus=corpus if m == "corpus_tree" else None).bind(t)
        for d, t in targets.items()
        for m in ("lookup_tree", "corpus_tree")
    }

    def call(config: BenchConfig, ids: torch.Tensor, max_new: int) -> Any:
        target, draft = targets[config.dtype], drafts.get(config.dtype)
        kwargs = dict(common, max_new_tokens=max_new, attention_mask=torch.ones_like(ids))
        if config.method == "plain":
            return target.generate(ids, **kwargs)
        if config.method == "prompt_lookup":
            return target.generate(ids, prompt_lookup_num_tokens=config.lookup_tokens or 10, **kwargs)
        if config.method == "hybrid_tree":
            return target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **hybrid_kwargs, **kwargs)
        if config.method in ("lookup_tree", "corpus_tree"):
            return target.generate(
                ids,
                assistant_model=lookups[config.method, config.dtype],
                return_dict_in_generate=True,
                **lookup_tree_kwargs,
                **kwargs,
            )
        if (
            config.method == "eagle3_chain"
        ):  # a fixed-depth chain: every cycle drafts `depth` tokens (the paper's n-alpha)
            return target.generate(
                ids,
                assistant_model=draft,
                return_dict_in_generate=True,
                tree_top_k=1,
                tree_total_tokens=depth + 1,
                **dict(chain_kwargs, adaptive_tree=False),
                **kwargs,
            )
        return target.generate(
            ids,
            assistant_model=draft,
            return_dict_in_generate=True,
            **dict(tree_kwargs, context_lookup=False, corpus=False),
            **kwargs,
        )

    results = {c.name: ConfigResult() for c in configs}
    with torch.no_grad():
        for c in configs:  # warm-up: first calls pay for allocations and lazy initialisation
            call(c, prompts[0], warmup_tokens)
        for repeat in range(repeats):
            for r in results.values():
                r.tokens.append(0)
                r.seconds.append(0.0)
                r.outputs.append([])
            for ids in tqdm(prompts, desc=f"Benchmark (repeat {repeat + 1}/{repeats})", unit="prompt"):
                for c in configs:
                    torch.manual_seed(0)
                    device_ids = ids.to(targets[c.dtype].device)
                    start = time.perf_counter()
                    out = call(c, device_ids, max_new_tokens)
                    seconds = time.perf_counter() - start
                    sequences = out.sequences if hasattr(out, "sequences") else out
                    new = sequences[0, ids.shape[1] :].tolist()
                    r = results[c.name]
                    r.seconds[-1] += seconds
                    r.tokens[-1] += len(new)
                    r.outputs[-1].append(new)
                    if getattr(out, "accept_lengths", None) is not None:
                        # cycles that verified a drafted tree (the cost model may verify the root alone)
                        r.accept_lengths.extend(a for a, n in zip(out.accept_lengths, out.tree_sizes) if n > 1)
                        r.cycles += len(out.accept_lengths)
                        r.prefill_s += out.prefill_time
                        r.draft_s += out.draft_time
                        r.verify_s += out.verify_time
                        found = (
                            out.accepted_from_draft,
                            out.accepted_from_lookup,
                            out.accepted_from_corpus,
                            out.accepted_from_both,
                        )
                        r.sources = [a + b for a, b in zip(r.sources, found)]
        report = _report(results, configs, prompts, depth)
        if not sample:
            _add_divergences(report, results, configs, prompts, targets)
    return report


def _report(results: dict[str, ConfigResult], configs: list[BenchConfig], prompts: list, depth: int) -> dict:
    report: dict[str, Any] = {
        "configurations": [c.name for c in configs],
        "tokens_per_s": {name: r.tokens_per_s for name, r in results.items()},
        "tokens_per_s_by_repeat": {name: r.rates for name, r in results.items()},
    }
    plain = [c.name for c in configs if c.method == "plain"]
    by_method = {c.method: c for c in configs}
    tree_config = by_method.get("eagle3_tree")
    tree = results[tree_config.name] if tree_config else None
    if tree is not None:
        drafted = tree.accept_lengths
        report["tau"] = sum(drafted) / len(drafted) if drafted else 0.0
        report["drafted_cycle_share"] = len(drafted) / tree.cycles if tree.cycles else 0.0
    chain = results[by_method["eagle3_chain"].name] if "eagle3_chain" in by_method else None
    if chain is not None and chain.accept_lengths:
        report["tau_chain"] = sum(chain.accept_lengths) / len(chain.accept_lengths)
        report["acceptance_by_depth"] = acceptance_by_depth(chain.accept_lengths, depth)
        # how many cycles each rate is measured over (those that reached depth d-1): deep rates rest on few
        report["acceptance_by_depth_cycles"] = [
            sum(1 for a in chain.accept_lengths if a - 1 >= d - 1) for d in range(1, depth + 1)
        ]
    trees = [c.name for c in configs if c.method in TREE_METHODS]
    if trees:
        report["tau_by_method"] = {
            n: sum(results[n].accept_lengths) / len(results[n].accept_lengths) if results[n].accept_lengths else 0.0
            for n in trees
        }
        report["accepted_by_source"] = {n: dict(zip(SOURCES, results[n].sources)) for n in trees}
        # the field's tau: accepted draft tokens + 1 per cycle, over every cycle (plain steps count 1)
        report["tau_field_by_method"] = {
            n: (sum(results[n].sources) + results[n].cycles) / results[n].cycles if results[n].cycles else 0.0
            for n in trees
        }
    lookups = [c.name for c in configs if c.method == "prompt_lookup"]
    if lookups:
        best_lookup = max(lookups, key=lambda n: results[n].tokens_per_s)
        report["best_prompt_lookup"] = best_lookup
        for method in ("lookup_tree", "corpus_tree"):
            if method in by_method and results[best_lookup].tokens_per_s:
                ours = results[by_method[method].name].tokens_per_s
                report[f"{method}_vs_best_prompt_lookup"] = ours / results[best_lookup].tokens_per_s
    if plain:
        fastest = max(plain, key=lambda n: results[n].tokens_per_s)
        best = results[fastest].tokens_per_s
        report["fastest_plain"] = fastest
        report["speedup_by_method"] = {n: (r.tokens_per_s / best if best else 0.0) for n, r in results.items()}
        if tree is not None:
            same = results[BenchConfig("plain", tree_config.dtype).name]
            report["speedup"] = tree.tokens_per_s / best if best else 0.0
            report["speedup_same_precision"] = tree.tokens_per_s / same.tokens_per_s if same.tokens_per_s else 0.0
        report["plain_ms_per_token"] = {
            n: 1000 * sum(results[n].seconds) / max(sum(results[n].tokens), 1) for n in plain
        }
    report["time_per_cycle_ms"] = {
        n: cycle_breakdown(
            sum(r.seconds), sum(r.tokens), r.cycles, len(prompts) * len(r.seconds), r.prefill_s, r.draft_s, r.verify_s
        )
        for n, r in results.items()
        if r.cycles
    }
    report["tokens"] = {n: sum(r.tokens) for n, r in results.items()}
    report["seconds"] = {n: sum(r.seconds) for n, r in results.items()}
    return report


def _add_divergences(report: dict, results: dict, configs: list[BenchConfig], prompts: list, targets: dict) -> None:
    """Greedy EAGLE-3 outputs against plain decoding at the same precision: the share identical, and for each one
    that is not, where and at what fp32 margin it left (once per distinct divergence)."""
    scorer = targets.get(torch.float32)
    for c in configs:
        reference = results.get(f"plain_{short_name(c.dtype)}")
        if c.method not in TREE_METHODS or reference is None:
            continue
        runs = [(r, p) for r in range(len(reference.outputs)) for p in range(len(prompts))]
        mine = results[c.name].outputs
        same = sum(mine[r][p] == reference.outputs[r][p] for r, p in runs)
        report["identical" if c.method == "eagle3_tree" else f"identical_{c.method}"] = same / len(runs)
        if c.method != "eagle3_tree" or scorer is None:
            continue
        seen: set[tuple] = set()
        found = []
        for r, p in runs:
            ref_out, out = reference.outputs[r][p], mine[r][p]
            key = (p, tuple(ref_out), tuple(out))
            if out == ref_out or key in seen:
                continue
            seen.add(key)
            d = divergence(scorer, prompts[p], ref_out, out, same_precision=targets[c.dtype])
            found.append({"prompt": p, "repeat": r, **d})
        report["divergences"] = found


def row_exact_report(target: Any, exact_verify: bool | str = "auto") -> dict[str, Any]:
    """Which verification the speculative target's calls ran for `exact_verify` and why (verify_choice.py), with the
    row-invariance probe behind the choice (generation/probe.py): whether a row-exact verify forward equals one-token
    steps bit for bit, and if not which op first differs (off the CPU: the one tree-masked call decoding runs)."""
    from eagle3_hf.generation.probe import probe_row_exactness
    from eagle3_hf.generation.verify_choice import choose_verification, probe_for_target

    choice = choose_verification(target, exact_verify)
    if choice.probe is not None:
        result = choice.probe
    elif target.device.type == "cpu":
        result = probe_for_target(target)  # exact_verify=False: still say what row-exact would have given
    else:
        result = probe_row_exactness(target, exact_verify=False)
    return {
        "identical": result.identical,
        "first_difference": result.first_difference,
        "max_logit_difference": result.max_logit_difference,
        "description": result.describe(),
        "verification": choice.mode,
        "verification_reason": choice.reason,
    }


def load_models(
    args: Any,
    spec_dtype: torch.dtype,
    dtypes: set[torch.dtype],
    need_draft: bool = True,
) -> tuple[dict, dict, bool]:
    """The target in every precision needed (loaded once, copied and cast), the draft bound to the speculative one
    (none unless `need_draft`), and whether bf16 CPU weights were prepacked."""
    from eagle3_hf.draft_names import load_draft_for
    from eagle3_hf.modeling.packed_linear import prepack_linears
    from eagle3_hf.targets import cast_weights, load_target

    base = load_target(args.target, dtype=torch.float32, device=args.device)
    targets = {
        d: base if d == torch.float32 else cast_weights(copy.deepcopy(base), d) for d in dtypes | {torch.float32}
    }
    draft = load_draft_for(args.target, targets[spec_dtype], args.draft) if need_draft else None
    prepacked = False
    if not args.no_prepack:
        for model in (*[t for d, t in targets.items() if d == torch.bfloat16], *([draft] if draft else [])):
            prepacked |= prepack_linears(model) > 0
    return targets, ({spec_dtype: draft} if draft is not None else {}), prepacked
