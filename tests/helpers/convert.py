"""The reference EAGLE-3 forward written from the published layouts, and checkpoints in each external layout."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel

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
