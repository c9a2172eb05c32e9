"""The benchmark's pure pieces, a tiny end-to-end benchmark run, and model-card rendering."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.benchmark import acceptance_by_depth, format_table, read_prompts, run_benchmark
from eagle3_hf.model_card import format_rates


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
        json.dumps({"turns": ["one two", "later"]}) + "\n" + json.dumps({"prompt": "three four five"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "six"}]}) + "\n"
    )
    prompts = read_prompts(str(path), _Template(), None)
    assert [p.shape[1] for p in prompts] == [2, 3, 1]
    assert len(read_prompts(str(path), _Template(), 2)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected a record with 'turns'"):
        read_prompts(str(bad), _Template(), None)


def test_tiny_benchmark_reports_every_method():
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=24, eos_token_id=None, bos_token_id=None)
    ).eval()
    draft = Eagle3DraftModel.from_target(target).eval()
    prompts = [torch.randint(3, 24, (1, 6)) for _ in range(2)]
    report = run_benchmark(target, draft, prompts, max_new_tokens=12, tree_kwargs={"adaptive_tree": False})
    assert set(report["tokens_per_s"]) == {"plain", "prompt_lookup", "eagle3_chain", "eagle3_tree"}
    assert report["identical"] == 1.0  # greedy EAGLE-3 reproduces plain generate
    assert report["tokens"]["eagle3_tree"] == report["tokens"]["plain"] == 24
    assert report["tau"] >= 1.0 and len(report["acceptance_by_depth"]) == draft.config.tree_depth
    cycles = report["acceptance_by_depth_cycles"]
    per_cycle = report["time_per_cycle_ms"]["eagle3_chain"]["tokens_per_cycle"]
    assert cycles[0] == pytest.approx(report["tokens"]["eagle3_chain"] / per_cycle)  # every chain cycle drafts
    assert all(a >= b for a, b in zip(cycles, cycles[1:]))
    assert "tau (tree, incl. bonus, over drafted cycles)" in format_table(report)
    assert report["drafted_cycle_share"] == 1.0  # adaptive_tree=False: every cycle verifies a drafted tree
    # Where the time goes: only the EAGLE-3 methods have cycles; the parts add up to their measured time.
    breakdown = report["time_per_cycle_ms"]
    assert set(breakdown) == {"eagle3_chain", "eagle3_tree"}
    for m, b in breakdown.items():
        assert b["draft"] > 0 and b["verify"] > 0 and b["other"] >= 0
        cycles = report["tokens"][m] / b["tokens_per_cycle"]
        total_ms = (b["draft"] + b["verify"] + b["other"]) * cycles + b["prefill_per_prompt"] * len(prompts)
        assert total_ms == pytest.approx(1000 * report["seconds"][m], rel=1e-6)
    assert "eagle3_tree per cycle: draft" in format_table(report)
    chain_only = run_benchmark(target, draft, prompts[:1], max_new_tokens=4, methods=("eagle3_chain",))
    row = format_table(chain_only).splitlines()[1].split()
    assert row == ["eagle3_chain", f"{chain_only['tokens_per_s']['eagle3_chain']:.2f}", "-"]  # no plain: no ratio


def test_bench_command_lists_the_benchmark_methods():
    from eagle3_hf.benchmark import METHODS
    from eagle3_hf.commands.bench import METHODS as CHOICES

    assert CHOICES == METHODS


def test_hub_finds_the_shipped_draft_and_prompts():
    import os

    from eagle3_hf.hub import default_prompts_path, shipped_draft_path

    assert os.path.isfile(os.path.join(shipped_draft_path("smollm2"), "model.safetensors"))
    assert os.path.isfile(default_prompts_path())
    with pytest.raises(ValueError, match="No draft is shipped for target 'gpt2'"):
        shipped_draft_path("gpt2")
