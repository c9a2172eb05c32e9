"""Deeper drafts: growing a trained draft by identity layers, and what depends on the number of layers."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.modeling.depth import grow_draft_layers
from eagle3_hf.modeling.model_card import build_model_card
from eagle3_hf.training.distributed import fsdp_memory_per_process, parameter_bytes

V = 96
SHAPE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()


def trained_draft(target, **overrides):
    """A draft whose weights are all away from their init, over a 40-id vocabulary that is not the identity."""
    torch.manual_seed(1)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40, **overrides)
    used = torch.randperm(V)[:40].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    draft.set_draft_vocab(used - torch.arange(40), t2d)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(torch.randn_like(param) * 0.2)
    draft.training_info = {"steps": 7}
    return draft.eval()


def logits_of(draft, target, ids):
    """Logits of a prefill and of two fed-back steps through the cache (all layers' cache entries in use)."""
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
        first = draft(ids, target_hidden_states=features.to(draft.fc.weight.dtype), use_cache=True)
        out, steps = first, [first.logits]
        for i in range(2):
            out = draft(ids[:, i : i + 1], hidden_states=out.last_hidden_state[:, -1:], cache=out.cache)
            steps.append(out.logits)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(num_hidden_layers=2, norm_before_residual=True, attention_bias=True)],
    ids=["from-1", "from-2-with-biases"],
)
def test_grown_draft_computes_what_the_old_one_did(target, overrides):
    old = trained_draft(target, **overrides)
    depth = old.config.num_hidden_layers
    before = {k: v.clone() for k, v in old.state_dict().items()}
    grown = grow_draft_layers(old, depth + 2)
    assert grown is not old and grown.config.num_hidden_layers == depth + 2 and len(grown.upper_layers) == depth + 1
    assert old.config.num_hidden_layers == depth and all(torch.equal(v, before[k]) for k, v in old.state_dict().items())
    state = grown.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())  # every old weight and d2t/t2d, same names
    assert grown.embedding_loaded and grown.training_info == {"steps": 7}
    assert grown.training_info is not old.training_info  # a copy: recording the grown draft's training leaves it
    assert not grown.embed_tokens.weight.requires_grad and grown.upper_layers[-1].mlp.up_proj.weight.requires_grad
    for layer in grown.upper_layers[depth - 1 :]:  # the new ones: identity, their other weights as initialised
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert all(not p.any() for p in projection.parameters())
        assert layer.self_attn.q_proj.weight.std() > 0.01 and torch.equal(layer.input_layernorm.weight, torch.ones(32))
    ids = torch.randint(0, V, (1, 6))
    assert torch.equal(logits_of(grown, target, ids), logits_of(old, target, ids))


def test_new_layers_get_gradients_to_leave_the_identity(target):
    grown = grow_draft_layers(trained_draft(target), 2).train()
    ids = torch.randint(0, V, (1, 6))
    features = grown.target_features(target(ids, output_hidden_states=True).hidden_states).detach()
    grown(ids, target_hidden_states=features).logits.logsumexp(-1).sum().backward()
    layer = grown.upper_layers[0]
    # Zero projections still get gradients (their inputs are not zero); the layer's inner weights start moving once
    # they have, which is why o_proj and down_proj, not q/k/v or the MLP's input side, are the ones set to zero.
    assert layer.self_attn.o_proj.weight.grad.abs().sum() > 0 and layer.mlp.down_proj.weight.grad.abs().sum() > 0
    assert not layer.self_attn.q_proj.weight.grad.any() and not layer.mlp.up_proj.weight.grad.any()


def test_grow_keeps_dtype_and_device_and_refuses_to_shrink(target):
    old = trained_draft(target, num_hidden_layers=2).to(torch.bfloat16)
    grown = grow_draft_layers(old, 3)
    assert {p.dtype for p in grown.parameters()} == {torch.bfloat16} and grown.d2t.dtype == torch.long
    assert grown.fc.weight.device == old.fc.weight.device
    ids = torch.randint(0, V, (1, 5))
    assert torch.equal(logits_of(grown, target, ids), logits_of(old, target, ids))
    same = grow_draft_layers(old, 2)
    assert same is not old and same.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match=r"Cannot shrink a draft of 2 decoder layers to num_hidden_layers=1"):
        grow_draft_layers(old, 1)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"num_hidden_layers must be an integer >= 1, got {bad!r}"):
            grow_draft_layers(old, bad)


def test_fsdp_memory_counts_each_layer_as_a_unit(target):
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40, num_hidden_layers=3)
    units = [draft.embed_tokens, draft.midlayer, *draft.upper_layers]
    rest = parameter_bytes(draft)[1] - sum(parameter_bytes(m)[1] for m in (*units, draft.lm_head))
    largest = max(parameter_bytes(m)[1] for m in units)
    # Gathered at once: the root's own weights and the head, plus one embedding or decoder layer at a time.
    expected = rest + parameter_bytes(draft.lm_head)[1] + largest
    assert fsdp_memory_per_process(None, draft, 2)["gathered"] == expected


def test_model_card_states_the_depth(target):
    draft = Eagle3DraftModel.from_target(target, num_hidden_layers=2)
    assert "| draft decoder layers | 2 |" in build_model_card(draft.config).text
    legacy = {k: v for k, v in draft.config.to_dict().items() if k != "num_hidden_layers"}  # written before depth
    assert "| draft decoder layers | 1 |" in build_model_card(legacy).text


def test_bf16_prepacking_covers_every_layer(target):
    from helpers.masks import causal_block
    from torch import nn

    from eagle3_hf.generation.draft_step import DraftKV, draft_forward
    from eagle3_hf.modeling.packed_linear import PackedLinear, can_prepack, prepack_linears

    draft = trained_draft(target, num_hidden_layers=2).to(torch.bfloat16)
    ids = torch.randint(0, V, (1, 5))
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states).to(torch.bfloat16)

        def decode_step():
            mask = causal_block(0, 5, torch.bfloat16, ids.device)
            return draft_forward(draft, DraftKV(draft), ids, draft.fuse(features), torch.arange(5)[None], 0, mask)

        before = decode_step()
        replaced = prepack_linears(draft)
        if not can_prepack(nn.Linear(2, 2, bias=False).to(torch.bfloat16)) or replaced == 0:
            pytest.skip("this torch build or CPU cannot prepack bf16 linears exactly")
        after = decode_step()
    # fc, lm_head and the seven projections of each of the two layers
    assert replaced == 2 + 7 * 2
    assert not any(type(m) is nn.Linear for m in draft.upper_layers[0].modules())
    assert isinstance(draft.upper_layers[0].mlp.down_proj, PackedLinear)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_target_layer_init_fills_the_first_layer_of_a_deeper_draft(target):
    from eagle3_hf.modeling.target_init import init_layer_from_target

    draft = Eagle3DraftModel.from_target(target, num_hidden_layers=2)
    upper = {k: v.clone() for k, v in draft.upper_layers.state_dict().items()}
    copied = init_layer_from_target(draft, target)
    assert "midlayer.mlp.down_proj.weight" in copied and not any(name.startswith("upper_") for name in copied)
    assert torch.equal(draft.midlayer.mlp.down_proj.weight, target.model.layers[-1].mlp.down_proj.weight)
    assert all(torch.equal(v, upper[k]) for k, v in draft.upper_layers.state_dict().items())  # left at their init
