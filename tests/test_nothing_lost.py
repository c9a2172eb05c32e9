"""Nothing lost, ever: outputs are written whole with ordinary permissions, `--resume` cannot clobber a finished
draft or pick a half-written checkpoint, `regenerate` cannot mix two data sets, nothing is deleted before every
option is checked, and corrupt inputs are named in one line with exit code 2."""

import json
import os
import stat

import pytest
import torch
from helpers.cli import assert_clean_error, run, tiny, train  # noqa: F401 (tiny is a fixture)

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.utils.outputs import staged_dir, staged_file

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_progress_bars():
    """Loading data and saving weights draw progress bars on stderr: only the error line should be there."""
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    yield
    datasets.enable_progress_bars()
    hf_logging.enable_progress_bar()


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
        "2",
        "--resume",
    )
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


# ------------------------------------------------------------------------------------------------------------------
# corrupt inputs: one line naming the file, exit code 2


def test_corrupt_data_vocab_and_shards_are_named_in_one_line(chat_target, tmp_path, capsys):
    folder, data = chat_target
    not_utf8 = tmp_path / "latin1.jsonl"
    not_utf8.write_bytes(
        data.read_bytes() + '{"conversations": [{"from": "human", "value": "café"}]}\n'.encode("latin-1")
    )
    numbers = tmp_path / "numbers.json"
    numbers.write_text("[1, 2, 3]")
    vocab = ["vocab", "--target", folder, "--output", tmp_path / "v.safetensors", "--draft-vocab-size", "64"]
    lines = len(data.read_text().splitlines()) + 1
    assert_clean_error(*run(capsys, *vocab, "--data", not_utf8)[::2], f"{not_utf8} line {lines} is not UTF-8 text")
    assert_clean_error(*run(capsys, *vocab, "--data", numbers)[::2], f"{numbers}: record 0 is 1 (a JSON int)")
    random_bytes = tmp_path / "random.safetensors"
    random_bytes.write_bytes(bytes(range(256)) * 4)
    code, _, err = train(capsys, chat_target, tmp_path / "run", "--max-steps", "1", "--vocab", random_bytes)
    assert_clean_error(code, err, f"Could not read {str(random_bytes)!r}", "truncated or corrupt")
    # A feature shard cut short (a full disk, a copy stopped midway) is found when the folder is opened.
    features = tmp_path / "features"
    assert (
        run(capsys, "features", "--target", folder, "--data", data, "--output", features, "--shard-size", "5")[0] == 0
    )
    shard = features / "shard_00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    code, _, err = run(
        capsys,
        "train",
        "--target",
        folder,
        "--features",
        features,
        "--output",
        tmp_path / "off",
        "--max-steps",
        "1",
        "--ttt-length",
        "2",
    )
    assert_clean_error(code, err, f"Could not read {str(shard)!r}", "truncated or corrupt")


def test_a_draft_config_whose_heads_do_not_divide_its_width_is_named(tmp_path, tiny, capsys):  # noqa: F811
    root, _ = tiny
    draft = tmp_path / "draft"
    Eagle3DraftModel.from_pretrained(root / "draft", target=tiny[1]).save_pretrained(draft)
    config = json.loads((draft / "config.json").read_text())
    config.update(num_attention_heads=5, num_key_value_heads=5)
    config.pop("head_dim", None)
    (draft / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "convert", draft, tmp_path / "out", "--to", "speculators")
    assert_clean_error(
        code, err, repr(str(draft)), "hidden size (64) is not a multiple of the number of attention heads (5)"
    )


# ------------------------------------------------------------------------------------------------------------------
# smaller items


def test_a_quoted_boolean_in_a_config_file_reads_as_the_command_line_reads_it(tmp_path, capsys):
    from eagle3_hf.commands import CommandParser, apply_config

    def parsed(value):
        parser = CommandParser(prog="eagle3-hf x")
        parser.add_argument("--model-card", action="store_true")
        apply_config(parser, {"model_card": value}, "c.yaml")
        return parser.parse_args([]).model_card

    assert [parsed(v) for v in ("false", "False", "no", "0", "true", "yes", False, True)] == [False] * 4 + [
        True
    ] * 2 + [False, True]
    with pytest.raises(SystemExit) as exit_info:
        parsed("maybe")
    assert exit_info.value.code == 2 and "model_card='maybe' is not a boolean" in capsys.readouterr().err


def test_a_draft_vocabulary_covering_under_half_the_tokens_warns(chat_target, tmp_path, capsys):
    code, text, err = run(
        capsys,
        "train",
        "--target",
        chat_target[0],
        "--data",
        chat_target[1],
        "--output",
        tmp_path / "run",
        "--ttt-length",
        "2",
        "--max-steps",
        "1",
        "--draft-vocab-size",
        "3",
    )
    assert code == 0, err
    assert "Warning: --draft-vocab-size 3 covers under 50% of the supervised tokens" in text


def test_a_trainer_checkpoint_config_loads_without_a_warning(tmp_path, caplog):
    """The Trainer writes `use_cache` into its checkpoints' config.json: loading our own checkpoint says nothing,
    while a key of unknown origin is still logged."""
    import json
    import logging

    from helpers.generation import make_pair

    from eagle3_hf import Eagle3DraftModel

    target, draft = make_pair("llama")
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    with caplog.at_level(logging.WARNING):
        Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert "unknown key" not in caplog.text
    (tmp_path / "config.json").write_text(json.dumps({**config, "some_future_field": 1}))
    with caplog.at_level(logging.WARNING):
        Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert "unknown key 'some_future_field'" in caplog.text


def test_a_run_killed_while_it_checkpoints_resumes_from_a_whole_checkpoint(chat_target, tmp_path):
    """SIGKILL, not an exception: a training process killed while it writes checkpoints (one every step) leaves no
    `checkpoint-N` that `--resume` would take half-written, and the resumed run finishes."""
    import signal
    import subprocess
    import sys
    import time

    folder, data = chat_target
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "eagle3_hf.cli",
        "train",
        "--target",
        str(folder),
        "--data",
        str(data),
        "--output",
        str(out),
        "--ttt-length",
        "2",
        "--draft-vocab-size",
        "64",
        "--save-steps",
        "1",
        "--save-total-limit",
        "0",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def saved_steps():
        return [int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")]

    # far more steps than it can finish before the kill; a fast machine must not end the run first
    child = subprocess.Popen(
        [*command, "--max-steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    try:
        deadline = time.monotonic() + 240
        while max(saved_steps(), default=0) < 3 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None, "the run ended before it could be killed"
        time.sleep(0.1)  # into the next steps, whose checkpoints are being written
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    for checkpoint in out.glob("checkpoint-*"):  # every visible checkpoint is whole
        assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "model.safetensors").is_file()
    steps = max(saved_steps())
    done = subprocess.run(
        [*command, "--max-steps", str(steps + 2), "--resume"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"Resuming from {out / f'checkpoint-{steps}'}" in done.stdout + done.stderr
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == steps + 2
