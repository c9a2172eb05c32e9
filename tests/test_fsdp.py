"""FSDP2 training and sharded feature extraction in 2 CPU processes (gloo), checked against one-process runs."""

import importlib.util
import json
import os
import pathlib
import sys
import types

import pytest
import torch
from helpers.launch import exit_loop, free_port, launch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.targets import load_target
from eagle3_hf.training.distributed import check_fsdp_plugin, parameter_bytes
from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
from eagle3_hf.training.trainer import Eagle3Trainer

ROOT = pathlib.Path(__file__).parents[1]
WORKER = ROOT / "tests" / "fsdp_worker.py"
_spec = importlib.util.spec_from_file_location("fsdp_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

# What `accelerate config` writes for FSDP2, on CPU processes.
ACCELERATE_FSDP_CONFIG = exit_loop.accelerate_config("fsdp", 2)
# The launched processes import this checkout's package, whatever an installed copy says.
CHECKOUT = {"PYTHONPATH": str(ROOT)}


def accelerate_launch(mode: str, tmp_path: pathlib.Path) -> dict:
    """The worker's `mode` in 2 processes under `accelerate launch` with the FSDP config above."""
    config = tmp_path / "fsdp.yaml"
    config.write_text(ACCELERATE_FSDP_CONFIG)
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        str(WORKER),
        mode,
        str(tmp_path / "runs"),
    ]
    return launch(command, tmp_path, timeout=600, env=CHECKOUT)


def by_step(losses: dict) -> dict[int, float]:
    return {int(step): loss for step, loss in losses.items()}


@pytest.mark.slow  # several processes
def test_fsdp_training_equals_one_process_resumes_and_saves_a_loadable_draft(tmp_path):
    summary = accelerate_launch("train", tmp_path)

    # One process on the same global batch: 4 rows a step, as 2 accumulated micro-batches of the 2 rows each FSDP
    # process took (the loss is a mean per micro-batch, as it is per process: the two agree however many positions
    # each half supervises).
    target, dataset = worker.tiny.make_tiny_target(), worker.tiny.synthetic_dataset()
    args = worker.training_args(tmp_path / "single", gradient_accumulation_steps=2, save_strategy="no")
    single = Eagle3Trainer(worker.new_draft(target, dataset), args, target=target, train_dataset=dataset)
    single.train()
    expected = worker.losses(single)
    sharded = by_step(summary["A"])
    assert sharded.keys() == expected.keys() == set(range(1, 7))
    for step, loss in expected.items():
        assert sharded[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert summary["eval_loss"] == pytest.approx(single.evaluate(dataset.select(range(4)))["eval_loss"], rel=1e-5)

    # Each process holds half of the target's parameters and half of the draft's (measured on its shards).
    local, full = summary["target_bytes"]
    assert full == parameter_bytes(target)[1] and local == pytest.approx(full / 2, rel=0.01)
    local, full = summary["draft_bytes"]
    assert full == parameter_bytes(single.model)[1] and local == pytest.approx(full / 2, rel=0.01)
    # ... as the per-process memory formula says, AdamW's moments included.
    estimate = summary["estimate"]
    assert estimate["target"] == pytest.approx(summary["target_bytes"][0], rel=0.01)
    assert estimate["draft"] == pytest.approx(local, rel=0.01)
    assert estimate["optimizer"] == pytest.approx(summary["optimizer_bytes"], rel=0.01) and estimate["optimizer"] > 0

    # Interrupted after step 4 and resumed: the same losses as the uninterrupted run, from sharded checkpoints
    # (B -> C) and from full state dict checkpoints (A's step 4 -> D).
    assert summary["B_step"] == 4
    assert {"pytorch_model_fsdp_0", "optimizer_0", "model.safetensors"} <= set(summary["B_files"])
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "model.safetensors"} <= set(summary["D_files"])
    for resumed in (by_step(summary["C"]), by_step(summary["D"])):
        assert resumed.keys() == sharded.keys()
        assert all(resumed[step] == pytest.approx(sharded[step], rel=1e-6) for step in (5, 6))

    # The saved draft is the gathered FSDP one, loads in one process and generates exactly the target's tokens.
    assert summary["reload_equal"] and summary["lossless"]


