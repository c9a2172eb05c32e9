"""Checkpoint layouts: loading external EAGLE-3 checkpoints, exporting them, and refusing bad ones.

Synthetic checkpoints are written in each layout with the key names and shapes of the reference (§2) and random
values. Their logits are compared with an independent forward written here from the EAGLE-3 equations (§1, §2c)
with plain torch ops on the raw tensors.
"""

import argparse
import json
import os

import pytest
import torch
from helpers.convert import (
    VD,
    L,
    V,
    assert_same_draft,
    check_against_reference,
    draft_weights,
    external_config,
    randomized_draft,
    spec,
    target,  # noqa: F401 (fixture)
    tiny_target,
    write_checkpoint,
)
from transformers import GPT2Config, GPT2LMHeadModel

from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel
from eagle3_hf.commands.convert import add_cli_arguments, run_cli
from eagle3_hf.modeling.layouts import detect_layout, save_eagle, save_speculators

# ------------------------------------------------------------------------------------------------
# independent reference forward (reference §1 steps 1-8, flags of §2c)


# ------------------------------------------------------------------------------------------------
# synthetic checkpoints


def make_checkpoint(tmp_path, target, name="ckpt", **overrides):
    s = spec(**overrides)
    w = draft_weights(s, target)
    return write_checkpoint(tmp_path / name, external_config(s), w, s), w, s


