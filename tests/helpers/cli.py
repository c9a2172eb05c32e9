"""Running `eagle3-hf` in-process, checking its one-line errors, and a tiny target and trained draft for it."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main


def run(capsys, *argv):
    """`eagle3-hf ARGV` in this process: (exit code, stdout, stderr)."""
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_error(code, err, *fragments):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error: " in lines[0] and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama target saved as a folder, and a native draft for it saved without its embedding."""
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
        )
    ).eval()
    target.save_pretrained(root / "target")
    target = LlamaForCausalLM.from_pretrained(root / "target").eval()  # records its architectures, as loaded ones do
    draft = Eagle3DraftModel.from_target(target)
    draft.save_pretrained(root / "draft", include_embedding=False)
    return root, target


def train(capsys, chat_target, out, *extra):
    folder, data = chat_target
    return run(
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
        "--draft-vocab-size",
        "64",
        "--logging-steps",
        "1",
        *extra,
    )
