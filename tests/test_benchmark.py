"""The benchmark's pure pieces, a tiny end-to-end benchmark run, and model-card rendering."""

import copy
import json

import pytest
import torch
from helpers.bench import _tiny_target
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.bench.cards import format_rates
from eagle3_hf.bench.runner import (
    acceptance_by_depth,
    bench_configs,
    divergence,
    format_markdown,
    format_table,
    plain_dtypes_for,
    read_prompts,
    run_benchmark,
)


def test_acceptance_by_depth_hand_computed():
    # cycles accepting 0, 1, 2 and 2 draft tokens (accept lengths count the bonus token)
    rates = acceptance_by_depth([1, 2, 3, 3], max_depth=3)
    # depth 1: 3 of 4 cycles got past depth 0; depth 2: 2 of those 3; depth 3: none of those 2
    assert rates == pytest.approx([3 / 4, 2 / 3, 0.0])
    # no cycle reached depth 3, so depth 4 is unmeasured (None), not a zero acceptance rate
    assert acceptance_by_depth([1, 2, 3, 3], max_depth=4)[3] is None
    assert format_rates([0.5, None], " ") == "0.50 n/a"


class _Template:
    def apply_chat_template(self, messages, add_generation_prompt, return_tensors, return_dict):
        text = " ".join(m["content"] for m in messages)
        return {"input_ids": torch.tensor([[len(w) % 7 + 3 for w in text.split()]])}


