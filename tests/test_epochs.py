"""Several epochs over offline features: reshuffled every epoch (by the seed), and a run stopped at a checkpoint and
resumed ends with exactly the weights of the same run uninterrupted."""

import copy
import json
import shutil

import pytest
import torch
from helpers.cli_argv import argv

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.features import precompute_features
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments


class RecordingFeatures(OfflineFeatureDataset):
    """Offline features that note which rows are read, in order."""

    def __init__(self, folder):
        super().__init__(folder)
        self.read = []

    def __getitem__(self, index):
        self.read.append(index)
        return super().__getitem__(index)


def epoch_orders(setup, folder, out, seed, epochs=3):
    target, draft, _ = setup
    data = RecordingFeatures(folder)
    args = Eagle3TrainingArguments(
        str(out),
        feature_mode="offline",
        num_train_epochs=epochs,
        per_device_train_batch_size=2,
        ttt_length=2,
        seed=seed,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Eagle3Trainer(copy.deepcopy(draft), args, train_dataset=data)
    data.read = []  # what the trainer read to check the rows
    trainer.train()
    return [data.read[i : i + len(data)] for i in range(0, len(data.read), len(data))]


def test_every_epoch_is_shuffled_anew_and_reproducibly(tiny_setup, tmp_path):
    target, _, rows = tiny_setup
    precompute_features(target, rows, tmp_path / "features", top_k=8, dtype=torch.float32, shard_size=2)
    orders = epoch_orders(tiny_setup, tmp_path / "features", tmp_path / "a", seed=0)
    assert len(orders) == 3 and all(sorted(order) == [0, 1, 2, 3, 4] for order in orders)  # each row once an epoch
    assert len({tuple(order) for order in orders}) == 3  # in another order each epoch
    assert epoch_orders(tiny_setup, tmp_path / "features", tmp_path / "b", seed=0) == orders  # the seed fixes them
    assert epoch_orders(tiny_setup, tmp_path / "features", tmp_path / "c", seed=1) != orders


def test_a_multi_epoch_run_stopped_and_resumed_ends_with_the_same_weights(chat_target, tmp_path, capsys):
    """fp32, same seed: 3 epochs of 3 steps over 11 conversations' features, stopped after step 4 (within the second
    epoch) and resumed from that checkpoint, end with the uninterrupted run's weights, bit for bit."""
    folder, data = chat_target
    feats = tmp_path / "features"
    assert cli_main(argv("features", target=folder, data=data, output=feats, storage_dtype="float32")) == 0
    common = dict(
        target=folder,
        features=feats,
        num_train_epochs=3,
        batch_size=4,
        ttt_length=2,
        draft_vocab_size=64,
        logging_steps=1,
        save_steps=4,
        save_total_limit=5,
        learning_rate=1e-3,
        seed=3,
    )
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert cli_main(argv("train", output=whole, **common)) == 0
    shutil.copytree(whole / "checkpoint-4", resumed / "checkpoint-4")  # where a stopped run would have left it
    capsys.readouterr()
    assert cli_main(argv("train", output=resumed, **common, resume=True)) == 0
    assert f"Resuming from {resumed / 'checkpoint-4'}." in capsys.readouterr().out
    logs = [json.loads((run / "trainer_state.json").read_text())["log_history"] for run in (whole, resumed)]
    losses = [[(log["step"], log["epoch"], log["loss"]) for log in history if "loss" in log] for history in logs]
    assert [step for step, _, _ in losses[0]] == list(range(1, 10))
    assert losses[1] == losses[0]  # steps 1-4 from the checkpoint's history, 5-9 trained again: the same losses
    weights = [Eagle3DraftModel.from_pretrained(str(run)).state_dict() for run in (whole, resumed)]
    assert weights[0].keys() == weights[1].keys()
    for name, value in weights[0].items():
        assert torch.equal(weights[1][name], value), name


@pytest.mark.parametrize("missing", ["eval_features", "eval_steps"])
def test_best_checkpoint_needs_an_evaluation(chat_target, tmp_path, capsys, missing):
    folder, data = chat_target
    feats = tmp_path / "features"
    assert cli_main(argv("features", target=folder, data=data, output=feats)) == 0
    options = dict(
        target=folder,
        features=feats,
        output=tmp_path / "run",
        max_steps=1,
        eval_features=feats,
        eval_steps=1,
        metric_for_best_model="sim_accept_len",
    )
    del options[missing]
    capsys.readouterr()
    assert cli_main(argv("train", **options)) == 2
    error = capsys.readouterr().err
    assert ("--eval-features" in error) if missing == "eval_features" else ("add --eval-steps N" in error)
