"""Online and offline target features: identical batches and losses, shards, resumption, disk checks, CLI."""

import json
import os
import shutil
from collections import namedtuple

import pytest
import torch
from helpers.cli_argv import argv

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training import features as features_module
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.features import FEATURES_FORMAT, estimate_feature_bytes, online_features, precompute_features
from eagle3_hf.training.trainer import Eagle3DataCollator, Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.ttt import ttt_forward, ttt_loss
from eagle3_hf.training.vocab import build_draft_vocab

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tiny_setup):
    return tiny_setup


def test_online_and_offline_batches_and_losses_are_identical(setup, tmp_path):
    target, draft, rows = setup
    paths = precompute_features(target, rows, tmp_path, top_k=8, dtype=torch.float32, shard_size=2, batch_size=2)
    assert [os.path.basename(p) for p in paths] == [
        "shard_00000.safetensors",
        "shard_00001.safetensors",
        "shard_00002.safetensors",
    ]
    data = OfflineFeatureDataset(tmp_path)
    assert len(data) == 5 and data.layer_ids == [2, 4, 5] and data.top_k == 8
    collate = Eagle3DataCollator()
    offline = collate([data[i] for i in range(5)])
    online = collate(list(rows))
    assert torch.equal(offline["input_ids"], online["input_ids"])
    assert torch.equal(offline["loss_mask"], online["loss_mask"])
    assert torch.equal(offline["attention_mask"], online["attention_mask"])
    assert offline["attention_mask"].sum(1).tolist() == [12, 10, 8, 6, 4]
    features, top_logits, top_ids = online_features(target, draft, online["input_ids"], online["attention_mask"], 8)
    assert features.shape == (5, 12, 96) and top_logits.shape == top_ids.shape == (5, 12, 8)
    torch.testing.assert_close(offline["target_hidden_states"], features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(offline["target_top_logits"], top_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(offline["target_top_ids"], top_ids.long())
    # Column 0 is the target's top token over its full vocabulary.
    with torch.no_grad():
        full = target(online["input_ids"], attention_mask=online["attention_mask"]).logits
    real = online["attention_mask"].bool()
    assert torch.equal(top_ids[..., 0][real].long(), full.argmax(-1)[real])
    outs = []
    for h, lg, ids in (
        (features, top_logits, top_ids),
        (offline["target_hidden_states"], offline["target_top_logits"], offline["target_top_ids"]),
    ):
        step_logits = ttt_forward(draft, online["input_ids"], h, online["attention_mask"], ttt_length=3)
        outs.append(ttt_loss(step_logits, lg, online["loss_mask"], draft.t2d, target_ids=ids))
    torch.testing.assert_close(outs[0].loss, outs[1].loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[0].step_correct, outs[1].step_correct)
    assert torch.equal(outs[0].step_in_vocab, outs[1].step_in_vocab)


def test_bf16_storage_and_the_printed_estimate(setup, tmp_path, capsys):
    target, draft, rows = setup
    paths = precompute_features(target, rows, tmp_path, top_k=16, dtype=torch.bfloat16, shard_size=8)
    printed = capsys.readouterr().out
    assert "5 samples, 40 tokens" in printed and "bfloat16" in printed and "top 16 logits" in printed
    row = OfflineFeatureDataset(tmp_path)[1]
    assert row["target_hidden_states"].dtype == torch.bfloat16 and row["target_hidden_states"].shape == (10, 96)
    assert row["target_top_logits"].dtype == torch.bfloat16 and row["target_top_logits"].shape == (10, 16)
    assert row["target_top_ids"].dtype == torch.int32 and row["target_top_ids"].shape == (10, 16)
    actual = sum(os.path.getsize(p) for p in paths)
    estimate = estimate_feature_bytes(40, 32, 16, torch.bfloat16, 5)
    assert actual <= estimate < actual + 8192


def test_resume_recomputes_only_missing_shards(setup, tmp_path):
    target, draft, rows = setup
    paths = precompute_features(target, rows, tmp_path, shard_size=2)
    before = {p: os.path.getmtime(p) for p in paths}
    os.remove(paths[1])
    calls = []
    handle = target.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        again = precompute_features(target, rows, tmp_path, shard_size=2)
    finally:
        handle.remove()
    assert again == paths and len(calls) == 2  # the two samples of the missing shard, nothing else
    assert os.path.getmtime(paths[0]) == before[paths[0]] and os.path.getmtime(paths[2]) == before[paths[2]]
    assert len(OfflineFeatureDataset(tmp_path)) == 5


def test_a_folder_of_another_run_is_refused_and_kept(setup, tmp_path):
    target, draft, rows = setup
    paths = precompute_features(target, rows, tmp_path, shard_size=2)
    with pytest.raises(ValueError, match="another run.*logits_top_k"):
        precompute_features(target, rows, tmp_path, top_k=3, shard_size=2)
    with pytest.raises(ValueError, match="fingerprint"):
        precompute_features(target, rows.select(range(4)), tmp_path, shard_size=2)
    assert all(os.path.isfile(p) for p in paths)
    os.remove(paths[2])
    with pytest.raises(ValueError, match="incomplete: 1 of 3 shards"):
        OfflineFeatureDataset(tmp_path)


def test_several_folders_read_as_one_data_set_in_order(setup, tmp_path):
    target, draft, rows = setup
    precompute_features(target, rows.select(range(3)), tmp_path / "a", shard_size=2)
    precompute_features(target, rows.select(range(3, 5)), tmp_path / "b", shard_size=1)
    precompute_features(target, rows, tmp_path / "all", shard_size=2)
    joined, alone = OfflineFeatureDataset([tmp_path / "a", tmp_path / "b"]), OfflineFeatureDataset(tmp_path / "all")
    assert len(joined) == len(alone) == 5 and joined.folders == [str(tmp_path / "a"), str(tmp_path / "b")]
    for i in (0, 2, 3, 4, -1):  # both sides of the seam, and a negative index
        for key, value in alone[i].items():
            torch.testing.assert_close(joined[i][key], value, atol=1e-6, rtol=1e-6)
    with pytest.raises(IndexError, match="index 5 is out of range for 5"):
        joined[5]
    # Other taps, or another number of kept logits, cannot be joined: the rows would mean different things.
    precompute_features(target, rows.select(range(2)), tmp_path / "c", top_k=5, shard_size=2)
    with pytest.raises(ValueError, match="cannot be joined.*logits_top_k 64 vs 5"):
        OfflineFeatureDataset([tmp_path / "a", tmp_path / "c"])
    precompute_features(target, rows.select(range(2)), tmp_path / "d", layer_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"cannot be joined to those in .*: layer_ids \[2, 4, 5\] vs \[1, 2, 3\]"):
        OfflineFeatureDataset([tmp_path / "a", tmp_path / "d"])
    with pytest.raises(ValueError, match="at least one features folder"):
        OfflineFeatureDataset([])


def test_too_little_disk_fails_before_writing(setup, tmp_path, monkeypatch):
    target, draft, rows = setup
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    out = tmp_path / "features"
    with pytest.raises(ValueError, match=r"Not enough disk.*only 1000.0 B are free"):
        precompute_features(target, rows, out)
    assert not out.exists()


def test_bad_arguments_raise(setup, tmp_path):
    target, draft, rows = setup
    with pytest.raises(ValueError, match="top_k"):
        precompute_features(target, rows, tmp_path, top_k=0)
    with pytest.raises(ValueError, match="layer_ids"):
        precompute_features(target, rows, tmp_path, layer_ids=[1, 2, 9])
    with pytest.raises(ValueError, match="shard_size"):
        precompute_features(target, rows, tmp_path, shard_size=0)
    with pytest.raises(ValueError, match="input_ids and loss_mask"):
        precompute_features(target, [{"input_ids": [1, 2]}], tmp_path)
    with pytest.raises(ValueError, match="no features.json"):
        OfflineFeatureDataset(tmp_path)


# ------------------------------------------------------------------------------------------------------------------
# command line


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["vocab", "--help"])
    assert exit_info.value.code == 0
    assert "--draft-vocab-size" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["features", "--help"])
    assert "--logits-top-k" in capsys.readouterr().out


