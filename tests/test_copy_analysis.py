"""scripts/research/copy_analysis.py: the bigram lookup's sources and the step-0 attention it profiles."""

import importlib.util
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.training.ttt import ttt_forward
from eagle3_hf.training.ttt_layer import repeat_kv

_spec = importlib.util.spec_from_file_location(
    "copy_analysis", pathlib.Path(__file__).parents[1] / "scripts" / "research" / "copy_analysis.py"
)
copy_analysis = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(copy_analysis)


def test_bigram_sources_point_at_the_latest_earlier_occurrence():
    #          0  1  2  3  4  5  6  7  8
    tokens = [5, 6, 7, 5, 6, 8, 5, 6, 9]
    sources = copy_analysis.bigram_sources(tokens, 8)
    # (5, 6) at t=3 occurred as (x_0, x_1): source 1, guess x_2 = 7; at t=6 the latest is (x_3, x_4): source 4, guess 8.
    assert sources == [None, None, None, 1, None, None, 4, None]


def test_step0_attention_reproduces_the_first_layer():
    """Weights from `step0_attention`, applied to the layer's values, give what `ttt_forward` computes at step 0
    (with a padded row), so the profile describes the attention the draft trains and drafts with."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
        )
    ).eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40).eval()
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(torch.randn_like(param) * 0.2)
    ids = torch.randint(0, 96, (2, 10))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[1, 7:] = 0
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
        probs = copy_analysis.step0_attention(draft, ids, features, attention_mask)  # [B, h, S, S]
        expected = ttt_forward(draft, ids, features, attention_mask, 1, return_hidden=True)[0]
        layer = draft.draft_layers()[0]
        hidden = draft.fuse(features)
        embeds = draft.embed_tokens(torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1))
        x, residual = layer.layer_input(embeds, hidden)
        _, _, v = layer.qkv(x, draft.rotary_emb(hidden, torch.arange(10)[None].expand(2, 10)))
        out = torch.matmul(probs, repeat_kv(v, layer.self_attn.num_key_value_groups))  # [B, h, S, d]
        out = layer.self_attn.o_proj(out.transpose(1, 2).reshape(2, 10, -1))
        got = draft.norm(layer.finish(residual, out))
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 10))
    assert probs[:, :, 2, 3:].abs().max() == 0  # causal
    assert probs[1, :, 5, 7:].abs().max() == 0  # padding is never attended
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1, :7], expected[1, :7], rtol=1e-4, atol=1e-5)
