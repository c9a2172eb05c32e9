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