CASES = {
    "official_bin": dict(fmt="bin"),
    "official_safetensors": dict(theta=500000.0, embed="target", prefix="model."),
    "specforge": dict(
        fc_norm=True, head_dim_field=True, d=32, Ht=48, embed="own", theta=1e6, linear=2.0, taps=[2, 4, 5]
    ),
    "speculators_llama_nbr": dict(
        layout="speculators", nbr=True, embed="target", theta=10000.0, taps=[2, 4, 5], prefix="draft_model."
    ),
    "speculators_llama": dict(layout="speculators", Vd=V, vocab_map=False),
    "speculators_qwen3": dict(
        layout="speculators",
        layer_type="qwen3",
        qk_norm=True,
        norm_before_fc=True,
        norm_output=True,
        nbr=True,
        head_dim_field=True,
        d=32,
        theta=1e6,
        embed="own",
        eps=1e-6,
    ),
    "speculators_llama_2_layers": dict(layout="speculators", layers=2, embed="target", taps=[2, 4, 5]),
    "speculators_qwen3_3_layers": dict(
        layout="speculators",
        layer_type="qwen3",
        qk_norm=True,
        norm_output=True,
        nbr=True,
        head_dim_field=True,
        d=32,
        theta=1e6,
        embed="own",
        eps=1e-6,
        layers=3,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_external_checkpoint_matches_reference_forward(tmp_path, target, case):
    path, w, s = make_checkpoint(tmp_path, target, **CASES[case])
    needs_target = s["embed"] == "none"
    draft = Eagle3DraftModel.from_pretrained(path, target=target if needs_target else None)
    if needs_target:
        w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    assert draft.embedding_loaded
    c = draft.config
    assert c.rope_parameters["rope_theta"] == (s["theta"] or 10000.0)  # the draft's θ, never the target's 500k
    assert (c.head_dim, c.target_hidden_size, c.draft_vocab_size) == (s["d"], s["Ht"], s["Vd"])
    assert (c.fc_norm, c.norm_before_fc, c.norm_before_residual, c.norm_output) == (
        s["fc_norm"],
        s["norm_before_fc"],
        s["nbr"],
        s["norm_output"],
    )
    if s["taps"] is not None:
        assert c.target_layer_ids == s["taps"]
    assert c.num_hidden_layers == s["layers"] and len(draft.upper_layers) == s["layers"] - 1
    if s["vocab_map"]:
        assert torch.equal(draft.d2t, w["d2t"]) and torch.equal(draft.t2d, w["t2d"])
    else:  # Vd == V without a mapping: identity
        assert torch.equal(draft.draft_to_target_ids(torch.arange(V)), torch.arange(V)) and bool(draft.t2d.all())
    check_against_reference(draft, w, s)


def test_speculators_verifier_identity_and_official_defaults(tmp_path, target):
    path, _, _ = make_checkpoint(tmp_path, target, **CASES["speculators_llama_nbr"])
    config = Eagle3DraftModel.from_pretrained(path).config
    assert config.target_name_or_path == "tiny/llama" and config.target_architectures == ["LlamaForCausalLM"]
    path, _, _ = make_checkpoint(tmp_path, target, name="official")
    draft = Eagle3DraftModel.from_pretrained(path, target=target)
    assert draft.config.target_num_hidden_layers == L and draft.config.target_layer_ids == [2, L // 2, L - 3]
    assert draft.embed_tokens.weight.requires_grad is False


def test_draft_wider_than_target_keeps_its_own_embedding(tmp_path):
    narrow = tiny_target(hidden=48)
    path, w, s = make_checkpoint(tmp_path, narrow, **CASES["specforge"])
    draft = Eagle3DraftModel.from_pretrained(path, target=narrow)
    assert torch.equal(draft.embed_tokens.weight, w["embed_tokens.weight"])


def test_dtype_and_device_kwargs(tmp_path, target):
    path, w, _ = make_checkpoint(tmp_path, target, embed="target")
    draft = Eagle3DraftModel.from_pretrained(path, dtype=torch.bfloat16, device="cpu")
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.d2t.dtype == torch.long
    assert Eagle3DraftModel.from_pretrained(path, torch_dtype=torch.float16).fc.weight.dtype == torch.float16
    assert torch.equal(Eagle3DraftModel.from_pretrained(path).fc.weight, w["fc.weight"])  # "auto": as stored


# ------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize(
    "to, overrides, dtype",
    [
        ("speculators", dict(norm_before_residual=True, norm_output=True, fc_norm=True), torch.float32),
        ("speculators", dict(norm_before_fc=True, target_layer_ids=[1, 3, 6]), torch.bfloat16),
        (
            "eagle",
            dict(fc_norm=True, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5}),
            torch.float32,
        ),
        ("eagle", dict(), torch.bfloat16),
        ("speculators", dict(num_hidden_layers=3, norm_before_residual=True), torch.bfloat16),
    ],
)
def test_round_trip_through_external_layout_is_bit_exact(tmp_path, target, to, overrides, dtype):
    draft = randomized_draft(target, **overrides).to(dtype)
    native = tmp_path / "native"
    draft.save_pretrained(native)
    loaded = Eagle3DraftModel.from_pretrained(native, target=target, dtype="auto")
    (save_speculators if to == "speculators" else save_eagle)(loaded, tmp_path / to, include_embedding=True)
    back = Eagle3DraftModel.from_pretrained(tmp_path / to, dtype="auto")
    back.save_pretrained(tmp_path / "native2")
    again = Eagle3DraftModel.from_pretrained(tmp_path / "native2", dtype="auto")
    assert_same_draft(loaded, again)
    # The draft's weights as cast; the embedding the target's own (a cast copy is replaced by the exact one).
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in draft.state_dict().items() if "embed" not in k)
    assert torch.equal(again.embed_tokens.weight, target.get_input_embeddings().weight)
    if to == "speculators":
        assert again.config.target_name_or_path == draft.config.target_name_or_path