def test_read_prompts_formats_and_errors(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(
        json.dumps({"turns": ["one two", "later"]})
        + "\n"
        + json.dumps({"prompt": "three four five"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "six"}]})
        + "\n"
    )
    prompts = read_prompts(str(path), _Template(), None)
    assert [p.shape[1] for p in prompts] == [2, 3, 1]
    assert len(read_prompts(str(path), _Template(), 2)) == 2
    assert [p.shape[1] for p in read_prompts(str(path), _Template(), None, every=2)] == [2, 1]  # records 1 and 3
    with pytest.raises(ValueError, match="every must be >= 1"):
        read_prompts(str(path), _Template(), None, every=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a record with 'turns'"):
        read_prompts(str(bad), _Template(), None)


def test_plain_bf16_is_left_out_where_the_cpu_emulates_it():
    assert plain_dtypes_for("cpu", native_bf16=False) == (torch.float32,)
    assert plain_dtypes_for("cpu", native_bf16=True) == (torch.float32, torch.bfloat16)
    assert plain_dtypes_for("cuda", native_bf16=False) == (torch.float32, torch.bfloat16)  # the GPU's, not the CPU's
    names = [c.name for c in bench_configs(torch.bfloat16, ("plain", "eagle3_tree"), plain_dtypes_for("cpu", False))]
    assert names == ["plain_fp32", "plain_bf16", "eagle3_tree_bf16"]  # asked for: the same-precision baseline stays


def test_configurations_list_plain_in_both_precisions_and_eagle3_at_the_speculative_one():
    names = [c.name for c in bench_configs(torch.bfloat16)]
    assert names == ["plain_fp32", "plain_bf16", "eagle3_chain_bf16", "eagle3_tree_bf16"]
    names = [c.name for c in bench_configs(torch.float32, ("plain", "eagle3_tree", "prompt_lookup"))]
    assert names == ["plain_fp32", "plain_bf16", "prompt_lookup_fp32", "eagle3_tree_fp32"]
    # the speculative precision always has its own plain run, the same-precision baseline
    names = [c.name for c in bench_configs(torch.float16, ("plain", "eagle3_tree"), plain_dtypes=(torch.float32,))]
    assert names == ["plain_fp32", "plain_fp16", "eagle3_tree_fp16"]
    with pytest.raises(ValueError, match=r"Unknown method\(s\) \['beam'\]"):
        bench_configs(torch.float32, ("plain", "beam"))


def test_tiny_benchmark_reports_every_configuration():
    target = _tiny_target()
    draft = bind_target(Eagle3DraftModel.from_target(target).eval(), target)
    prompts = [torch.randint(3, 24, (1, 6)) for _ in range(2)]
    configs = bench_configs(torch.float32, ("plain", "prompt_lookup", "eagle3_chain", "eagle3_tree"), (torch.float32,))
    report = run_benchmark(
        {torch.float32: target},
        {torch.float32: draft},
        prompts,
        configs,
        max_new_tokens=12,
        tree_kwargs={"adaptive_tree": False},
        repeats=2,
    )
    names = ["plain_fp32", "prompt_lookup_fp32", "eagle3_chain_fp32", "eagle3_tree_fp32"]
    assert report["configurations"] == names and list(report["tokens_per_s"]) == names
    assert all(len(report["tokens_per_s_by_repeat"][n]) == 2 for n in names)
    for n in names:  # the median of two repeats is their mean
        assert report["tokens_per_s"][n] == pytest.approx(sum(report["tokens_per_s_by_repeat"][n]) / 2)
    assert report["fastest_plain"] == "plain_fp32"
    assert report["speedup"] == pytest.approx(
        report["tokens_per_s"]["eagle3_tree_fp32"] / report["tokens_per_s"]["plain_fp32"]
    )
    assert report["speedup_same_precision"] == pytest.approx(report["speedup"])  # one plain precision only
    assert report["identical"] == 1.0 and report["identical_eagle3_chain"] == 1.0  # fp32 greedy is lossless
    assert report["divergences"] == []
    assert report["tokens"]["eagle3_tree_fp32"] == report["tokens"]["plain_fp32"] == 2 * 24
    assert report["tau"] >= 1.0 and len(report["acceptance_by_depth"]) == draft.config.tree_depth
    cycles = report["acceptance_by_depth_cycles"]
    per_cycle = report["time_per_cycle_ms"]["eagle3_chain_fp32"]["tokens_per_cycle"]
    assert cycles[0] == pytest.approx(report["tokens"]["eagle3_chain_fp32"] / per_cycle)  # every chain cycle drafts
    assert all(a >= b for a, b in zip(cycles, cycles[1:]))
    table = format_table(report)
    assert "tau (tree, incl. bonus, over drafted cycles)" in table and "(fastest plain)" in table
    assert report["drafted_cycle_share"] == 1.0  # adaptive_tree=False: every cycle verifies a drafted tree
    # Where the time goes: only the EAGLE-3 configurations have cycles; the parts add up to their measured time.
    breakdown = report["time_per_cycle_ms"]
    assert set(breakdown) == {"eagle3_chain_fp32", "eagle3_tree_fp32"}
    for m, b in breakdown.items():
        assert b["draft"] > 0 and b["verify"] > 0 and b["other"] >= 0
        cycles = report["tokens"][m] / b["tokens_per_cycle"]
        total_ms = (b["draft"] + b["verify"] + b["other"]) * cycles + b["prefill_per_prompt"] * 2 * len(prompts)
        assert total_ms == pytest.approx(1000 * report["seconds"][m], rel=1e-6)
    chain_only = run_benchmark(
        {torch.float32: target},
        {torch.float32: draft},
        prompts[:1],
        bench_configs(torch.float32, ("eagle3_chain",)),
        max_new_tokens=4,
    )
    row = format_table(chain_only).splitlines()[1].split()
    assert row == ["eagle3_chain_fp32", f"{chain_only['tokens_per_s']['eagle3_chain_fp32']:.2f}", "-"]  # no plain
    with pytest.raises(ValueError, match=r"No target or draft given for precision\(s\) \['torch.bfloat16'\]"):
        run_benchmark({torch.float32: target}, {torch.float32: draft}, prompts, bench_configs(torch.bfloat16))


def test_lookup_methods_report_their_sources_and_the_best_prompt_lookup():
    target = _tiny_target()
    draft = bind_target(Eagle3DraftModel.from_target(target).eval(), target)
    phrase = torch.randint(3, 24, (5,), generator=torch.Generator().manual_seed(0))
    prompts = [torch.cat([phrase] * 3)[None]]  # repeats, so that the lookups fire
    configs = bench_configs(
        torch.float32, ("plain", "prompt_lookup_sweep", "hybrid_tree", "lookup_tree"), (torch.float32,)
    )
    names = [
        "plain_fp32",
        "prompt_lookup3_fp32",
        "prompt_lookup5_fp32",
        "prompt_lookup10_fp32",
        "hybrid_tree_fp32",
        "lookup_tree_fp32",
    ]
    assert [c.name for c in configs] == names
    report = run_benchmark(
        {torch.float32: target},
        {torch.float32: draft},
        prompts,
        configs,
        max_new_tokens=12,
        tree_kwargs={"adaptive_tree": False},
    )
    assert report["identical_hybrid_tree"] == report["identical_lookup_tree"] == 1.0
    assert report["best_prompt_lookup"] in names[1:4]
    best = report["tokens_per_s"][report["best_prompt_lookup"]]
    assert best == max(report["tokens_per_s"][n] for n in names[1:4])
    ours = report["tokens_per_s"]["lookup_tree_fp32"]
    assert report["lookup_tree_vs_best_prompt_lookup"] == pytest.approx(ours / best)
    sources = report["accepted_by_source"]
    assert set(sources) == {"hybrid_tree_fp32", "lookup_tree_fp32"}
    assert sources["lookup_tree_fp32"]["draft"] == sources["lookup_tree_fp32"]["several"] == 0
    assert set(report["tau_by_method"]) == set(sources)
    assert "fastest prompt lookup" in format_table(report)
    # the lookup tree needs no draft
    alone = run_benchmark(
        {torch.float32: target}, {}, prompts, bench_configs(torch.float32, ("lookup_tree",)), max_new_tokens=4
    )
    assert alone["tokens"]["lookup_tree_fp32"] == 4


def test_a_forced_divergence_is_reported_with_the_fp32_margin():
    target = _tiny_target(vocab=40)
    prompt = torch.randint(3, 40, (1, 5))
    reference = target.generate(prompt, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt))
    reference = reference[0, 5:].tolist()
    # Force a divergence at token 3: the target's second choice there, then anything.
    with torch.no_grad():
        logits = target(torch.cat([prompt, torch.tensor([reference[:3]])], 1)).logits[0, -1]
    top = logits.topk(2)
    assert top.indices[0] == reference[3]
    other = reference[:3] + [int(top.indices[1]), 7, 7]
    d = divergence(target, prompt, reference, other, same_precision=target)
    assert (d["position"], d["reference_token"], d["other_token"]) == (3, reference[3], int(top.indices[1]))
    assert d["top2_margin"] == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-5)
    assert d["token_gap"] == pytest.approx(d["top2_margin"], abs=1e-5) and d["token_gap"] > 0
    assert d["token_gap_same_precision"] == pytest.approx(d["token_gap"], abs=1e-5)
    assert d["fp32_choice"] == reference[3]
    assert divergence(target, prompt, reference, list(reference)) is None
    # one output stopping early is a divergence at its end, with no token to compare there
    short = divergence(target, prompt, reference, reference[:6])
    assert short["position"] == 6 and short["other_token"] is None and short["token_gap"] is None
    # The benchmark reports each diverging run with its prompt and repeat.
    from eagle3_hf.bench.runner import ConfigResult, _add_divergences

    results = {
        "plain_fp32": ConfigResult(outputs=[[reference, reference]]),
        "eagle3_tree_fp32": ConfigResult(outputs=[[reference, other]]),
    }
    report = {}
    _add_divergences(
        report,
        results,
        bench_configs(torch.float32, ("plain", "eagle3_tree"), (torch.float32,)),
        [prompt, prompt],
        {torch.float32: target},
    )
    assert report["identical"] == 0.5
    assert [(x["prompt"], x["repeat"], x["position"]) for x in report["divergences"]] == [(1, 0, 3)]
    assert "prompt 1 (repeat 0) diverges at token 3" in format_table({"tokens_per_s": {}, **report})


