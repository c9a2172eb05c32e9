"""The draft's architecture on `eagle3-hf train`'s command line: `--fc-norm`, `--norm-output`, `--norm-before-fc`
build a fresh EAGLE-3.1 (or gpt-oss-style) draft, recorded in its config.json and model card; with `--init-draft`
they may only restate the saved draft (or choose how an official/SpecForge checkpoint is read)."""

import json

import pytest
import torch
from helpers.cli import assert_clean_error, run, train
from safetensors import safe_open

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.modeling.layouts import save_eagle


def assert_last_line_error(code, err, *fragments):
    """Exit code 2 and one error line, after the progress bars of what was loaded before the mistake showed."""
    last = err.strip().splitlines()[-1]
    assert code == 2 and "error: " in last and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in last, (fragment, last)


def saved_keys(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_help_lists_the_architecture_flags(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--fc-norm [BOOL]" in text and "--norm-output [BOOL]" in text and "--norm-before-fc [BOOL]" in text
    assert "EAGLE-3.1: an RMSNorm on each target tap before fc" in text


@pytest.fixture(scope="module")
def eagle31(chat_target, tmp_path_factory):
    """An EAGLE-3.1 draft trained from the command line (bare flags): its folder."""
    out = tmp_path_factory.mktemp("eagle31") / "run"
    folder, data = chat_target
    code = cli_main(
        [
            str(a)
            for a in (
                "train",
                "--target",
                folder,
                "--data",
                data,
                "--output",
                out,
                "--ttt-length",
                "2",
                "--draft-vocab-size",
                "64",
                "--max-steps",
                "2",
                "--save-steps",
                "1",
                "--fc-norm",
                "--norm-output",
            )
        ]
    )
    assert code == 0
    return out


def test_a_fresh_eagle31_draft_from_the_command_line(eagle31):
    config = json.loads((eagle31 / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (True, True, False)
    assert {"fc_norm.0.weight", "fc_norm.2.weight"} <= saved_keys(eagle31) and "input_norm.weight" not in saved_keys(
        eagle31
    )
    card = (eagle31 / "README.md").read_text()
    assert (
        "| draft architecture | EAGLE-3.1: `fc_norm` (an RMSNorm on each tap before fc), `norm_output` (the "
        "post-norm state fed back) |"
    ) in card
    draft = Eagle3DraftModel.from_pretrained(eagle31)
    assert draft.config.fc_norm and draft.config.norm_output and not draft.config.norm_before_fc
    # Trained: the per-tap norms moved off their initial ones.
    assert any(not torch.equal(n.weight, torch.ones_like(n.weight)) for n in draft.fc_norm)


def test_norm_before_fc_and_explicit_false(chat_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = train(capsys, chat_target, out, "--max-steps", "1", "--norm-before-fc", "--norm-output", "false")
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (False, False, True)
    assert "input_norm.weight" in saved_keys(out)
    assert (
        "| draft architecture | EAGLE-3: `norm_before_fc` (one RMSNorm over the taps before fc) |"
        in (out / "README.md").read_text()
    )
    code, _, err = train(capsys, chat_target, tmp_path / "pair", "--max-steps", "1", "--fc-norm", "--norm-before-fc")
    assert_clean_error(
        code, err, "--fc-norm with --norm-before-fc trains a draft no server runs", "speculators refuses the pair"
    )
    assert not (tmp_path / "pair").exists()


def test_init_draft_keeps_its_architecture(chat_target, eagle31, tmp_path, capsys):
    folder, data = chat_target
    common = ["train", "--target", folder, "--data", data, "--ttt-length", "2", "--max-steps", "1", "--init-draft"]
    code, _, err = run(capsys, *common, eagle31, "--output", tmp_path / "restated", "--fc-norm", "--norm-output")
    assert code == 0, err
    continued = Eagle3DraftModel.from_pretrained(tmp_path / "restated")
    assert continued.config.fc_norm and continued.config.norm_output
    code, _, err = run(capsys, *common, eagle31, "--output", tmp_path / "a", "--fc-norm", "false")
    assert_last_line_error(
        code,
        err,
        f"--fc-norm false contradicts --init-draft {eagle31}, whose draft has fc_norm=True",
        "leave --fc-norm out",
    )
    code, _, err = run(capsys, *common, eagle31, "--output", tmp_path / "b", "--norm-output", "false")
    assert_last_line_error(
        code,
        err,
        "norm_output=False was passed, but the native checkpoint",
        "can be read only as norm_output=True (as it states)",
    )
    code, _, err = run(capsys, *common, eagle31, "--output", tmp_path / "c", "--target-layer-ids", "3,3,3")
    assert_last_line_error(code, err, "target_layer_ids=[3, 3, 3] was passed", "can be read only as target_layer_ids=")


def test_init_draft_from_the_official_layout_reads_norm_output_as_told(chat_target, eagle31, tmp_path, capsys):
    folder, data = chat_target
    save_eagle(Eagle3DraftModel.from_pretrained(eagle31), tmp_path / "eagle", include_embedding=True)
    common = [
        "train",
        "--target",
        folder,
        "--data",
        data,
        "--ttt-length",
        "2",
        "--max-steps",
        "1",
        "--learning-rate",
        "0",
        "--init-draft",
        tmp_path / "eagle",
    ]
    with pytest.warns(UserWarning, match=r"norm_output=True: read as norm_output=True.*PR #879"):
        code, _, err = run(capsys, *common, "--output", tmp_path / "servers")
    assert code == 0, err
    assert Eagle3DraftModel.from_pretrained(tmp_path / "servers").config.norm_output
    # SpecForge before its PR #879 meant EAGLE-3 by it: --norm-output false continues it that way.
    code, _, err = run(capsys, *common, "--output", tmp_path / "older", "--norm-output", "false")
    assert code == 0, err
    assert not Eagle3DraftModel.from_pretrained(tmp_path / "older").config.norm_output


# ------------------------------------------------------------------------------------------------------------------
# --resume: the checkpoint's config.json is the run's


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def interrupted(chat_target, tmp_path_factory):
    """A run continuing an EAGLE-3.1 draft (`--init-draft`) whose shape the target does not give -- two layers, its
    own taps, a narrower MLP, another RoPE theta, a normed residual -- stopped at its checkpoint of step 2."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("interrupted")
    folder, data = chat_target
    init = Eagle3DraftModel.from_target(
        AutoModelForCausalLM.from_pretrained(folder),
        draft_vocab_size=64,
        fc_norm=True,
        norm_output=True,
        norm_before_residual=True,
        target_layer_ids=[1, 2, 3],
        num_hidden_layers=2,
        intermediate_size=48,
        rope_parameters={"rope_type": "default", "rope_theta": 1234.0},
    )
    init.save_pretrained(root / "init")
    out = root / "run"
    code = cli_main(
        [
            str(a)
            for a in (
                "train",
                "--target",
                folder,
                "--data",
                data,
                "--output",
                out,
                "--ttt-length",
                "2",
                "--max-steps",
                "2",
                "--save-steps",
                "1",
                "--init-draft",
                root / "init",
            )
        ]
    )
    assert code == 0
    for name in ("model.safetensors", "config.json"):  # as if it had stopped there: only the checkpoints
        (out / name).unlink()
    return out


def test_resume_rebuilds_the_draft_from_the_checkpoint(chat_target, interrupted, tmp_path, capsys):
    import shutil

    folder, data = chat_target
    checkpoint = Eagle3DraftModel.from_pretrained(interrupted / "checkpoint-2")
    expected = checkpoint.state_dict()
    restated = (
        "--init-draft",
        interrupted.parent / "init",
        "--fc-norm",
        "--norm-output",
        "--target-layer-ids",
        "1,2,3",
        "--num-hidden-layers",
        "2",
        "--draft-vocab-size",
        "64",
    )
    for name, extra in (("bare", ()), ("restated", restated)):
        out = tmp_path / name
        shutil.copytree(interrupted, out)
        # Resumed without --init-draft or any option that shaped the draft (or with all restated), one step more.
        code, text, err = run(
            capsys,
            "train",
            "--target",
            folder,
            "--data",
            data,
            "--output",
            out,
            "--ttt-length",
            "2",
            "--max-steps",
            "3",
            "--resume",
            *extra,
        )
        assert code == 0, err
        assert f"Resuming from {out / 'checkpoint-2'}." in text and "Target-derived init" not in text
        resumed = Eagle3DraftModel.from_pretrained(out)
        c = resumed.config
        assert (
            c.fc_norm,
            c.norm_output,
            c.norm_before_fc,
            c.norm_before_residual,
            c.target_layer_ids,
            c.num_hidden_layers,
            c.intermediate_size,
            c.rope_parameters["rope_theta"],
        ) == (True, True, False, True, [1, 2, 3], 2, 48, 1234.0), name
        state = resumed.state_dict()
        assert state.keys() == expected.keys(), name  # no fc_norm weight dropped
        assert torch.equal(state["d2t"], expected["d2t"]) and torch.equal(state["t2d"], expected["t2d"])
        # Trained on from the checkpoint's weights (one step of lr <= 1e-4 moves none far), not from fresh ones.
        assert all(torch.allclose(state[k], v, atol=2e-3) for k, v in expected.items()), name
        assert not all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in resumed.fc_norm)


def vocab_file(folder, checkpoint, ids):
    """A `--vocab` file holding the target ids `ids`."""
    from eagle3_hf.training.vocab import build_draft_vocab, load_draft_vocab, save_draft_vocab

    counts = torch.zeros(load_draft_vocab(checkpoint).target_vocab_size, dtype=torch.long)
    counts[list(ids)] = 1
    path = folder / f"vocab-{len(ids)}.safetensors"
    save_draft_vocab(path, build_draft_vocab(counts, counts.numel(), len(ids)))
    return path


# The three ways to resume, each as (options, the flag its refusal names): the same check for all.
RESUMES = {
    "resume": (lambda ckpt: ["--resume"], "--resume"),
    "from-checkpoint": (lambda ckpt: ["--resume-from-checkpoint", ckpt], "--resume-from-checkpoint"),
    "both": (lambda ckpt: ["--resume", "--resume-from-checkpoint", ckpt], "--resume-from-checkpoint"),
}


@pytest.mark.parametrize("how", RESUMES)
@pytest.mark.parametrize(
    "option, fragments",
    [
        (["--fc-norm", "false"], ["a draft with fc_norm=True, but --fc-norm is false"]),
        (["--norm-output", "false"], ["a draft with norm_output=True, but --norm-output is false"]),
        (["--norm-before-fc"], ["a draft with norm_before_fc=False, but --norm-before-fc is true"]),
        (["--target-layer-ids", "2,4,5"], ["target_layer_ids=[1, 2, 3], but --target-layer-ids is 2,4,5"]),
        (["--num-hidden-layers", "1"], ["num_hidden_layers=2, but --num-hidden-layers is 1"]),
        (["--draft-vocab-size", "80"], ["draft_vocab_size=64, but --draft-vocab-size is 80"]),
        (["--vocab", 40], ["a draft vocabulary of 64 ids, but --vocab", "holds 40"]),
        (["--vocab", 64], ["a draft vocabulary whose id 0 is target id 0, but in --vocab", "it is target id 100"]),
        (["--loss", "tv"], ["a draft trained with --loss forward_kl, but this run's --loss is tv"]),
    ],
)
def test_resume_refuses_an_option_that_contradicts_the_checkpoint(
    chat_target, interrupted, tmp_path, capsys, how, option, fragments
):
    folder, data = chat_target
    checkpoint = interrupted / "checkpoint-2"
    if option[0] == "--vocab":  # ids 100.. : none of them the checkpoint's first id (the draft's vocabulary is 0..63)
        option = ["--vocab", vocab_file(tmp_path, checkpoint, range(100, 100 + option[1]))]
    resume, flag = RESUMES[how]
    before = snapshot(interrupted)
    code, _, err = run(
        capsys,
        "train",
        "--target",
        folder,
        "--data",
        data,
        "--output",
        interrupted,
        "--ttt-length",
        "2",
        "--max-steps",
        "3",
        *resume(checkpoint),
        *option,
    )
    keep = "give the checkpoint's value" if option[0] == "--loss" else f"leave {option[0]} out"
    assert_clean_error(code, err, f"{flag}: {checkpoint} holds", *fragments, keep + " to continue that run")
    assert snapshot(interrupted) == before  # refused before anything loaded or was written


def test_resume_checks_pass_what_the_checkpoint_holds(interrupted, tmp_path, capsys):
    """The checkpoint's own vocabulary, restated options and its loss pass; a checkpoint folder that is not one is
    named."""
    from eagle3_hf.commands.train import parse_cli
    from eagle3_hf.commands.train_checks import check_train_arguments, resume_checkpoint
    from eagle3_hf.training.vocab import load_draft_vocab, save_draft_vocab

    checkpoint = interrupted / "checkpoint-2"
    own = tmp_path / "own.safetensors"
    save_draft_vocab(own, load_draft_vocab(checkpoint))
    common = ["--target", "t", "--data", "d", "--output", str(interrupted), "--max-steps", "2"]
    for resume in (["--resume"], ["--resume-from-checkpoint", str(checkpoint)]):
        args = parse_cli([*common, *resume, "--vocab", str(own), "--fc-norm", "--loss", "forward_kl"])
        check_train_arguments(args)
        assert resume_checkpoint(args) == str(checkpoint)
        assert args.num_hidden_layers == 2 and args.target_layer_ids == [1, 2, 3]  # the checkpoint's
    args = parse_cli([*common, "--resume-from-checkpoint", str(checkpoint), "--overwrite-output-dir"])
    with pytest.raises(ValueError, match="lies in --output-dir, whose checkpoints --overwrite-output-dir removes"):
        check_train_arguments(args)
    args = parse_cli([*common, "--resume-from-checkpoint", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--resume-from-checkpoint .*missing': no such folder"):
        resume_checkpoint(args)


def test_resuming_to_more_steps_says_what_the_schedule_does(chat_target, tmp_path, capsys):
    folder, data = chat_target
    out = tmp_path / "run"
    common = ["--lr-scheduler-type", "cosine", "--learning-rate", "1e-3", "--save-steps", "1", "--logging-steps", "1"]
    code, _, err = train(capsys, chat_target, out, "--max-steps", "2", *common)
    assert code == 0, err
    code, text, err = train(capsys, chat_target, out, "--max-steps", "4", "--resume", *common)
    assert code == 0, err
    assert (
        f"Warning: {out / 'checkpoint-2'} ended its cosine schedule of 2 steps, and this run goes to --max-steps 4"
        in text
    )
    assert "step 3 runs at the rate it had reached" in text and "--init-draft" in text
    rates = {
        log["step"]: log["learning_rate"]
        for log in json.loads((out / "trainer_state.json").read_text())["log_history"]
        if "learning_rate" in log
    }
    assert rates[3] == 0 < rates[4]  # what the warning says: the old schedule's end, then the stretched one
