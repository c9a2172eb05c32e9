"""The training objectives (`--loss forward_kl|tv|lk`) and checkpoint selection by `sim_accept_len`.

Each loss against a direct computation over the dense distributions, the fused head path against the autograd
reference (value and gradients), the default unchanged, bad names refused, the trainer with each loss, and the
better of two checkpoints kept by `--metric-for-best-model sim_accept_len`.
"""

import json

import pytest
import torch
from helpers.cli_argv import argv

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training.features import online_features
from eagle3_hf.training.head_loss import head_cross_entropy, ttt_head_kwargs
from eagle3_hf.training.losses import LOSSES, check_loss, row_losses
from eagle3_hf.training.trainer import Eagle3DataCollator, Eagle3Trainer, Eagle3TrainingArguments
from eagle3_hf.training.ttt import ttt_forward, ttt_loss
from eagle3_hf.utils import tiny

torch.set_num_threads(1)


def sparse_label(rows, width, k, seed=0):
    """A top-k label as `ttt` builds it: distinct columns, the last one a placeholder (column 0, weight 0)."""
    generator = torch.Generator().manual_seed(seed)
    columns = torch.stack([torch.randperm(width, generator=generator)[:k] for _ in range(rows)])
    p = torch.softmax(2 * torch.randn(rows, k, generator=generator), -1)
    columns[:, -1], p[:, -1] = 0, 0.0
    return columns, p / p.sum(-1, keepdim=True)