@pytest.mark.slow  # several processes
def test_fsdp_trains_a_deeper_draft_as_one_process_does(tmp_path):
    summary = accelerate_launch("depth", tmp_path)
    assert summary["units"] == [True, True]  # each decoder layer is an FSDP unit, gathered around its own TTT calls
    target, dataset = worker.tiny.make_tiny_target(), worker.tiny.synthetic_dataset()
    args = worker.training_args(tmp_path / "single", max_steps=3, gradient_accumulation_steps=2, save_strategy="no")
    single = Eagle3Trainer(
        worker.new_draft(target, dataset, num_hidden_layers=2), args, target=target, train_dataset=dataset
    )
    single.train()
    expected, sharded = worker.losses(single), by_step(summary["losses"])
    assert sharded.keys() == expected.keys() == {1, 2, 3}
    for step, loss in expected.items():
        assert sharded[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step


@pytest.mark.slow  # several processes
def test_features_in_two_processes_equal_one_process_and_train_cli_under_fsdp(chat_target, tmp_path):
    folder, data = chat_target
    common = [
        "features",
        "--target",
        str(folder),
        "--data",
        str(data),
        "--shard-size",
        "3",
        "--storage-dtype",
        "float32",
    ]
    two, one, run = tmp_path / "two", tmp_path / "one", tmp_path / "run"
    train = [
        "train",
        "--target",
        str(folder),
        "--data",
        str(data),
        "--output",
        str(run),
        "--max-steps",
        "2",
        "--ttt-length",
        "2",
        "--draft-vocab-size",
        "64",
        "--save-steps",
        "1",
        "--logging-steps",
        "1",
        "--fsdp",
        "full_shard auto_wrap",
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(WORKER),
        "cli",
        str(tmp_path),
        json.dumps(common + ["--output", str(two)]),
        json.dumps(train),
    ]
    assert launch(command, tmp_path, timeout=600, env=CHECKOUT)["codes"] == [0, 0]

    # The same command in one process (the target placed by accelerate's device_map) writes the same data set.
    assert cli_main(common + ["--output", str(one), "--device-map", "auto"]) == 0
    sharded, whole = OfflineFeatureDataset(str(two)), OfflineFeatureDataset(str(one))
    assert sharded.manifest == whole.manifest and sharded.manifest["num_shards"] >= 3  # both processes wrote
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))
    assert len(sharded) == len(whole) == whole.manifest["num_samples"]
    for index in range(len(whole)):
        a, b = sharded[index], whole[index]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a), index

    # `eagle3-hf train --fsdp` with online features from a target sharded while it loads.
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and any("acc_0" in log for log in state["log_history"])
    assert (run / "checkpoint-2" / "pytorch_model_fsdp.bin").is_file()
    draft = Eagle3DraftModel.from_pretrained(str(run))
    assert draft.config.draft_vocab_size == 64 and draft.d2t.any()  # the vocabulary built from the data


def test_unsupported_distributed_set_ups_are_refused(target_and_data, tmp_path, monkeypatch):
    fsdp2 = dict(fsdp_version=2, cpu_ram_efficient_loading=False, activation_checkpointing=False)
    check_fsdp_plugin(types.SimpleNamespace(**fsdp2))
    cases = [
        ({"fsdp_version": 1}, "Only FSDP2 is supported, got fsdp_version=1"),
        ({"cpu_ram_efficient_loading": True}, "cpu_ram_efficient_loading is not supported"),
        ({"activation_checkpointing": True}, "use gradient_checkpointing=True"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError, match=message):
            check_fsdp_plugin(types.SimpleNamespace(**{**fsdp2, **change}))
    target, dataset = target_and_data
    args = worker.training_args(tmp_path, save_strategy="no")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` sets for a DeepSpeed config
    with pytest.raises(ValueError, match="DeepSpeed .*is not supported"):
        Eagle3Trainer(worker.new_draft(target, dataset), args, target=target, train_dataset=dataset)
    with pytest.raises(ValueError, match="needs an initialised torch.distributed group"):
        load_target("unused", shard=True)


def test_the_program_ends_its_process_group_and_a_caller_keeps_it(chat_target, tmp_path, monkeypatch):
    # A worker process that leaves its group to the interpreter's exit can abort after finishing (gloo's threads):
    # `eagle3-hf` as the program (no argv) tears the group down after success and after an error alike.
    import torch.distributed as dist

    folder, data = chat_target
    vocab = [
        "vocab",
        "--target",
        str(folder),
        "--output",
        str(tmp_path / "vocab.safetensors"),
        "--overwrite-output-dir",
        "--draft-vocab-size",
        "32",
        "--data",
    ]
    cases = [
        (vocab + [str(data)], 0),
        (vocab + [str(tmp_path / "missing.jsonl")], 2),
    ]  # a run that finishes, one refused
    for number, (argv, code) in enumerate(cases):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{number}'}", rank=0, world_size=1)
        try:
            assert cli_main(argv) == code and dist.is_initialized()  # a caller's own command: the group stays
            monkeypatch.setattr(sys, "argv", ["eagle3-hf", *argv])
            assert cli_main() == code
            assert not dist.is_initialized()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


@pytest.fixture
def target_and_data():
    return worker.tiny.make_tiny_target(), worker.tiny.synthetic_dataset()