def test_qwen3_draft_round_trips_through_speculators(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=V,
        )
    ).eval()
    draft = randomized_draft(qwen3)
    save_speculators(draft, tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert_same_draft(draft, Eagle3DraftModel.from_pretrained(tmp_path / "spec", target=qwen3))


def test_exported_files_follow_the_external_layouts(tmp_path, target):
    draft = randomized_draft(target)
    save_eagle(draft, tmp_path / "eagle")
    save_speculators(draft, tmp_path / "spec")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "midlayer.hidden_norm.weight" in keys and "embed_tokens.weight" not in keys and {"d2t", "t2d"} <= keys
    eagle = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert eagle["architectures"] == ["LlamaForCausalLMEagle3"] and eagle["draft_vocab_size"] == VD
    assert eagle["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # output-of-layer ids
    assert "target_hidden_size" not in eagle  # its presence tells the official loader the embedding is included
    with safe_open(str(tmp_path / "spec" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in keys and "embed_tokens.weight" in keys
    spec_cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec_cfg["speculators_model_type"] == "eagle3" and spec_cfg["architectures"] == ["Eagle3Speculator"]
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert spec_cfg["speculators_config"]["proposal_methods"][0]["proposal_type"] == "greedy"


def test_deeper_draft_files_in_each_layout(tmp_path, target):
    draft = randomized_draft(target, num_hidden_layers=3)
    draft.save_pretrained(tmp_path / "native")
    assert json.loads((tmp_path / "native" / "config.json").read_text())["num_hidden_layers"] == 3
    assert_same_draft(draft, Eagle3DraftModel.from_pretrained(tmp_path / "native"))
    save_speculators(draft, tmp_path / "spec")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "spec" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("layers.2.self_attn.q_proj.weight").get_shape() == [64, 64]  # H wide above layer 0
        assert f.get_slice("layers.0.self_attn.q_proj.weight").get_shape() == [64, 128]
    assert {k.split(".")[1] for k in keys if k.startswith("layers.")} == {"0", "1", "2"}
    assert not any(k.startswith(("midlayer.", "upper_layers.")) for k in keys)
    assert "layers.0.hidden_norm.weight" in keys and "layers.1.hidden_norm.weight" not in keys
    spec_cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec_cfg["transformer_layer_config"]["num_hidden_layers"] == 3
    assert_same_draft(draft, Eagle3DraftModel.from_pretrained(tmp_path / "spec"))
    refusal = r"official/SpecForge layout cannot express.*num_hidden_layers=3 \(it holds one decoder layer; save"
    with pytest.raises(ValueError, match=refusal + " a deeper draft in the native or speculators layout"):
        save_eagle(draft, tmp_path / "eagle")
    assert not (tmp_path / "eagle").exists()  # refused before anything is written


def test_external_depth_is_checked_against_the_weights(tmp_path, target):
    with pytest.raises(ValueError, match=r"num_hidden_layers=2; drafts in this layout have exactly 1 decoder layer"):
        Eagle3DraftModel.from_pretrained(make_checkpoint(tmp_path, target, "eagle2", layers=2)[0], target=target)

    def speculators(name, layers, stated):
        s = spec(layout="speculators", layers=layers, embed="target")
        config = external_config(s)
        config["transformer_layer_config"]["num_hidden_layers"] = stated
        return write_checkpoint(tmp_path / name, config, draft_weights(s, target), s)

    short = r"num_hidden_layers=3, but its weights hold decoder layer\(s\) \[0, 1\] \(layers.\{i\}.\* / midlayer.\*\)"
    with pytest.raises(ValueError, match=short + ": expected layers 0..2"):
        Eagle3DraftModel.from_pretrained(speculators("short", 2, 3))
    with pytest.raises(ValueError, match=r"num_hidden_layers=1, but its weights hold decoder layer\(s\) \[0, 1\]"):
        Eagle3DraftModel.from_pretrained(speculators("long", 2, 1))
    for bad in (0, "2"):
        with pytest.raises(ValueError, match=rf"num_hidden_layers={bad!r}; expected an integer >= 1"):
            Eagle3DraftModel.from_pretrained(speculators(f"bad{bad}", 1, bad))


def test_sharded_checkpoint_and_missing_shard(tmp_path, target):
    draft = randomized_draft(target)
    draft.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert_same_draft(draft, Eagle3DraftModel.from_pretrained(tmp_path / "sharded"))
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"lists the shard '{shard.name}', which is not in"):
        Eagle3DraftModel.from_pretrained(tmp_path / "sharded")


def test_unknown_hub_id_offline(tmp_path):
    unknown = r"neither a local checkpoint folder, a draft shipped with eagle3_hf .*nor a Hub repo"
    with pytest.raises(ValueError, match=unknown):
        Eagle3DraftModel.from_pretrained("no-such-org/no-such-draft", local_files_only=True, cache_dir=str(tmp_path))


def test_native_save_without_embedding_then_load_with_target(tmp_path, target):
    path, w, _ = make_checkpoint(tmp_path, target)
    draft = Eagle3DraftModel.from_pretrained(path)  # official checkpoint: no embedding
    assert not draft.embedding_loaded
    draft.save_pretrained(tmp_path / "native")
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "native")
    assert not reloaded.embedding_loaded  # the random placeholder was not written
    bound = Eagle3DraftModel.from_pretrained(tmp_path / "native", target=target)
    assert torch.equal(bound.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(bound.lm_head.weight, w["lm_head.weight"])


def test_cli_converts_with_a_target_folder(tmp_path, target):
    path, w, _ = make_checkpoint(tmp_path, target)
    target.save_pretrained(tmp_path / "target")
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args([path, str(tmp_path / "out"), "--to", "speculators", "--target", str(tmp_path / "target")])
    assert run_cli(args) == 0
    out = Eagle3DraftModel.from_pretrained(tmp_path / "out")
    assert torch.equal(out.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(out.fc.weight, w["fc.weight"])
    with pytest.raises(ValueError, match="this draft has no token embedding"):  # eagle3-hf prints it as one line
        run_cli(parser.parse_args([path, str(tmp_path / "bad"), "--to", "eagle", "--include-embedding"]))


# ------------------------------------------------------------------------------------------------
# bad input


def corrupt(tmp_path, target, edit, **overrides):
    s = spec(**overrides)
    w = draft_weights(s, target)
    edit(w)
    return write_checkpoint(tmp_path / "bad", external_config(s), w, s)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.pop("midlayer.mlp.up_proj.weight"), r"missing weight\(s\) \['midlayer.mlp.up_proj.weight'\]"),
        (lambda w: w.update({"midlayer.extra.weight": torch.ones(3)}), r"unexpected weight\(s\) \['midlayer.extra"),
        (lambda w: w.update({"fc.weight": torch.ones(64, 100)}), r"fc.weight expected \(64, 192\), got \(64, 100\)"),
        (lambda w: w["d2t"].__setitem__(-1, V), r"vocabulary mapping.*outside \[0, 1000\)"),
        (lambda w: w["t2d"].__setitem__(int(w["d2t"][0]), False), r"vocabulary mapping.*t2d is False"),
        (lambda w: w.update({"t2d": torch.full((V,), 2.0)}), r"t2d must be a 0/1 membership mask"),
        (lambda w: (w.pop("d2t"), w.pop("t2d")), r"no d2t/t2d vocabulary mapping"),
    ],
)
def test_bad_weights_are_refused(tmp_path, target, edit, message):
    with pytest.raises(ValueError, match=message):
        Eagle3DraftModel.from_pretrained(corrupt(tmp_path, target, edit))


@pytest.mark.parametrize(
    "other, message",
    [
        (dict(hidden=48), "hidden size 48 \\(draft expects 64\\)"),
        (dict(vocab=999), "vocabulary size 999 \\(draft expects 1000\\)"),
        (dict(layers=10), "10 layers \\(draft expects 8\\)"),
    ],
)
def test_target_mismatch_is_refused(tmp_path, target, other, message):
    randomized_draft(target).save_pretrained(tmp_path / "native")
    with pytest.raises(ValueError, match=message):
        Eagle3DraftModel.from_pretrained(tmp_path / "native", target=tiny_target(**other))


def test_unsupported_target_architecture(tmp_path, target):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=8, n_head=4, vocab_size=V))
    path, _, _ = make_checkpoint(tmp_path, target)
    with pytest.raises(ValueError, match=r"model_type='gpt2'.*supports targets of type.*'llama'.*'qwen3'"):
        Eagle3DraftModel.from_pretrained(path, target=gpt2)
    with pytest.raises(ValueError, match=r"Unsupported target architecture model_type='gpt2'"):
        Eagle3DraftModel.from_target(gpt2)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_truncated_weights_file(tmp_path, target, fmt):
    path, _, _ = make_checkpoint(tmp_path, target, fmt=fmt)
    name = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
    data = open(os.path.join(path, name), "rb").read()
    open(os.path.join(path, name), "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{name}.*truncated or corrupt"):
        Eagle3DraftModel.from_pretrained(path)