def test_bench_command_lists_the_benchmark_methods():
    from eagle3_hf.bench.runner import DEFAULT_METHODS, METHODS
    from eagle3_hf.commands.bench import DEFAULT_METHODS as DEFAULTS
    from eagle3_hf.commands.bench import METHODS as CHOICES

    assert CHOICES == METHODS and DEFAULTS == DEFAULT_METHODS


def test_hub_finds_the_shipped_draft_and_prompts():
    import os

    from eagle3_hf.modeling.shipped import default_prompts_path, shipped_draft_path

    assert os.path.isfile(os.path.join(shipped_draft_path("smollm2"), "model.safetensors"))
    assert os.path.isfile(default_prompts_path())
    with pytest.raises(ValueError, match="No draft is shipped for target 'gpt2'"):
        shipped_draft_path("gpt2")


def test_bf16_flips_happen_only_at_near_ties():
    # A target with large weights, decoded in bf16 with always-full trees verified in one tree-masked attention call
    # (exact_verify=False, as on implementations row-exact verification does not cover): wide verify forwards round
    # differently from one-token steps, so greedy EAGLE-3 output may leave plain bf16 decoding -- but only where the
    # fp32 target nearly ties. In fp32 the same run is identical to plain decoding.
    from eagle3_hf.bench.report import NEAR_TIE_ULPS
    from eagle3_hf.targets import cast_weights

    torch.manual_seed(5)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            eos_token_id=None,
            bos_token_id=None,
            initializer_range=0.2,
        )
    ).eval()
    low = cast_weights(copy.deepcopy(target), torch.bfloat16)
    drafts = {
        torch.bfloat16: bind_target(Eagle3DraftModel.from_target(low).eval(), low),
        torch.float32: bind_target(Eagle3DraftModel.from_target(target).eval(), target),
    }
    prompts = [torch.randint(3, 300, (1, 8)) for _ in range(4)]
    targets = {torch.float32: target, torch.bfloat16: low}
    reports = {
        dtype: run_benchmark(
            targets,
            drafts,
            prompts,
            bench_configs(dtype, ("plain", "eagle3_tree"), plain_dtypes=()),
            max_new_tokens=24,
            tree_kwargs={"adaptive_tree": False, "exact_verify": False},
            warmup_tokens=2,
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    assert reports[torch.float32]["identical"] == 1.0 and reports[torch.float32]["divergences"] == []
    flips = reports[torch.bfloat16]["divergences"]
    assert len(flips) == round(4 * (1 - reports[torch.bfloat16]["identical"]))  # one report per differing output
    assert all(0 <= d["margin_ulps"] < NEAR_TIE_ULPS for d in flips), flips


def test_markdown_table_states_what_the_numbers_were_measured_on():
    report = {
        "tokens_per_s": {"plain_fp32": 20.0, "plain_bf16": 25.0, "eagle3_tree_bf16": 30.0},
        "speedup_by_method": {"plain_fp32": 0.8, "plain_bf16": 1.0, "eagle3_tree_bf16": 1.2},
        "fastest_plain": "plain_bf16",
        "speedup": 1.2,
        "speedup_same_precision": 1.2,
        "tau": 2.5,
        "drafted_cycle_share": 0.5,
        "identical": 0.9,
        "divergences": [{"margin_ulps": 0.6}, {"margin_ulps": 1.1}],
        "environment": {
            "cpu": "Some Xeon",
            "machine": "x86_64",
            "cores": 2,
            "bf16_cpu_flags": ["amx_bf16"],
            "threads": 2,
            "torch": "2.13.0",
            "transformers": "5.24.0",
            "eagle3_hf": "0.1.0",
            "python": "3.11.9",
        },
        "config": {
            "spec_dtype": "bf16",
            "prepacked": True,
            "num_prompts": 10,
            "max_new_tokens": 128,
            "repeats": 3,
            "prompts": "MT-bench turn 1, every 8th record",
        },
    }
    text = format_markdown(report)
    assert "| `eagle3_tree_bf16` | 30.00 | 1.20x |" in text and "| `plain_fp32` | 20.00 | 0.80x |" in text
    for fact in (
        "Some Xeon (x86_64, 2 cores; bf16 units: amx_bf16), 2 threads",
        "Speculative precision: bf16",
        "10 (MT-bench turn 1, every 8th record) x 128 new tokens",
        "3 repeats",
        "torch 2.13.0",
        "transformers 5.24.0",
        "eagle3_hf 0.1.0",
        "1.20x the fastest plain configuration (`plain_bf16`)",
        "top-2 margins of 0.60-1.10 ulp",
    ):
        assert fact in text, fact


def test_bench_reports_the_row_invariance_probe():
    from helpers.exact import bf16_target

    from eagle3_hf.bench.report import format_markdown
    from eagle3_hf.bench.runner import row_exact_report

    report = {"tokens_per_s": {"eagle3_tree_bf16": 1.0}, "row_exact": row_exact_report(bf16_target("llama"))}
    assert report["row_exact"]["identical"] and report["row_exact"]["first_difference"] is None
    line = "row-invariance probe: verify forward == one-token steps bit for bit (16-node tree (row-exact)"
    assert line in format_table(report)
    assert "Row-invariance probe: verify forward == one-token steps bit for bit" in format_markdown(report)
