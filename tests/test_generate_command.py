"""`eagle3-hf generate`: streams the answer, then reports EAGLE-3 and plain tokens/s, tau and the drafted cycles."""

import re

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_hf.cli import main as cli_main
from eagle3_hf.precision import resolve_dtype, short_name


def _expected_answer(folder, prompt: str, max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_streams_the_answer_and_reports_both_speeds(chat_target, capsys):
    folder, _ = chat_target
    args = ["generate", "--target", str(folder), "--draft", "random", "--prompt", "hello there", "--max-new-tokens",
            "12", "--threads", "1"]  # fmt: skip
    assert cli_main([*args, "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    streamed, _, summary = out.partition("\nEAGLE-3 (fp32, 1 thread(s)): ")
    expected = _expected_answer(folder, "hello there", 12)
    assert expected.strip() and streamed.strip() == expected.strip()  # the streamer printed the answer first
    assert re.match(r"12 tokens in [\d.]+ s \([\d.]+ tok/s\); tau [\d.]+ over the \d+ of \d+ cycles that drafted", summary)
    assert re.search(r"plain   \(fp32, 1 thread\(s\)\): 12 tokens in [\d.]+ s \([\d.]+ tok/s\)", summary)
    assert re.search(r"speedup: [\d.]+x, identical output", summary)  # greedy fp32 is lossless

    # --dtype auto: bf16 where this CPU has native bf16 matmul, fp32 elsewhere; said on the report lines
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    auto = short_name(resolve_dtype("auto", "cpu"))
    assert f"EAGLE-3 ({auto}, 1 thread(s))" in out and f"plain   ({auto}, 1 thread(s))" in out
    assert "identical output" in out or f"({auto} rounding; `eagle3-hf bench` reports the fp32 margin" in out


def test_without_a_prompt_it_runs_each_built_in_prompt(chat_target, capsys):
    from eagle3_hf.commands.generate import BUILT_IN_PROMPTS

    folder, _ = chat_target
    args = ["generate", "--target", str(folder), "--draft", "random", "--max-new-tokens", "6", "--threads", "1",
            "--dtype", "float32"]  # fmt: skip
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    blocks = out.split(">>> ")[1:]  # one per prompt: its header line, the streamed answer, then the report
    assert len(blocks) == len(BUILT_IN_PROMPTS) >= 2
    for prompt, block in zip(BUILT_IN_PROMPTS, blocks):
        header, _, rest = block.partition("\n")
        assert header == prompt
        streamed, _, summary = rest.partition("\nEAGLE-3 (fp32, 1 thread(s)): ")
        assert streamed.strip() == _expected_answer(folder, prompt, 6).strip()
        assert re.match(r"\d+ tokens in [\d.]+ s \([\d.]+ tok/s\); tau [\d.]+ over the \d+ of \d+ cycles that "
                        r"drafted \(\d+%\)", summary)  # fmt: skip
        assert re.search(r"speedup: [\d.]+x, identical output", summary)


def test_the_lookup_tree_and_the_hybrid_tree_from_the_command_line(chat_target, capsys):
    folder, _ = chat_target
    base = ["generate", "--target", str(folder), "--prompt", "hello there hello there", "--max-new-tokens", "12",
            "--threads", "1", "--dtype", "float32"]  # fmt: skip
    expected = _expected_answer(folder, "hello there hello there", 12)
    # the hybrid tree is the default with a draft, reported as EAGLE-3; --no-context-lookup is the draft's tree alone
    for extra, method in ((["--draft", "lookup"], "lookup tree"), (["--draft", "random"], "EAGLE-3"),
                          (["--draft", "random", "--no-context-lookup"], "EAGLE-3")):  # fmt: skip
        assert cli_main([*base, *extra]) == 0
        out = capsys.readouterr().out
        streamed, _, summary = out.partition(f"\n{method} (fp32, 1 thread(s)): ")
        assert summary, f"no {method} report line in {out!r}"
        assert streamed.strip() == expected.strip()
        assert re.search(r"speedup: [\d.]+x, identical output", summary)
        if "--no-context-lookup" in extra:  # nothing comes from a lookup that is off
            assert "the context lookup" not in summary