def test_forward_without_embedding_is_refused(tmp_path, target):
    draft = Eagle3DraftModel.from_pretrained(make_checkpoint(tmp_path, target)[0])
    with pytest.raises(ValueError, match="no token embedding"):
        draft(torch.zeros(1, 2, dtype=torch.long), target_hidden_states=torch.zeros(1, 2, 192))


def test_random_embedding_differs_from_target(tmp_path, target):
    path, _, _ = make_checkpoint(tmp_path, target, embed="own")
    with pytest.raises(ValueError, match="embedding differs from the target's.*use_target_embedding=True"):
        Eagle3DraftModel.from_pretrained(path, target=target)
    draft = Eagle3DraftModel.from_pretrained(path, target=target, use_target_embedding=True)
    assert torch.equal(draft.embed_tokens.weight, target.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="use_target_embedding=True needs the target"):
        Eagle3DraftModel.from_pretrained(path, use_target_embedding=True)


def test_unknown_layout_and_missing_files(tmp_path, target):
    with pytest.raises(ValueError, match=r"Cannot tell which EAGLE-3 checkpoint layout.*Accepted: native"):
        detect_layout({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["wte.weight"])
    with pytest.raises(ValueError, match="speculators_model_type='mlp'"):
        detect_layout({"speculators_model_type": "mlp"}, [])
    bare = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    assert detect_layout(bare, ["model.fc.weight"]) == "eagle"
    path, _, _ = make_checkpoint(tmp_path, target)
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="No weights in"):
        Eagle3DraftModel.from_pretrained(path)
    with pytest.raises(ValueError, match="transformer_layer_config.model_type='gemma3_text' is not supported"):
        Eagle3DraftModel.from_pretrained(
            make_checkpoint(tmp_path, target, "g", layout="speculators", layer_type="gemma3_text")[0]
        )


def test_exports_refuse_what_the_layout_cannot_express(tmp_path, target):
    with pytest.raises(ValueError, match="official/SpecForge layout cannot express.*norm_before_residual=True"):
        save_eagle(randomized_draft(target, norm_before_residual=True), tmp_path / "a")
    with pytest.raises(
        ValueError,
        match=r"norm_before_fc=True \(vLLM and SGLang since its PR #32334 apply it, but SpecForge has no such norm",
    ):
        save_eagle(randomized_draft(target, norm_before_fc=True), tmp_path / "b")
    with pytest.raises(ValueError, match="speculators layout cannot express.*layer_type='mistral'"):
        save_speculators(randomized_draft(target, layer_type="mistral"), tmp_path / "c")
    narrow_config = Eagle3DraftConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_attention_heads=2, target_hidden_size=64
    )
    narrow = Eagle3DraftModel(narrow_config)
    with pytest.raises(ValueError, match="include_embedding=True"):
        save_eagle(narrow, tmp_path / "d")
    no_embedding = Eagle3DraftModel.from_pretrained(make_checkpoint(tmp_path, target)[0])
    with pytest.raises(ValueError, match="has no token embedding"):
        save_eagle(no_embedding, tmp_path / "e", include_embedding=True)