def direct(loss, logits, dense_p):
    """Each loss from its definition over the whole draft vocabulary."""
    q = torch.softmax(logits.double(), -1)
    p = dense_p.double()
    if loss == "forward_kl":
        return -(p * q.log()).sum(-1)
    if loss == "tv":
        return 0.5 * (p - q).abs().sum(-1)
    return -torch.minimum(p, q).sum(-1).log()


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("dense", [False, True])
def test_each_loss_matches_its_definition_fused_and_by_reference(loss, dense):
    torch.manual_seed(0)
    rows, weight = torch.randn(37, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    columns, p = sparse_label(37, 50, 6)
    dense_p = torch.zeros(37, 50).scatter_add_(1, columns, p)
    label, at = (dense_p, None) if dense else (p, columns)
    fused, predicted = head_cross_entropy(rows, weight, label, at, chunk_rows=8, loss=loss)  # several chunks
    fused_grads = torch.autograd.grad(fused.sum(), (rows, weight))
    log_q = torch.log_softmax(rows @ weight.T, -1)
    reference = row_losses(loss, log_q if dense else log_q.gather(1, columns), label)
    reference_grads = torch.autograd.grad(reference.sum(), (rows, weight))
    expected = direct(loss, rows.detach() @ weight.detach().T, dense_p).float()
    torch.testing.assert_close(fused.detach(), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(reference.detach(), expected, atol=2e-5, rtol=1e-5)
    for ours, theirs in zip(fused_grads, reference_grads):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    assert torch.equal(predicted, (rows @ weight.T).argmax(-1))


def test_the_losses_differ_and_the_acceptance_ones_are_linked():
    torch.manual_seed(1)
    rows, weight = torch.randn(20, 8), torch.randn(30, 8)
    columns, p = sparse_label(20, 30, 5)
    values = {loss: head_cross_entropy(rows, weight, p, columns, loss=loss)[0] for loss in LOSSES}
    assert not torch.allclose(values["forward_kl"], values["tv"])
    # tv = 1 - alpha and lk = -log alpha: the same acceptance seen two ways.
    torch.testing.assert_close(values["lk"], -torch.log1p(-values["tv"]), atol=1e-5, rtol=1e-4)  # 1 - alpha rounds
    assert (values["tv"] >= 0).all() and (values["tv"] <= 1).all()


@pytest.mark.parametrize("loss", ["tv", "lk"])
def test_bf16_and_far_off_drafts_keep_finite_gradients(loss):
    torch.manual_seed(2)
    rows, weight = torch.randn(40, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    columns, p = sparse_label(40, 64, 8)
    value, _ = head_cross_entropy(rows, weight, p, columns, compute_dtype=torch.bfloat16, loss=loss)
    grads = torch.autograd.grad(value.sum(), (rows, weight))
    assert torch.isfinite(value).all() and all(torch.isfinite(g).all() for g in grads)
    # Logits 200 apart: q underflows to 0 on the label in fp32, yet -log alpha stays finite (computed in log space).
    far = torch.full((3, 64), 0.0).index_fill_(1, torch.tensor([63]), 200.0).requires_grad_()
    label_columns, label_p = torch.tensor([[0, 1, 2]] * 3), torch.tensor([[0.5, 0.3, 0.2]] * 3)
    log_q = torch.log_softmax(far, -1).gather(1, label_columns)
    reference = row_losses(loss, log_q, label_p)
    (grad,) = torch.autograd.grad(reference.sum(), far)
    assert torch.isfinite(reference).all() and torch.isfinite(grad).all()


def test_the_default_is_the_cross_entropy_unchanged():
    torch.manual_seed(3)
    rows, weight = torch.randn(33, 16), torch.randn(40, 16)
    columns, p = sparse_label(33, 40, 6)
    default, _ = head_cross_entropy(rows, weight, p, columns)
    assert torch.equal(default, head_cross_entropy(rows, weight, p, columns, loss="forward_kl")[0])
    log_q = torch.log_softmax(rows @ weight.T, -1)
    torch.testing.assert_close(default, -(p * log_q.gather(1, columns)).sum(-1), atol=1e-5, rtol=1e-5)
    assert Eagle3TrainingArguments("out", use_cpu=True, report_to="none").loss == "forward_kl"


def test_bad_loss_names_are_refused_by_name(tmp_path, capsys):
    for call in (
        lambda: check_loss("kl"),
        lambda: row_losses("kl", torch.zeros(1, 2), torch.ones(1, 2) / 2),
        lambda: head_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(2, 3) / 3, loss="kl"),
        lambda: ttt_head_kwargs(torch.nn.Linear(4, 3, bias=False), None, None, "kl"),
        lambda: Eagle3TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", loss="kl"),
    ):
        with pytest.raises(ValueError, match=r"loss must be one of forward_kl, tv, lk; got 'kl'"):
            call()
    with pytest.raises(SystemExit):
        cli_main(argv("train", target="smollm2", data="x.jsonl", output_dir=tmp_path, loss="kl"))
    assert "--loss" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------------
# the trainer


@pytest.fixture(scope="module")
def target():
    return tiny.make_tiny_target()


@pytest.fixture(scope="module")
def dataset():
    return tiny.synthetic_dataset(num_rows=8)


def make_args(output_dir, **overrides):
    values = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        ttt_length=3,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return Eagle3TrainingArguments(**values)


def new_draft(target):
    torch.manual_seed(0)
    return Eagle3DraftModel.from_target(target, draft_vocab_size=48)


class HeadWithAdapter(torch.nn.Module):
    """A head the fused loss cannot stand in for (as a LoRA-wrapped one): the reference ops run instead."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, rows):
        return self.linear(rows)


@pytest.mark.parametrize("loss", LOSSES)
def test_the_trainer_computes_each_loss_on_the_fused_and_the_reference_head(target, dataset, tmp_path, loss):
    draft = new_draft(target)
    trainer = Eagle3Trainer(draft, make_args(tmp_path, loss=loss), target=target, train_dataset=dataset)
    batch = Eagle3DataCollator()(list(dataset.select(range(3))))
    fused = trainer.compute_loss(trainer.model, batch)
    fused_grads = torch.autograd.grad(fused, [draft.lm_head.weight, draft.fc.weight])
    # The same loss through the reference head path, and by hand from ttt_loss's per-step labels.
    plain = draft.lm_head
    draft.lm_head = HeadWithAdapter(plain)
    try:
        reference = trainer.compute_loss(trainer.model, batch)
        reference_grads = torch.autograd.grad(reference, [plain.weight, draft.fc.weight])
    finally:
        draft.lm_head = plain
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(fused_grads, reference_grads):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)
    if loss == "forward_kl":  # the default: ttt_loss's own cross entropy over the head's logits
        h, logits, ids = online_features(target, draft, batch["input_ids"], batch["attention_mask"], 64)
        with torch.no_grad():
            states = ttt_forward(draft, batch["input_ids"], h, batch["attention_mask"], 3)
            expected = ttt_loss(states, logits, batch["loss_mask"], draft.t2d, 0.8, target_ids=ids).loss
        torch.testing.assert_close(fused.detach(), expected, atol=1e-5, rtol=1e-5)
    trainer.train()  # and it trains
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert logged and all(torch.isfinite(torch.tensor(log["loss"])) for log in logged)


def test_metric_for_best_model_is_checked_and_higher_acceptance_is_better(tmp_path):
    args = make_args(tmp_path, metric_for_best_model="sim_accept_len", eval_strategy="steps", eval_steps=1)
    assert args.greater_is_better is True
    assert make_args(tmp_path, metric_for_best_model="eval_loss").greater_is_better is False
    with pytest.raises(ValueError, match=r"metric_for_best_model must be one of .*'sim_accept_len'.*got 'accept'"):
        make_args(tmp_path, metric_for_best_model="accept")
    with pytest.raises(ValueError, match="acc_3"):  # ttt_length 3: acc_0..acc_2
        make_args(tmp_path, metric_for_best_model="acc_3")
    with pytest.raises(ValueError, match="greater_is_better=False would keep the worst"):
        make_args(tmp_path, metric_for_best_model="sim_accept_len", greater_is_better=False)


class ScriptedAcceptance(Eagle3Trainer):
    """Reports the given simulated acceptance lengths at successive evaluations (the rest as measured), so that
    which checkpoint is better is known."""

    def __init__(self, *args, lengths, **kwargs):
        super().__init__(*args, **kwargs)
        self.lengths = list(lengths)

    def _pop_metrics(self, mode, prefix):
        metrics = super()._pop_metrics(mode, prefix)
        if mode == "eval":
            metrics["eval_sim_accept_len"] = self.lengths.pop(0)
        return metrics


@pytest.mark.parametrize("lengths, best", [([2.5, 1.5], 1), ([1.5, 2.5], 2)])
def test_the_better_of_two_checkpoints_is_kept(target, dataset, tmp_path, lengths, best):
    args = make_args(
        tmp_path,
        metric_for_best_model="sim_accept_len",
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
    )
    draft = new_draft(target)
    trainer = ScriptedAcceptance(
        draft, args, target=target, train_dataset=dataset, eval_dataset=dataset.select(range(2)), lengths=lengths
    )
    trainer.train()
    assert trainer.state.best_metric == 2.5
    assert trainer.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{best}")
    assert (tmp_path / f"checkpoint-{best}").is_dir()  # kept although the limit is one checkpoint
    kept = Eagle3DraftModel.from_pretrained(str(tmp_path / f"checkpoint-{best}"))
    torch.testing.assert_close(draft.fc.weight, kept.fc.weight)  # the best one is loaded at the end


# ------------------------------------------------------------------------------------------------------------------
# the command


def test_train_command_records_the_loss_and_selects_by_acceptance(chat_target, tmp_path, capsys):
    folder, data = chat_target
    out = tmp_path / "run"
    common = [
        "train",
        "--target",
        str(folder),
        "--data",
        str(data),
        "--max-steps",
        "2",
        "--ttt-length",
        "2",
        "--draft-vocab-size",
        "40",
        "--held-out-fraction",
        "0.25",
    ]
    # a metric needs an evaluation to select by
    assert cli_main([*common, "--output", str(tmp_path / "no-eval"), "--metric-for-best-model", "sim_accept_len"]) == 2
    assert "--metric-for-best-model sim_accept_len selects checkpoints" in capsys.readouterr().err
    assert (
        cli_main(
            [
                *common,
                "--output",
                str(out),
                "--loss",
                "lk",
                "--eval-steps",
                "1",
                "--save-steps",
                "1",
                "--metric-for-best-model",
                "sim_accept_len",
            ]
        )
        == 0
    )
    assert json.loads((out / "training_info.json").read_text())["loss"] == "lk"
    assert "loss `lk`" in (out / "README.md").read_text()
    state = json.loads((out / "trainer_state.json").read_text())
    evals = [log["eval_sim_accept_len"] for log in state["log_history"] if "eval_sim_accept_len" in log]
    assert len(evals) == 2 and state["best_metric"] == max(evals)
    assert state["best_model_checkpoint"].endswith(f"checkpoint-{1 + evals.index(max(evals))}")
