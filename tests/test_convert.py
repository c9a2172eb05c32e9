"""Checkpoint layouts: loading external EAGLE-3 checkpoints, exporting them, and refusing bad ones.

Synthetic checkpoints are written in each layout with the key names and shapes of the reference (§2) and random
values. Their logits are compared with an independent forward written here from the EAGLE-3 equations (§1, §2c)
with plain torch ops on the raw tensors.
"""

import argparse
import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel
from eagle3_hf.commands.convert import add_cli_arguments, run_cli
from eagle3_hf.modeling.layouts import detect_layout, save_eagle, save_speculators

V, VD, L = 1000, 200, 8  # target vocab, draft vocab, target depth
STRUCTURAL_FIELDS = (
    "vocab_size",
    "draft_vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
    "layer_type",
    "target_hidden_size",
    "target_layer_ids",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)


def tiny_target(hidden=64, vocab=V, layers=L, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        rope_theta=500000.0,  # a θ the draft must NOT pick up
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


# ------------------------------------------------------------------------------------------------
# independent reference forward (reference §1 steps 1-8, flags of §2c)


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta, linear_factor):
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = (positions.float()[:, None] / linear_factor) * inv_freq[None]  # [T, d/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)  # rotate_half
    return x * cos + rotated * sin


def ref_fuse(w, s, feats):
    x = feats
    if s["fc_norm"]:
        x = torch.cat([rms(c, w[f"fc_norm.{i}.weight"], s["eps"]) for i, c in enumerate(x.chunk(3, -1))], -1)
    if s["norm_before_fc"]:
        x = rms(x, w["input_norm.weight"], s["eps"])
    return x @ w["fc.weight"].T


def ref_layer(w, s, ids, g):
    """Logits and fed-back state at every position of `ids` [B, T], given each position's input state g [B, T, H]."""
    p = "midlayer."
    e = w["embed_tokens.weight"][ids]
    hn = rms(g, w[p + "hidden_norm.weight"], s["eps"])
    a = torch.cat([rms(e, w[p + "input_layernorm.weight"], s["eps"]), hn], -1)  # embedding half first
    out = ref_block(w, s, p, a, hn if s["nbr"] else g)
    for i in range(1, s["layers"]):  # vLLM's multi-layer draft: later layers are plain pre-norm layers over H
        p = f"upper_layers.{i - 1}."
        out = ref_block(w, s, p, rms(out, w[p + "input_layernorm.weight"], s["eps"]), out)
    normed = rms(out, w["norm.weight"], s["eps"])
    return normed @ w["lm_head.weight"].T, (normed if s["norm_output"] else out)


