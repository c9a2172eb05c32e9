"""`eagle3-hf generate`: says what it loads, streams the answer (and whether it was cut), reports tau and the drafted
cycles, then times EAGLE-3 and plain decoding in turn over repeats, on the cores other jobs leave free: medians, their
ratio, spreads, and warnings when the CPU was busy."""

import re

import pytest
import torch
from helpers.cli_argv import argv
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_hf.cli import main as cli_main
from eagle3_hf.utils.precision import resolve_dtype, short_name


def _expected_answer(folder, prompt: str, max_new_tokens: int) -> str:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


CUT = "[cut at the 12-token limit; --max-new-tokens N lets the answer run longer]"


def _report(out: str, method: str = "EAGLE-3") -> tuple[str, str]:
    """(the streamed answer, without a cut note, and the report below it)."""
    streamed, _, summary = out.partition(f"\n{method}: ")
    assert summary, f"no {method} report line in {out!r}"
    return streamed.replace(CUT, "").split(" ...\n", 1)[-1], summary


def test_generate_streams_the_answer_and_reports_both_speeds(chat_target, capsys):
    folder, _ = chat_target
    args = [
        "generate",
        "--target",
        str(folder),
        "--draft",
        "random",
        "--prompt",
        "hello there",
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
    ]
    assert cli_main([*args, "--dtype", "float32", "--repeats", "2", "--repeat-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Loading {folder} and an untrained draft ...\n")  # said before anything loads
    streamed, summary = _report(out)
    expected = _expected_answer(folder, "hello there", 12)
    assert expected.strip() and streamed.strip() == expected.strip()  # the streamer printed the answer first
    assert CUT in out  # 12 new tokens and no end of sequence: the answer was cut, and the output says so
    assert re.match(r"12 tokens; tau [\d.]+ over the \d+ of \d+ cycles that drafted", summary)
    assert "\nplain:   12 tokens, identical output\n" in summary  # greedy fp32 is lossless
    # the timing: 2 repeats of 5 new tokens, medians and spreads, then the speedup
    assert "timed (fp32, 1 thread(s)): 2 repeat(s) of 5 new tokens, the methods in turn" in summary
    assert re.search(
        r"\n  EAGLE-3 +[\d.]+ tok/s  \(spread \d+%\)\n  plain +[\d.]+ tok/s  \(spread \d+%\)\n"
        r"  speedup +[\d.]+x +\(the ratio of the medians; the repeats' ratios spread \d+%\)",
        summary,
    )

    # --dtype auto: bf16 where this CPU has native bf16 matmul, fp32 elsewhere; said on the timing line
    assert cli_main([*args, "--repeats", "1", "--repeat-tokens", "2"]) == 0
    out = capsys.readouterr().out
    auto = short_name(resolve_dtype("auto", "cpu"))
    assert f"timed ({auto}, 1 thread(s)): 1 repeat(s) of 2 new tokens" in out
    assert "identical output" in out or f"({auto} rounding; `eagle3-hf bench` reports the fp32 margin" in out


def test_without_a_prompt_it_runs_each_built_in_prompt(chat_target, capsys):
    from eagle3_hf.commands.generate import BUILT_IN_PROMPTS

    folder, _ = chat_target
    args = [
        "generate",
        "--target",
        str(folder),
        "--draft",
        "random",
        "--max-new-tokens",
        "6",
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--repeats",
        "1",
    ]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    blocks = out.split(">>> ")[1:]  # one per prompt: its header line, the streamed answer, then the report
    assert len(blocks) == len(BUILT_IN_PROMPTS) >= 2
    for prompt, block in zip(BUILT_IN_PROMPTS, blocks):
        header, _, rest = block.partition("\n")
        assert header == prompt
        streamed, _, summary = rest.partition("\nEAGLE-3: ")
        expected = _expected_answer(folder, prompt, 6)
        assert streamed.replace(CUT.replace("12", "6"), "").strip() == expected.strip()
        assert re.match(r"\d+ tokens; tau [\d.]+ over the \d+ of \d+ cycles that drafted \(\d+%\)", summary)
        assert "\nplain:   " in summary and "identical output" in summary
        assert "1 repeat(s) of 6 new tokens" in summary  # --repeat-tokens (32) is capped at --max-new-tokens


def test_the_lookup_tree_and_the_hybrid_tree_from_the_command_line(chat_target, capsys):
    folder, _ = chat_target
    base = [
        "generate",
        "--target",
        str(folder),
        "--prompt",
        "hello there hello there",
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--repeats",
        "1",
        "--repeat-tokens",
        "2",
    ]
    expected = _expected_answer(folder, "hello there hello there", 12)
    # the hybrid tree is the default with a draft, reported as EAGLE-3; --no-context-lookup is the draft's tree alone
    for extra, method in (
        (["--draft", "lookup"], "lookup tree"),
        (["--draft", "random"], "EAGLE-3"),
        (["--draft", "random", "--no-context-lookup"], "EAGLE-3"),
    ):
        assert cli_main([*base, *extra]) == 0
        out = capsys.readouterr().out
        streamed, summary = _report(out, method)
        assert streamed.strip() == expected.strip()
        assert "identical output" in summary and re.search(rf"\n  {method} +[\d.]+ tok/s", summary)
        if "--no-context-lookup" in extra:  # nothing comes from a lookup that is off
            assert "the context lookup" not in summary


def test_the_corpus_from_the_command_line(chat_target, capsys, tmp_path):
    """--corpus FILE adds the corpus (here: the target's own answer to the prompt, twice) to the lookup tree; the
    output stays the target's and the corpus's tokens are accepted; --no-corpus reads none."""
    from eagle3_hf.generation.corpus_index import CorpusIndex

    folder, _ = chat_target
    prompt = "count to ten"
    base = [
        "generate",
        "--target",
        str(folder),
        "--prompt",
        prompt,
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
        "--dtype",
        "float32",
        "--repeats",
        "1",
        "--repeat-tokens",
        "2",
        "--draft",
        "lookup",
    ]
    expected = _expected_answer(folder, prompt, 12)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    answer = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    answer = answer[0, ids.shape[1] :].tolist()
    CorpusIndex.build([answer, answer], vocab_size=target.config.vocab_size).save(tmp_path / "corpus.safetensors")
    assert cli_main([*base, "--corpus", str(tmp_path / "corpus.safetensors")]) == 0
    streamed, summary = _report(capsys.readouterr().out, "lookup tree")
    assert streamed.strip() == expected.strip() and "identical output" in summary
    assert int(re.search(r"the corpus (\d+), several (\d+)", summary).group(1)) > 0
    assert cli_main([*base, "--no-corpus"]) == 0
    assert "the corpus 0, several 0" in _report(capsys.readouterr().out, "lookup tree")[1]


def test_no_compare_times_eagle3_alone(chat_target, capsys):
    folder, _ = chat_target
    assert (
        cli_main(
            argv(
                "generate",
                target=folder,
                draft="random",
                prompt="hi",
                max_new_tokens=4,
                threads=1,
                dtype="float32",
                no_compare=True,
                repeats=2,
            )
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plain" not in out.split("\nEAGLE-3: ")[1] and re.search(r"\n  EAGLE-3 +[\d.]+ tok/s", out)


# ------------------------------------------------------------------------------------------------------------------
# the parts of an honest measurement, on their own


def test_was_cut_tells_a_limit_from_an_end_of_sequence():
    from eagle3_hf.commands.generate import was_cut

    assert was_cut(torch.tensor([5, 6, 7]), 2, 3)  # at the limit, no EOS
    assert not was_cut(torch.tensor([5, 6, 2]), 2, 3)  # the last token is EOS
    assert not was_cut(torch.tensor([5, 6, 9]), [2, 9], 3)  # any of several EOS ids
    assert not was_cut(torch.tensor([5, 2]), 2, 3)  # stopped early
    assert was_cut(torch.tensor([5, 6, 7]), None, 3)  # a model without an EOS id


def test_spread():
    from eagle3_hf.commands.generate import spread

    assert spread([10.0, 12.0, 11.0]) == pytest.approx(2 / 11) and spread([7.0]) == 0.0
    # from 4 repeats on, the middle half: one burst-slowed repeat (35) moves it no more than it moves the median
    assert spread([50.0, 51.0, 49.0, 35.0, 52.0]) == pytest.approx((51.0 - 49.0) / 50.0)
    assert spread([1.0, 2.0, 3.0, 4.0]) == pytest.approx((3.25 - 1.75) / 2.5)


def test_pick_threads_takes_the_free_cores():
    from eagle3_hf.utils.cpu_load import pick_threads

    assert pick_threads(2, 0.0) == 2 and pick_threads(2, 0.2) == 2  # a fifth of a core busy: still free
    assert pick_threads(2, 0.3) == 1 and pick_threads(2, 1.0) == 1 and pick_threads(2, 1.25) == 1
    assert pick_threads(2, 1.3) == 0 and pick_threads(2, 2.0) == 0 and pick_threads(1, 0.9) == 0
    assert pick_threads(16, 3.5) == 12 and pick_threads(4, None) == 4  # unknown load: every core
    assert pick_threads(2, -0.1) == 2 and pick_threads(2, 5.0) == 0  # a load average can exceed the cores
    with pytest.raises(ValueError, match="cores must be >= 1, got 0"):
        pick_threads(0, 0.0)


def test_choose_threads_says_why_and_how_to_force():
    from eagle3_hf.commands.generate import choose_threads

    assert choose_threads(None, 2, 0.05) == (2, None, True)  # an idle machine: every core, nothing to say
    assert choose_threads(None, 2, None) == (2, None, True)  # no load to read (Windows): every core
    threads, note, timed = choose_threads(None, 2, 0.97)
    assert (threads, timed) == (1, True)
    assert (
        note == "other jobs keep 1.0 of the 2 cores busy: timing on the 1 free one(s) (--threads N forces N threads)."
    )
    threads, note, timed = choose_threads(None, 2, 1.9)  # none free: answer on one thread, time nothing
    assert (threads, timed) == (1, False)
    assert note.startswith("not timing: other jobs keep 1.9 of the 2 cores busy, none free") and "--threads N" in note
    assert choose_threads(1, 2, 0.97) == (1, None, True)  # forced, and there is a free core for it
    threads, note, timed = choose_threads(2, 2, 0.97)  # forced onto a busy core: timed, with a warning
    assert (threads, timed) == (2, True) and note.startswith("warning: other jobs keep 1.0 of the 2 cores busy")
    threads, note, timed = choose_threads(1, 2, 1.9)  # forced: always timed, even with no core free
    assert (threads, timed) == (1, True) and note.startswith("warning: other jobs keep 1.9 of the 2 cores busy")


def test_cpu_quota_reads_a_containers_limit(tmp_path):
    from eagle3_hf.utils.cpu_load import cpu_quota

    limit = tmp_path / "cpu.max"
    for text, cores in (("200000 100000\n", 2), ("150000 100000\n", 2), ("50000 100000\n", 1), ("max 100000\n", None)):
        limit.write_text(text)
        assert cpu_quota(str(limit)) == cores, text
    assert cpu_quota(str(tmp_path / "missing")) is None  # no cgroup v2 here: no quota


def test_busy_cores_reads_the_other_jobs_share_of_this_process_cores(monkeypatch, tmp_path):
    from eagle3_hf.utils import cpu_load

    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 100 500 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0 0 0\ncpu1 200 0 100 400 10 0 0 0 0 0\nintr 1 2 3\n"
    )
    assert cpu_load._cpu_times(str(stat)) == {0: (100, 200), 1: (300, 710)}  # (busy, total); iowait is idle
    samples = iter([{0: (100, 200), 1: (300, 700), 2: (0, 0)}, {0: (190, 300), 1: (310, 800), 2: (100, 100)}])
    monkeypatch.setattr(cpu_load, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(cpu_load.time, "sleep", lambda seconds: None)
    # cpu0 busy 90 of 100 jiffies, cpu1 10 of 100; cpu2 is not this process's
    assert cpu_load.busy_cores([0, 1]) == pytest.approx(1.0)


def test_a_timing_on_fewer_threads_than_cores_is_pinned_to_the_freest():
    from eagle3_hf.utils.cpu_load import busy_cores, freest_cpus

    loads = {0: 0.9, 1: 0.05, 2: 0.3, 3: 0.05}
    assert freest_cpus(loads, 1) == [1] and freest_cpus(loads, 2) == [1, 3] and freest_cpus(loads, 3) == [1, 2, 3]
    assert busy_cores([0, 1, 2, 3], loads=loads) == pytest.approx(1.3)  # given loads are not sampled again
    with pytest.raises(ValueError, match="count must be >= 1"):
        freest_cpus(loads, 0)


def test_time_in_turn_alternates_the_methods():
    from eagle3_hf.commands.generate import time_in_turn

    order = []

    def call(name):
        def run():
            order.append(name)
            return torch.zeros(1, 7, dtype=torch.long)  # 4 prompt tokens and 3 new ones

        return run

    rates = time_in_turn({"a": call("a"), "b": call("b")}, 3, prompt_length=4)
    assert order == ["a", "b", "b", "a", "a", "b"]  # in turn, each first every other round
    assert [len(v) for v in rates.values()] == [3, 3] and all(r > 0 for v in rates.values() for r in v)


def test_the_spread_warning_names_the_noisy_measurement(capsys):
    from eagle3_hf.commands.generate import _report_rates

    _report_rates({"EAGLE-3": [30.5, 30.0, 31.0], "plain": [20.0, 30.0, 25.0]}, "EAGLE-3")
    out, err = capsys.readouterr()
    assert re.search(r"  EAGLE-3 +30\.5 tok/s  \(spread 3%\)\n  plain +25\.0 tok/s  \(spread 40%\)", out)
    # the speedup is the ratio of the two medians printed (30.5 / 25.0 = 1.22), not the median of the repeats' ratios
    # (1.525, 1.0, 1.24: 1.24); their spread is (1.525 - 1.0) / 1.24
    assert "  speedup    1.22x      (the ratio of the medians; the repeats' ratios spread 42%)" in out
    assert "warning: the timed repeats spread by 40% (plain), 42% (speedup), more than 20%" in err
    _report_rates({"EAGLE-3": [30.0, 31.0], "plain": [20.0, 20.5]}, "EAGLE-3")
    assert capsys.readouterr().err == ""