def test_vocab_and_features_commands(chat_target, tmp_path, capsys):
    folder, data = chat_target
    vocab_file = tmp_path / "vocab.safetensors"
    assert cli_main(argv("vocab", target=folder, data=data, output=vocab_file, draft_vocab_size=64)) == 0
    printed = capsys.readouterr().out
    assert "covers 100.00% of the training conversations' supervised tokens" in printed
    assert "Coverage of the target's supervised tokens by draft vocabulary size" in printed
    out = tmp_path / "features"
    assert (
        cli_main(
            argv(
                "features", target=folder, data=data, output=out, logits_top_k=16, shard_size=5, storage_dtype="float32"
            )
        )
        == 0
    )
    data_set = OfflineFeatureDataset(out)  # sum-3 is held out (id hash below 2%): 11 of the 12 conversations
    assert len(data_set) == 11 and data_set.manifest["logits_top_k"] == 16
    held_out = tmp_path / "held_out"
    assert cli_main(argv("features", target=folder, data=data, output=held_out, split="held-out")) == 0
    assert len(OfflineFeatureDataset(held_out)) == 1
    # A second run finds every shard done; data without assistant turns is refused cleanly.
    assert (
        cli_main(
            argv(
                "features", target=folder, data=data, output=out, logits_top_k=16, shard_size=5, storage_dtype="float32"
            )
        )
        == 0
    )
    assert "0 of 3 shards" in capsys.readouterr().out
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    written = vocab_file.read_bytes()
    assert cli_main(argv("vocab", target=folder, data=data, output=vocab_file, draft_vocab_size=64)) == 2
    assert "already exists; pass --overwrite-output-dir" in capsys.readouterr().err
    assert (
        cli_main(
            argv(
                "vocab", target=folder, data=prompts, output=vocab_file, draft_vocab_size=64, overwrite_output_dir=True
            )
        )
        == 2
    )
    assert "has an assistant turn" in capsys.readouterr().err
    assert vocab_file.read_bytes() == written  # a failed run leaves the earlier file whole
    shutil.rmtree(out)


