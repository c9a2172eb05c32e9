"""`bench --batch-size`: the batches it builds, a tiny batched benchmark run, its table, and bad sizes refused."""

import pytest
import torch
from helpers.bench import _tiny_target
from helpers.cli import assert_clean_error, run

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.bench.batch import format_batch_table, left_padded_batches, run_batch_benchmark


def test_batches_are_left_padded_groups_cycled_to_fill():
    prompts = [torch.tensor([[5, 6, 7]]), torch.tensor([[8]]), torch.tensor([[9, 10]])]
    batches = left_padded_batches(prompts, 2, pad_id=0)
    assert len(batches) == 1  # 3 prompts make one full batch of 2
    ids, mask = batches[0]
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    ((ids, mask),) = left_padded_batches(prompts, 4, pad_id=1)  # fewer prompts than rows: cycled
    assert ids[:, -1].tolist() == [7, 8, 10, 7] and int(mask.sum()) == 3 + 1 + 2 + 3
    with pytest.raises(ValueError, match="batch sizes must be >= 1"):
        left_padded_batches(prompts, 0, pad_id=0)


def test_tiny_batched_benchmark_compares_rows_with_plain():
    target = _tiny_target()
    draft = bind_target(Eagle3DraftModel.from_target(target).eval(), target)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 24, (1, n), generator=generator) for n in (4, 9, 6, 7)]
    report = run_batch_benchmark(
        {torch.float32: target},
        draft,
        torch.float32,
        prompts,
        [1, 2, 4],
        max_new_tokens=8,
        tree_kwargs={"adaptive_tree": False},
        repeats=1,
        pad_id=0,
    )
    assert list(report["batch_sizes"]) == ["1", "2", "4"]
    for size, entry in report["batch_sizes"].items():
        assert set(entry["tokens_per_s"]) == {"plain_fp32", "eagle3_tree_fp32"}
        assert entry["rows_identical_to_plain"] == "4/4"  # fp32 greedy is lossless, row by row
        assert entry["batches"] == 4 // int(size)
        assert entry["vs_fastest_plain"] == pytest.approx(
            entry["tokens_per_s"]["eagle3_tree_fp32"] / entry["tokens_per_s"]["plain_fp32"]
        )
    table = format_batch_table(report).splitlines()
    assert len(table) == 2 + 3 and table[0].startswith("| batch | `plain_fp32` tokens/s")
    assert table[3].startswith("| 2 | ") and table[3].endswith(" | 4/4 |")


def test_tiny_batched_benchmark_hands_the_corpus_to_eagle3_only():
    from eagle3_hf.generation.corpus_index import CorpusIndex

    target = _tiny_target()
    draft = bind_target(Eagle3DraftModel.from_target(target).eval(), target)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 24, (1, n), generator=generator) for n in (5, 8)]
    # the corpus holds the target's own greedy answers, so its continuations are accepted
    answers = [target.generate(p, do_sample=False, max_new_tokens=8, pad_token_id=0)[0, p.shape[1] :] for p in prompts]
    corpus = CorpusIndex.build(answers, vocab_size=target.config.vocab_size)
    calls = []
    generate = target.generate

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return generate(*args, **kwargs)

    target.generate = spy
    report = run_batch_benchmark(
        {torch.float32: target}, draft, torch.float32, prompts, [2], 8, {"adaptive_tree": False}, 1, 0, corpus=corpus
    )
    assert report["corpus"] == "CorpusIndex"
    assert report["batch_sizes"]["2"]["rows_identical_to_plain"] == "2/2"
    eagle = [c for c in calls if "assistant_model" in c]
    assert eagle and all(c["corpus"] is corpus for c in eagle)
    assert all("corpus" not in c for c in calls if "assistant_model" not in c)


@pytest.mark.parametrize("value", ["0", "4,x", ""])
def test_bench_refuses_bad_batch_sizes(capsys, value):
    code, _, err = run(capsys, "bench", "--batch-size", value)
    assert_clean_error(code, err, "--batch-size takes comma-separated sizes >= 1")


def test_the_results_batch_table_is_the_reports_own():
    import json
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    path = "scripts/research/results/bench_batch_smollm2_bf16.json"
    table = format_batch_table(json.loads((root / path).read_text(encoding="utf-8")))
    results = (root / "docs" / "research" / "results.md").read_text(encoding="utf-8")
    assert table in results and f"(../../{path})" in results
