"""Target-derived initialisation: the head rows of exactly the draft ids, the final norm, optionally a layer."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.modeling.target_init import init_head_from_target, init_layer_from_target, remap_draft_vocab

torch.set_num_threads(1)


def make_target():
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
        )
    )
    with torch.no_grad():  # norms away from their all-ones init, so that a copy is visible
        for name, param in target.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param))
    return target.eval()


def draft_with_vocab(target, ids):
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=len(ids))
    ids = torch.tensor(sorted(ids))
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    draft.set_draft_vocab(ids - torch.arange(len(ids)), t2d)
    return draft


def test_head_rows_of_exactly_the_draft_ids_and_the_final_norm():
    target = make_target()
    ids = [3, 7, 8, 20, 41, 42, 60, 95]
    draft = draft_with_vocab(target, ids)
    assert init_head_from_target(draft, target) == ["lm_head.weight", "norm.weight"]
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    # So for one and the same final state, the draft's logits are the target's at the draft ids.
    state = torch.randn(2, 32)
    with torch.no_grad():
        torch.testing.assert_close(draft.lm_head(draft.norm(state)), target.lm_head(target.model.norm(state))[:, ids])
    # The vocabulary decides the rows: installed after the copy, another vocabulary would hold the wrong ones.
    other = draft_with_vocab(target, [0, 1, 2, 3, 4, 5, 6, 7])
    init_head_from_target(other, target)
    assert not torch.equal(other.lm_head.weight, draft.lm_head.weight)


def test_layer_copy_takes_mlp_o_proj_and_norms_not_the_wider_qkv():
    target = make_target()
    draft = draft_with_vocab(target, list(range(0, 96, 3)))
    q_before = draft.midlayer.self_attn.q_proj.weight.clone()
    copied = init_layer_from_target(draft, target)
    source = target.model.layers[-1]
    assert torch.equal(draft.midlayer.mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert torch.equal(draft.midlayer.mlp.gate_proj.weight, source.mlp.gate_proj.weight)
    assert torch.equal(draft.midlayer.self_attn.o_proj.weight, source.self_attn.o_proj.weight)
    assert torch.equal(draft.midlayer.hidden_norm.weight, source.input_layernorm.weight)
    assert torch.equal(draft.midlayer.post_attention_layernorm.weight, source.post_attention_layernorm.weight)
    assert torch.equal(draft.midlayer.self_attn.q_proj.weight, q_before)
    assert "midlayer.mlp.up_proj.weight" in copied and not any("q_proj" in name for name in copied)
    with pytest.raises(ValueError, match="layer_index"):
        init_layer_from_target(draft, target, layer_index=4)


def test_remap_keeps_the_logits_of_shared_tokens(tmp_path):
    target = make_target()
    old_ids = [3, 7, 8, 20, 41, 42, 60, 95]
    draft = draft_with_vocab(target, old_ids)
    with torch.no_grad():
        draft.lm_head.weight.normal_()  # a "trained" head, unlike the target's rows
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
        before = draft(ids, target_hidden_states=features).logits  # [1, 6, 8]
    new_ids = [1, 3, 8, 9, 41, 50, 60, 70, 80, 90, 95]  # larger; drops 7, 20 and 42; adds six
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[new_ids] = True
    assert remap_draft_vocab(draft, torch.tensor(new_ids) - torch.arange(11), t2d) == 5
    with torch.no_grad():
        after = draft(ids, target_hidden_states=features).logits  # [1, 6, 11]
    assert after.shape[-1] == 11 == draft.config.draft_vocab_size
    shared = [i for i in new_ids if i in old_ids]
    # The same head rows: equal up to the matmul's rounding, which on some CPUs (AVX2) depends on the head's width.
    torch.testing.assert_close(
        after[..., [new_ids.index(i) for i in shared]],
        before[..., [old_ids.index(i) for i in shared]],
        rtol=1e-6,
        atol=1e-6,
    )
    added = [new_ids.index(i) for i in new_ids if i not in old_ids]
    # New tokens start at a logit of 0: where the old top token is kept and its logit is positive, it stays on top.
    assert torch.equal(after[..., added], torch.zeros_like(after[..., added]))
    best_before = before.max(-1)
    top_before = torch.tensor(old_ids)[best_before.indices]  # [1, 6] target ids
    kept = (best_before.values > 0) & torch.isin(top_before, torch.tensor(new_ids))
    assert kept.any()
    assert torch.equal(torch.tensor(new_ids)[after.argmax(-1)][kept], top_before[kept])
    assert draft.draft_to_target_ids(torch.arange(11)).tolist() == new_ids
    draft.save_pretrained(tmp_path)
    reloaded = Eagle3DraftModel.from_pretrained(str(tmp_path), target=target)
    assert torch.equal(reloaded.d2t, draft.d2t) and torch.equal(reloaded.lm_head.weight, draft.lm_head.weight)
    with pytest.raises(ValueError, match="t2d"):
        remap_draft_vocab(draft, torch.zeros(3, dtype=torch.long), t2d)