def test_token_rows_and_older_folders(setup, tmp_path):
    target, draft, rows = setup
    precompute_features(target, rows, tmp_path, shard_size=2)
    data = OfflineFeatureDataset(tmp_path)
    assert list(data.token_rows()) == [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in rows]
    # Features of the first format kept draft-vocabulary logits only: refused with what to do.
    manifest = json.loads((tmp_path / "features.json").read_text())
    assert manifest["format"] == FEATURES_FORMAT
    (tmp_path / "features.json").write_text(json.dumps({**manifest, "format": "eagle3_hf.features/1"}))
    with pytest.raises(ValueError, match="older version.*Re-run `eagle3-hf features`"):
        OfflineFeatureDataset(tmp_path)


def test_offline_training_counts_a_placeholder_vocabulary_on_the_features_tokens(setup, tmp_path):
    target, _, rows = setup
    precompute_features(target, rows, tmp_path / "features", shard_size=2)
    data = OfflineFeatureDataset(tmp_path / "features")
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40)
    assert not draft.d2t.any()  # placeholder: ids 0..39
    args = Eagle3TrainingArguments(str(tmp_path / "out"), feature_mode="offline", report_to="none", use_cpu=True)
    Eagle3Trainer(draft, args, train_dataset=data)
    expected = build_draft_vocab(rows, target.config.vocab_size, 40)
    assert torch.equal(draft.t2d, expected.t2d) and torch.equal(draft.d2t, expected.d2t)


def test_an_online_run_resumes_on_the_offline_features_of_its_data(chat_target, tmp_path, capsys):
    """A run started online can switch to offline features of its data once they exist (from its second epoch on,
    where they pay) and go on as if nothing changed: the features hold the training split in the online data set's
    order, the trainer's sampler depends only on the seed and the data set's length, and fp32 features are the
    online ones."""
    folder, data = chat_target
    common = [
        "--target",
        folder,
        "--ttt-length",
        "2",
        "--draft-vocab-size",
        "64",
        "--logging-steps",
        "1",
        "--max-steps",
        "4",
        "--save-steps",
        "2",
        "--save-total-limit",
        "0",
        "--batch-size",
        "2",
        "--seed",
        "5",
    ]
    online, switched, feats = tmp_path / "online", tmp_path / "switched", tmp_path / "features"
    assert cli_main([str(a) for a in ("train", "--data", data, "--output", online, *common)]) == 0
    assert cli_main(argv("features", target=folder, data=data, output=feats, storage_dtype="float32")) == 0
    shutil.copytree(online / "checkpoint-2", switched / "checkpoint-2")
    capsys.readouterr()
    assert cli_main([str(a) for a in ("train", "--features", feats, "--output", switched, *common, "--resume")]) == 0
    assert f"Resuming from {switched / 'checkpoint-2'}." in capsys.readouterr().out
    logs = [json.loads((run / "trainer_state.json").read_text())["log_history"] for run in (online, switched)]
    losses = [[(e["step"], e["loss"]) for e in log if "loss" in e and e["step"] > 2] for log in logs]
    assert [s for s, _ in losses[0]] == [s for s, _ in losses[1]] == [3, 4]
    assert [v for _, v in losses[1]] == pytest.approx([v for _, v in losses[0]], rel=1e-4)
    weights = [Eagle3DraftModel.from_pretrained(run).state_dict() for run in (online, switched)]
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-5, rtol=1e-4, msg=name)