def ref_block(w, s, p, a, residual):
    """Causal attention over the attention input `a` [B, T, 2H or H] plus `residual` [B, T, H], then the MLP."""
    eps, nh, nkv, d = s["eps"], s["nh"], s["nkv"], s["d"]
    batch, length = a.shape[:2]
    q = (a @ w[p + "self_attn.q_proj.weight"].T).view(batch, length, nh, d)
    k = (a @ w[p + "self_attn.k_proj.weight"].T).view(batch, length, nkv, d)
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(batch, length, nkv, d)
    if s["qk_norm"]:
        q, k = rms(q, w[p + "self_attn.q_norm.weight"], eps), rms(k, w[p + "self_attn.k_norm.weight"], eps)
    pos, theta = torch.arange(length), s["theta"] or 10000.0  # no rope_theta in the draft config: 10000
    q = rope(q.transpose(1, 2), pos, theta, s["linear"])
    k = rope(k.transpose(1, 2), pos, theta, s["linear"]).repeat_interleave(nh // nkv, 1)
    v = v.transpose(1, 2).repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.float().softmax(-1) @ v).transpose(1, 2).reshape(batch, length, nh * d)
    r = residual + attn @ w[p + "self_attn.o_proj.weight"].T
    m = rms(r, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
    return r + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def check_against_reference(draft, w, s):
    torch.manual_seed(1)
    batch, seq = 2, 7
    ids = torch.randint(0, V, (batch, seq + 1))
    feats = torch.randn(batch, seq, 3 * s["Ht"])
    with torch.no_grad():
        first = draft(ids[:, :seq], target_hidden_states=feats, use_cache=True)
        g = ref_fuse(w, s, feats)
        logits, fed_back = ref_layer(w, s, ids[:, :seq], g)
        torch.testing.assert_close(first.logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(first.last_hidden_state, fed_back, rtol=1e-5, atol=1e-5)
        # A fed-back step at position `seq`, attending to the cached keys of the first call.
        second = draft(ids[:, seq:], hidden_states=first.last_hidden_state[:, -1:], cache=first.cache)
        logits2, fed_back2 = ref_layer(w, s, ids, torch.cat([g, fed_back[:, -1:]], 1))
        torch.testing.assert_close(second.logits, logits2[:, -1:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(second.last_hidden_state, fed_back2[:, -1:], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# synthetic checkpoints


def spec(**overrides):
    s = dict(
        layout="eagle",
        H=64,
        Ht=64,
        nh=4,
        nkv=2,
        d=16,
        I=128,
        Vd=VD,
        eps=1e-5,
        theta=None,
        linear=1.0,
        head_dim_field=False,
        fc_norm=False,
        norm_before_fc=False,
        nbr=False,
        norm_output=False,
        qk_norm=False,
        layer_type="llama",
        embed="none",
        fmt="safetensors",
        prefix="",
        taps=None,
        vocab_map=True,
        layers=1,
    )
    s.update(overrides)
    return s


def random_vocab(gen, draft_vocab=VD):
    used = torch.randperm(V, generator=gen)[:draft_vocab].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    return used - torch.arange(draft_vocab), t2d


def draft_weights(s, target, seed=0):
    """Raw tensors under our names; the embedding is the target's ("target"), a random one ("own") or absent."""
    gen = torch.Generator().manual_seed(seed)
    H, Ht, nh, nkv, d, inter = s["H"], s["Ht"], s["nh"], s["nkv"], s["d"], s["I"]

    def lin(o, i):
        return torch.randn(o, i, generator=gen) / math.sqrt(i)

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=gen)

    p = "midlayer."
    w = {
        "fc.weight": lin(H, 3 * Ht),
        p + "self_attn.q_proj.weight": lin(nh * d, 2 * H),
        p + "self_attn.k_proj.weight": lin(nkv * d, 2 * H),
        p + "self_attn.v_proj.weight": lin(nkv * d, 2 * H),
        p + "self_attn.o_proj.weight": lin(H, nh * d),
        p + "mlp.gate_proj.weight": lin(inter, H),
        p + "mlp.up_proj.weight": lin(inter, H),
        p + "mlp.down_proj.weight": lin(H, inter),
        p + "input_layernorm.weight": norm(H),
        p + "hidden_norm.weight": norm(H),
        p + "post_attention_layernorm.weight": norm(H),
        "norm.weight": norm(H),
        "lm_head.weight": lin(s["Vd"], H),
    }
    if s["fc_norm"]:
        w.update({f"fc_norm.{i}.weight": norm(Ht) for i in range(3)})
    if s["norm_before_fc"]:
        w["input_norm.weight"] = norm(3 * Ht)
    if s["qk_norm"]:
        w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(d), norm(d)
    for i in range(1, s["layers"]):  # H-wide q/k/v and no hidden_norm above layer 0
        p = f"upper_layers.{i - 1}."
        w.update(
            {
                p + "self_attn.q_proj.weight": lin(nh * d, H),
                p + "self_attn.k_proj.weight": lin(nkv * d, H),
                p + "self_attn.v_proj.weight": lin(nkv * d, H),
                p + "self_attn.o_proj.weight": lin(H, nh * d),
                p + "mlp.gate_proj.weight": lin(inter, H),
                p + "mlp.up_proj.weight": lin(inter, H),
                p + "mlp.down_proj.weight": lin(H, inter),
                p + "input_layernorm.weight": norm(H),
                p + "post_attention_layernorm.weight": norm(H),
            }
        )
        if s["qk_norm"]:
            w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(d), norm(d)
    if s["vocab_map"]:
        w["d2t"], w["t2d"] = random_vocab(gen, s["Vd"])
    if s["embed"] == "target":
        w["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    elif s["embed"] == "own":
        w["embed_tokens.weight"] = torch.randn(V, H, generator=gen)
    return w


def layer_fields(s):
    c = {
        "hidden_size": s["H"],
        "intermediate_size": s["I"],
        "num_attention_heads": s["nh"],
        "num_key_value_heads": s["nkv"],
        "num_hidden_layers": s["layers"],
        "vocab_size": V,
        "rms_norm_eps": s["eps"],
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    if s["theta"] is not None:
        c["rope_theta"] = s["theta"]
    if s["linear"] != 1.0:
        c["rope_scaling"] = {"type": "linear", "factor": s["linear"]}
    if s["head_dim_field"]:
        c["head_dim"] = s["d"]
    return c


def external_config(s):
    if s["layout"] == "eagle":
        c = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **layer_fields(s)}
        c["draft_vocab_size"] = s["Vd"]
        if s["Ht"] != s["H"]:
            c["target_hidden_size"] = s["Ht"]
        if s["fc_norm"]:
            c["fc_norm"] = True
        if s["taps"] is not None:
            c["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in s["taps"]]}
        return c
    layer = {"model_type": s["layer_type"], **layer_fields(s)}
    c = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.4.0.1",
        "draft_vocab_size": s["Vd"],
        "target_hidden_size": None if s["Ht"] == s["H"] else s["Ht"],
        "eagle_aux_hidden_state_layer_ids": s["taps"],
        "embed_requires_grad": False,
        "norm_before_residual": s["nbr"],
        "norm_before_fc": s["norm_before_fc"],
        "fc_norm": s["fc_norm"],
        "norm_output": s["norm_output"],
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]},
        },
    }
    return c


def write_checkpoint(folder, config, weights, s):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    stored = {}
    for key, tensor in weights.items():
        if s["layout"] == "speculators" and key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer.") :]
        elif s["layout"] == "speculators" and key.startswith("upper_layers."):  # layers.{i} is upper_layers.{i-1}
            index, rest = key[len("upper_layers.") :].split(".", 1)
            key = f"layers.{int(index) + 1}.{rest}"
        stored[s["prefix"] + key] = tensor.contiguous()
    if s["fmt"] == "bin":
        torch.save(stored, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(stored, os.path.join(folder, "model.safetensors"))
    return str(folder)


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


def randomized_draft(target, **config_overrides):
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=VD, **config_overrides)
    # The identity a speculators export names (an in-memory target records none).
    draft.config.target_name_or_path = draft.config.target_name_or_path or "tiny/target"
    draft.config.target_architectures = draft.config.target_architectures or [type(target).__name__]
    gen = torch.Generator().manual_seed(3)
    draft.set_draft_vocab(*random_vocab(gen))
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return draft


def assert_same_draft(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
    for field in STRUCTURAL_FIELDS:
        assert getattr(a.config, field) == getattr(b.config, field), field


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
