"""Exports keep every number: the target's embedding bit for bit in the target's dtype, in every layout.

The source is a bfloat16 draft of a float32 target saved without its embedding, as the shipped draft is. Each
layout's export, reloaded, gives logits bit-identical to the source draft's on the same features, in bfloat16 and in
float32 (where a rounded embedding shows); the loader takes a stored copy for the target's embedding only when it is
exactly that, or a visible cast of it. Also: the speculators verifier recorded as a local folder for offline use.
"""

import argparse
import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli_main
from eagle3_hf.commands.convert import add_cli_arguments, run_cli
from eagle3_hf.modeling.embedding import embedding_mismatch
from eagle3_hf.modeling.layouts import save_eagle, save_speculators

V, HUB_ID = 96, "tiny-org/tiny-llama"


def tiny_llama(vocab=V):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, float32 target): root/target holds the target, root/shipped a bfloat16 draft without embedding."""
    root = tmp_path_factory.mktemp("export_embedding")
    torch.manual_seed(0)
    tiny_llama().save_pretrained(root / "target")
    target = LlamaForCausalLM.from_pretrained(root / "target").eval()  # records its architectures, as loaded ones do
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    draft.config.target_name_or_path = HUB_ID
    draft.to(torch.bfloat16).save_pretrained(root / "shipped", include_embedding=False)
    return root, target


def logits(draft):
    torch.manual_seed(2)
    ids, features = torch.randint(0, V, (2, 6)), torch.randn(2, 6, 192)
    with torch.no_grad():
        return draft(ids, target_hidden_states=features.to(draft.fc.weight.dtype)).logits


def convert(*argv):
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    return run_cli(parser.parse_args([str(a) for a in argv]))


def stored(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize(
    "to, flags, reload_with_target",
    [("native", [], False), ("eagle", ["--include-embedding"], False), ("eagle", [], True), ("speculators", [], False)],
)
def test_each_layout_reloads_bit_identical(setup, tmp_path, capsys, to, flags, reload_with_target):
    root, target = setup
    assert convert(root / "shipped", tmp_path / "out", "--to", to, "--target", root / "target", *flags) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]  # not progress bars
    tensors = stored(tmp_path / "out")
    assert tensors["fc.weight"].dtype == torch.bfloat16  # the draft's own weights keep their dtype
    if reload_with_target:
        assert "embed_tokens.weight" not in tensors
        assert len(warnings) == 1 and "must supply the target's" in warnings[0] and "--include-embedding" in warnings[0]
    else:
        assert warnings == []
        embedding = tensors["embed_tokens.weight"]
        assert embedding.dtype == torch.float32 and torch.equal(embedding, target.get_input_embeddings().weight)
    for dtype in ("auto", torch.float32):  # bfloat16 as shipped, and float32, where a rounded embedding would show
        source = Eagle3DraftModel.from_pretrained(root / "shipped", target=target, dtype=dtype)
        back = Eagle3DraftModel.from_pretrained(
            tmp_path / "out", dtype=dtype, **({"target": target} if reload_with_target else {})
        )
        assert back.fc.weight.dtype == source.fc.weight.dtype == (torch.bfloat16 if dtype == "auto" else dtype)
        assert torch.equal(logits(back), logits(source))


def test_a_conversion_without_the_target_keeps_the_stored_embedding(setup, tmp_path):
    root, target = setup
    assert convert(root / "shipped", tmp_path / "native", "--target", root / "target") == 0
    assert convert(tmp_path / "native", tmp_path / "spec", "--to", "speculators") == 0  # no target: as stored
    embedding = stored(tmp_path / "spec")["embed_tokens.weight"]
    assert embedding.dtype == torch.float32 and torch.equal(embedding, target.get_input_embeddings().weight)


@pytest.mark.parametrize("write", ["native", "eagle", "speculators"])
def test_python_exports_write_the_embedding_as_it_came(setup, tmp_path, write):
    root, target = setup
    draft = Eagle3DraftModel.from_pretrained(root / "shipped", target=target, dtype=torch.bfloat16)
    assert draft.embed_tokens.weight.dtype == torch.float32  # held wider than the draft: bfloat16 would round it
    out = tmp_path / write
    if write == "native":
        draft.save_pretrained(out)
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    elif write == "eagle":
        save_eagle(draft, out, include_embedding=True)
    else:
        save_speculators(draft, out)
    assert torch.equal(stored(out)["embed_tokens.weight"], target.get_input_embeddings().weight)
    # A target loaded in bfloat16: the draft's exports write its embedding in bfloat16, not as float32 values.
    half = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.bfloat16)
    wide = Eagle3DraftModel.from_pretrained(root / "shipped", target=half, dtype=torch.float32)
    wide.save_pretrained(tmp_path / "from-half")
    assert torch.equal(stored(tmp_path / "from-half")["embed_tokens.weight"], half.get_input_embeddings().weight)


def with_embedding(setup, folder, embedding):
    root, target = setup
    draft = Eagle3DraftModel.from_pretrained(root / "shipped", target=target, dtype=torch.float32)
    draft.save_pretrained(folder, state_dict={**draft.state_dict(), "embed_tokens.weight": embedding})
    return folder


def test_the_loader_compares_the_embedding_exactly(setup, tmp_path):
    root, target = setup
    exact = target.get_input_embeddings().weight.detach()
    rounded = with_embedding(setup, tmp_path / "rounded", exact.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match=r"rounded to bfloat16 \(in float32\), not the target's own float32 values"):
        Eagle3DraftModel.from_pretrained(rounded, target=target)
    nudged = exact.clone()
    nudged[3, 5] = torch.nextafter(nudged[3, 5], torch.tensor(1.0))  # one float32 step
    with pytest.raises(ValueError, match="token embedding differs from the target's.*use_target_embedding=True"):
        Eagle3DraftModel.from_pretrained(with_embedding(setup, tmp_path / "nudged", nudged), target=target)
    fixed = Eagle3DraftModel.from_pretrained(rounded, target=target, use_target_embedding=True)
    assert torch.equal(fixed.embed_tokens.weight, exact)


def test_a_cast_copy_matches_at_its_own_precision(setup, tmp_path):
    root, target = setup
    exact = target.get_input_embeddings().weight.detach()
    # Stored in bfloat16 (a cast export): the target's rounded to it; the draft takes the target's own values.
    cast = with_embedding(setup, tmp_path / "cast", exact.to(torch.bfloat16))
    draft = Eagle3DraftModel.from_pretrained(cast, target=target)
    assert draft.embed_tokens.weight.dtype == torch.float32 and torch.equal(draft.embed_tokens.weight, exact)
    # A target loaded in bfloat16 takes an exact float32 copy for its own.
    half = LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.bfloat16)
    full = Eagle3DraftModel.from_pretrained(with_embedding(setup, tmp_path / "full", exact), target=half)
    assert embedding_mismatch(exact, half.get_input_embeddings().weight) is None
    assert torch.equal(full.embed_tokens.weight, exact)
    assert embedding_mismatch(exact.to(torch.bfloat16) + 1, exact) == "differs from the target's"


def test_speculators_version_names_the_format_written(setup, tmp_path):
    root, target = setup
    save_speculators(Eagle3DraftModel.from_pretrained(root / "shipped", target=target), tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    # 0.7.0 is the first speculators release whose config defines fc_norm and norm_output, which are written.
    assert config["speculators_version"] == "0.7.0" and {"fc_norm", "norm_output", "norm_before_fc"} <= set(config)


def run(capsys, *argv):
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_verifier_path_records_a_local_folder(setup, tmp_path, capsys):
    root, target = setup
    common = ("--to", "speculators", "--target", root / "target")
    code, out, err = run(capsys, "convert", root / "shipped", tmp_path / "hub", *common)
    assert code == 0, err
    assert f"Recorded the verifier as the Hub id '{HUB_ID}'" in out and "--verifier-path" in out
    code, out, err = run(
        capsys,
        "convert",
        root / "shipped",
        tmp_path / "local",
        *common,
        "--verifier-path",
        os.path.relpath(root / "target"),
    )
    assert code == 0, err
    folder = str(root / "target")
    assert f"Recorded the verifier as the local folder '{folder}'" in out and "offline" in out
    verifier = json.loads((tmp_path / "local" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": folder, "architectures": ["LlamaForCausalLM"]}
    assert Eagle3DraftModel.from_pretrained(tmp_path / "local").config.target_name_or_path == folder


def test_verifier_path_refusals(setup, tmp_path, capsys):
    root, _ = setup
    (tmp_path / "empty").mkdir()
    tiny_llama(vocab=V + 4).save_pretrained(tmp_path / "other")
    capsys.readouterr()
    base = ("convert", root / "shipped", tmp_path / "out", "--target", root / "target")
    cases = [
        (("--to", "eagle", "--verifier-path", root / "target"), "it needs --to speculators, got --to eagle"),
        (("--to", "speculators", "--verifier-path", tmp_path / "nowhere"), "does not exist"),
        (("--to", "speculators", "--verifier-path", tmp_path / "empty"), "holds no transformers checkpoint"),
        (("--to", "speculators", "--verifier-path", tmp_path / "other"), "vocabulary size 100 (draft expects 96)"),
        (("--to", "speculators", "--target-id", root / "target"), "is not a Hub id; expected 'org/name' (to record"),
        (("--to", "speculators", "--target-id", HUB_ID, "--verifier-path", root / "target"), "pass one of them"),
    ]
    for flags, message in cases:
        code, _, err = run(capsys, *base, *flags)
        lines = [line for line in err.splitlines() if "error" in line]  # besides the target's loading bars
        assert code == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in err, (flags, err)
        assert not (tmp_path / "out").exists()
