"""The one evaluation: full-vocabulary TTT accuracy, coverage and simulated acceptance length; its command line."""

import json

import pytest
import torch
from helpers.cli_argv import argv

from eagle3_hf.bench.cards import bench_card
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training.evaluation import evaluate_draft
from eagle3_hf.training.trainer import Eagle3DataCollator, Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.ttt import simulated_acceptance_length

torch.set_num_threads(1)


def test_metrics_are_full_vocabulary_and_independent_of_batching(tiny_setup, tmp_path):
    target, draft, rows = tiny_setup
    one = evaluate_draft(draft, target, rows, ttt_length=3, batch_size=1)
    three = evaluate_draft(draft, target, rows, ttt_length=3, batch_size=4)
    assert one == three and one["conversations"] == 5
    # Coverage and step-0 accuracy from the target's own top tokens, position by position.
    batch = Eagle3DataCollator()(list(rows))
    with torch.no_grad():
        top = target(batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)  # [B, S]
    supervised = batch["loss_mask"][:, 2:].bool()  # step 0 predicts x_{t+2} from target row t+1
    top_next = top[:, 1:-1][supervised]
    assert one["supervised_tokens"] == int(supervised.sum())
    assert one["coverage"] == pytest.approx(float(draft.t2d[top_next].float().mean()), abs=1e-4)
    accs = [one[f"acc_{j}"] for j in range(3)]
    assert one["acc_0"] <= one["coverage"] and one["sim_accept_len"] == pytest.approx(
        simulated_acceptance_length(accs), abs=1e-3
    )
    # The trainer's evaluation is the same measurement.
    args = Eagle3TrainingArguments(
        str(tmp_path), ttt_length=3, per_device_eval_batch_size=2, report_to="none", use_cpu=True
    )
    metrics = Eagle3Trainer(draft, args, target=target, eval_dataset=rows).evaluate()
    for key in ("acc_0", "acc_1", "acc_2", "coverage"):
        assert metrics[f"eval_{key}"] == pytest.approx(one[key], abs=1e-4)
    with pytest.raises(ValueError, match="empty"):
        evaluate_draft(draft, target, [], ttt_length=3)


def test_evaluate_command_and_the_model_card(chat_target, tmp_path, capsys):
    folder, data = chat_target
    draft_dir = tmp_path / "draft"
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                data=data,
                output=draft_dir,
                max_steps=1,
                ttt_length=2,
                draft_vocab_size=48,
                held_out_fraction=0,
            )
        )
        == 0
    )
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert (
        cli_main(
            argv(
                "evaluate",
                target=folder,
                draft=draft_dir,
                data=data,
                split="all",
                ttt_length=3,
                dtype="float32",
                json=out,
                record="MT-bench turn 1",
            )
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| acc_0 | acc_1 | acc_2 | coverage |" in printed
    metrics = json.loads(out.read_text())[str(draft_dir)]
    assert metrics["conversations"] == 12 and metrics["split"] == "all" and 0 <= metrics["acc_0"] <= 1
    # --record keeps the numbers with the draft, and its model card shows them.
    recorded = json.loads((draft_dir / "evaluation.json").read_text())
    assert recorded["MT-bench turn 1"]["acc_0"] == metrics["acc_0"]
    card = bench_card(str(draft_dir)).text
    assert "| MT-bench turn 1 |" in card and f"{metrics['acc_0']:.3f}" in card
    # The held-out split (2% by id hash) of these twelve is one conversation (sum-3); at 0.5% there is none, and the
    # evaluation says so instead of scoring nothing.
    assert (
        cli_main(
            argv(
                "evaluate",
                target=folder,
                draft=draft_dir,
                data=data,
                dtype="float32",
                ttt_length=2,
                json=out,
                overwrite_output_dir=True,
            )
        )
        == 0
    )
    assert json.loads(out.read_text())[str(draft_dir)]["conversations"] == 1
    assert (
        cli_main(
            argv("evaluate", target=folder, draft=draft_dir, data=data, dtype="float32", held_out_fraction="0.005")
        )
        == 2
    )
    assert "requested split" in capsys.readouterr().err
