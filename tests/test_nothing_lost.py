"""Nothing lost, ever: outputs are written whole with ordinary permissions, `--resume` cannot clobber a finished
draft or pick a half-written checkpoint, `regenerate` cannot mix two data sets, nothing is deleted before every
option is checked, and corrupt inputs are named in one line with exit code 2."""

import json
import os
import stat

import pytest
import torch
from test_cli import assert_clean_error, run, tiny, train  # noqa: F401 (tiny is a fixture)

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.outputs import staged_dir, staged_file

torch.set_num_threads(1)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


# ------------------------------------------------------------------------------------------------------------------
# permissions


def test_staged_outputs_and_saved_drafts_get_the_umask_permissions(tmp_path, tiny, umask_022):  # noqa: F811
    with staged_file(tmp_path / "out.json") as temporary:
        (tmp_path / os.path.basename(temporary)).write_text("{}")
    with staged_dir(tmp_path / "folder") as folder:
        os.makedirs(os.path.join(folder, "sub"))
        with open(os.path.join(folder, "sub", "file.txt"), "w") as f:
            f.write("x")
    assert mode(tmp_path / "out.json") == 0o644
    assert mode(tmp_path / "folder") == mode(tmp_path / "folder" / "sub") == 0o755
    assert mode(tmp_path / "folder" / "sub" / "file.txt") == 0o644
    _, target = tiny
    Eagle3DraftModel.from_target(target).save_pretrained(tmp_path / "draft")
    assert {p.name: mode(p) for p in (tmp_path / "draft").iterdir()} == {
        name: 0o644 for name in ("config.json", "model.safetensors", "README.md")
    }


# ------------------------------------------------------------------------------------------------------------------
# train: checkpoints, --resume, --overwrite-output-dir


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_over_a_finished_draft_without_checkpoints_refuses(chat_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = train(capsys, chat_target, out, "--max-steps", "2", "--save-strategy", "no")
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and not list(out.glob("checkpoint-*"))
    before = snapshot(out)
    code, _, err = train(capsys, chat_target, out, "--max-steps", "4", "--resume")
    assert_clean_error(code, err, "holds a finished draft", "--init-draft", "--overwrite-output-dir")
    assert snapshot(out) == before  # the finished draft is untouched


def test_an_interrupted_checkpoint_is_never_left_and_resume_skips_an_incomplete_one(
    chat_target, tmp_path, capsys, monkeypatch
):
    from transformers import Trainer

    out = tmp_path / "run"
    saved_rng = Trainer._save_rng_state

    def interrupted_at_step_2(self, output_dir):  # Ctrl-C in the middle of writing the second checkpoint
        if self.state.global_step == 2:
            raise KeyboardInterrupt
        saved_rng(self, output_dir)

    monkeypatch.setattr(Trainer, "_save_rng_state", interrupted_at_step_2)
    code, _, err = train(capsys, chat_target, out, "--max-steps", "3", "--save-steps", "1")
    assert code == 130, err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]  # no half-written checkpoint-2
    monkeypatch.undo()
    # A checkpoint left half-written by something else (an older version): trainer_state.json is written last.
    partial = out / "checkpoint-9"
    partial.mkdir()
    for name in ("config.json", "model.safetensors"):
        (partial / name).write_bytes((out / "checkpoint-1" / name).read_bytes())
    code, text, err = train(capsys, chat_target, out, "--max-steps", "3", "--save-steps", "1", "--resume")
    assert code == 0, err
    assert f"Skipping {partial}: it has no trainer_state.json" in text
    assert f"Resuming from {out / 'checkpoint-1'}." in text
    assert "Target-derived init" not in text  # the checkpoint's weights replace any init
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and not (out / ".checkpoint-staging.tmp").exists()
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-3"}
    aside = list(out.glob(".checkpoint-9.*.incomplete"))  # kept for inspection, out of the rotation's way
    assert len(aside) == 1 and f"moved it aside to {aside[0]}" in text


def test_resume_takes_the_checkpoints_draft_shape_and_refuses_another(chat_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = train(capsys, chat_target, out, "--max-steps", "1", "--save-steps", "1")
    assert code == 0, err
    code, _, err = train(capsys, chat_target, out, "--max-steps", "2", "--resume", "--draft-vocab-size", "80")
    assert_clean_error(code, err, "draft_vocab_size=64", "--draft-vocab-size is 80", "leave --draft-vocab-size out")
    folder, data = chat_target
    code, text, err = run(capsys, "train", "--target", folder, "--data", data, "--output", out, "--ttt-length", "2",
                          "--max-steps", "2", "--resume")  # fmt: skip
    assert code == 0, err
    assert Eagle3DraftModel.from_pretrained(out).config.draft_vocab_size == 64


@pytest.mark.parametrize("bad", [["--learning-rate", "-1"], ["--adam-beta2", "1.5"]])
def test_overwrite_deletes_nothing_before_every_option_is_checked(chat_target, tmp_path, capsys, bad):
    out = tmp_path / "run"
    code, _, err = train(capsys, chat_target, out, "--max-steps", "1", "--save-steps", "1")
    assert code == 0, err
    before = snapshot(out)
    code, text, err = train(capsys, chat_target, out, "--max-steps", "1", "--overwrite-output-dir", *bad)
    assert code == 2 and "removed" not in text, (text, err)
    assert snapshot(out) == before
