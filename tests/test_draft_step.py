"""The decoding-time draft forward (the model's forward over a `DraftKV` buffer, `draft_forward`) against
`Eagle3DraftModel.forward` with a cache, and against the parallel forward decoding used to have, for one row and several."""

import pytest
import torch
from helpers.masks import causal_block
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.generation.draft_step import DraftKV, DraftKVAttention, _attend, draft_forward
from eagle3_hf.generation.drafting import top_children

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=200,
)
TARGETS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen3-qk-norm": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=16)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE)),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, head_dim=16, query_pre_attn_scalar=16)),
}


def step(draft, kv, ids, hidden, positions, slot, mask):
    """`draft_forward` for one row, with the head over every position: (logits `[S, Vd]`, fed-back state)."""
    normed, feedback = draft_forward(draft, kv, ids, hidden, positions[None], slot, mask)
    return draft.lm_head(normed)[0], feedback


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("llama", {}),
        ("qwen3-qk-norm", {}),
        ("mistral", {}),
        ("gemma3", {}),
        ("llama", dict(norm_output=True, norm_before_residual=True, fc_norm=True)),
        ("llama", dict(num_hidden_layers=2)),
        ("gemma3", dict(num_hidden_layers=3)),
    ],
    ids=["llama", "qwen3-qk-norm", "mistral", "gemma3", "llama-eagle3.1-flags", "llama-2-layers", "gemma3-3-layers"],
)
def test_draft_forward_matches_the_model_forward(family, overrides):
    torch.manual_seed(0)
    target = TARGETS[family]().eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=50, **overrides).eval()
    ids = torch.randint(3, 200, (1, 7))
    with torch.no_grad():
        features = draft.target_features(target(ids, output_hidden_states=True).hidden_states)
        # the verified prefix: 7 positions, causal
        ref = draft(ids, target_hidden_states=features, use_cache=True)
        kv = DraftKV(draft, capacity=4)  # too small on purpose: the buffer must grow
        logits, hidden = step(
            draft, kv, ids, draft.fuse(features), torch.arange(7), 0, causal_block(0, 7, torch.float32, ids.device)
        )
        torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden, ref.last_hidden_state, rtol=1e-4, atol=1e-5)
        kv.length = 7
        # two tree levels at position 7 and 8: three nodes fed back from the last state, then two children of
        # nodes 0 and 2, each seeing the prefix, its ancestors and itself (the model forward gets the same 4D mask)
        level1 = torch.randint(3, 200, (1, 3))
        allowed1 = torch.cat([torch.ones(3, 7, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], dim=1)
        ref1 = draft(
            level1,
            hidden_states=ref.last_hidden_state[:, -1:].expand(1, 3, -1),
            position_ids=torch.full((1, 3), 7),
            attention_mask=allowed1[None, None],
            cache=ref.cache,
        )
        logits1, hidden1 = step(
            draft, kv, level1, hidden[:, -1:].expand(1, 3, -1), torch.full((3,), 7), 7, _additive(allowed1)
        )
        torch.testing.assert_close(logits1, ref1.logits[0], rtol=1e-4, atol=1e-5)
        level2 = torch.randint(3, 200, (1, 2))
        tree2 = torch.tensor([[1, 0, 0, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)  # [nodes 0..2 | new 0..1]
        allowed2 = torch.cat([torch.ones(2, 7, dtype=torch.bool), tree2], dim=1)
        ref2 = draft(
            level2,
            hidden_states=ref1.last_hidden_state[:, [0, 2]],
            position_ids=torch.full((1, 2), 8),
            attention_mask=allowed2[None, None],
            cache=ref1.cache,
        )
        logits2, hidden2 = step(draft, kv, level2, hidden1[:, [0, 2]], torch.full((2,), 8), 10, _additive(allowed2))
        torch.testing.assert_close(logits2, ref2.logits[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hidden2, ref2.last_hidden_state, rtol=1e-4, atol=1e-5)
    assert kv.capacity >= 12 and kv.length == 7  # the tree's slots are scratch: the verified length is unchanged
    assert kv.keys.shape[0] == draft.config.num_hidden_layers and len(ref2.cache.layers) == kv.keys.shape[0]
    for layer in range(kv.keys.shape[0]):  # every layer's keys sit at the same slots as the model cache's entry
        torch.testing.assert_close(kv.keys[layer, :, :, :12], ref2.cache.layers[layer].keys, rtol=1e-4, atol=1e-5)


def small_kv(capacity, num_hidden_layers=1):
    """An empty `DraftKV` of `capacity` slots for a llama draft of `num_hidden_layers` layers (2 kv heads of 16)."""
    draft = Eagle3DraftModel.from_target(TARGETS["llama"](), draft_vocab_size=50, num_hidden_layers=num_hidden_layers)
    return DraftKV(draft, capacity=capacity)


def test_draft_kv_keeps_its_content_when_it_grows():
    kv = small_kv(capacity=2)
    first = torch.arange(64.0).view(1, 2, 2, 16)
    kv.write(0, first, -first)
    second = torch.full((1, 2, 3, 16), 7.0)
    keys, values = kv.write(2, second, second)
    assert kv.capacity == 5 and keys.shape == (1, 2, 5, 16)
    assert torch.equal(keys[:, :, :2], first) and torch.equal(values[:, :, :2], -first)
    assert torch.equal(keys[:, :, 2:], second)


def test_draft_kv_layers_share_slots_and_grow_together():
    kv = small_kv(capacity=2, num_hidden_layers=3)
    for layer in range(3):
        kv.write(0, torch.full((1, 2, 2, 16), float(layer)), torch.full((1, 2, 2, 16), -float(layer)), layer)
    keys, _ = kv.write(1, torch.full((1, 2, 3, 16), 9.0), torch.full((1, 2, 3, 16), 9.0), 1)  # grows all
    assert kv.capacity == 4 and keys.shape == (1, 2, 4, 16) and kv.keys.shape == (3, 1, 2, 4, 16)
    assert torch.equal(keys[:, :, 0], torch.full((1, 2, 16), 1.0)) and (keys[:, :, 1:] == 9).all()
    for layer in (0, 2):  # the other layers kept their content through the growth
        assert (kv.keys[layer, :, :, :2] == layer).all() and (kv.values[layer, :, :, :2] == -layer).all()


def test_top_children_are_the_best_log_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(3, 40).to(torch.bfloat16)
    ids, logp = top_children(logits, 4)
    expected = torch.log_softmax(logits.float(), dim=-1).topk(4, dim=-1)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(logp, expected.values)


def test_rows_of_a_batch_compute_what_each_row_alone_does():
    """Two rows with other prefixes and holes (a masked column): each row's output is its own forward's."""
    torch.manual_seed(0)
    target = TARGETS["llama"]().eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=50).eval()
    ids = torch.randint(3, 200, (2, 6))
    with torch.no_grad():
        hidden = draft.fuse(draft.target_features(target(ids, output_hidden_states=True).hidden_states))
        allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
        allowed[1, :, 0] = False  # row 1's first column is a hole (left padding) ...
        allowed[1, 0, 0] = True  # ... which sees only itself
        positions = torch.stack([torch.arange(6), (torch.arange(6) - 1).clamp(min=0)])
        kv = DraftKV(draft, rows=2)
        normed, feedback = draft_forward(draft, kv, ids, hidden, positions, 0, _additive(allowed))
        for row, start in ((0, 0), (1, 1)):
            alone = DraftKV(draft)
            own, own_feedback = draft_forward(
                draft,
                alone,
                ids[row : row + 1, start:],
                hidden[row : row + 1, start:],
                torch.arange(6 - start)[None],
                0,
                causal_block(0, 6 - start, torch.float32, ids.device),
            )
            torch.testing.assert_close(normed[row, start:], own[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(feedback[row, start:], own_feedback[0], rtol=1e-4, atol=1e-5)
    kv.select_rows(torch.tensor([1]))
    assert kv.keys.shape[1] == 1
    with pytest.raises(ValueError, match="rows >= 1"):
        DraftKV(draft, rows=0)


def _former_draft_forward(draft, kv, input_ids, hidden, positions, slot, mask):
    """The decoding forward as generation/draft_step.py wrote it out beside the model's (before #49 item 1)."""
    embeds = draft.embed_tokens(input_ids).to(hidden.dtype)
    rotary = draft.rotary_emb(hidden, positions)
    out = hidden
    for index, layer in enumerate(draft.draft_layers()):
        attn = layer.self_attn
        x, residual = layer.layer_input(embeds, out)
        q, k, v = layer.qkv(x, rotary)
        keys, values = kv.write(slot, k, v, index)
        attended = _attend(q, keys, values, mask, attn.scaling, getattr(attn, "attn_logit_softcapping", None))
        out = layer.finish(residual, attn.o_proj(attended.transpose(1, 2).reshape(*q.shape[:1], q.shape[2], -1)))
    normed = draft.norm(out)
    return normed, normed if draft.config.norm_output else out


@pytest.mark.parametrize("family, layers", [("llama", 1), ("llama", 2), ("gemma3", 3), ("qwen3-qk-norm", 2)])
def test_the_model_forward_with_the_decoding_attention_is_the_former_decoding_forward(family, layers):
    """Bit for bit (fp32): two rows with holes, a prefix then a tree level over the buffer."""
    torch.manual_seed(0)
    target = TARGETS[family]().eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=50, num_hidden_layers=layers).eval()
    ids = torch.randint(3, 200, (2, 6))
    with torch.no_grad():
        hidden = draft.fuse(draft.target_features(target(ids, output_hidden_states=True).hidden_states))
        allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
        allowed[1, :, :2] = False  # row 1's first two columns are holes, which see only themselves
        allowed[1, 0, 0] = allowed[1, 1, 1] = True
        positions = torch.stack([torch.arange(6), (torch.arange(6) - 2).clamp(min=0)])
        level = torch.randint(3, 200, (2, 3))
        tree = torch.cat([allowed[:, -1:].expand(2, 3, 6), torch.eye(3, dtype=torch.bool).expand(2, 3, 3)], dim=2)
        results = []
        for run in ("model", "former"):
            kv = DraftKV(draft, capacity=4, rows=2)
            steps = [
                (ids, hidden, positions, 0, _additive(allowed)),
                (level, None, positions[:, -1:].expand(2, 3) + 1, 6, _additive(tree)),
            ]
            outs = []
            for tokens, state, pos, slot, mask in steps:
                state = outs[-1][1][:, -1:].expand(2, 3, -1) if state is None else state
                if run == "model":
                    attention = DraftKVAttention(kv, slot)
                    out = draft(
                        tokens,
                        hidden_states=state,
                        position_ids=pos,
                        attention_mask=mask,
                        attention=attention,
                        skip_logits=True,
                    )
                    assert out.logits is None
                    outs.append((out.normed_hidden_state, out.last_hidden_state))
                else:
                    outs.append(_former_draft_forward(draft, kv, tokens, state, pos, slot, mask))
            results.append((outs, kv.keys[:, :, :, :9].clone(), kv.values[:, :, :, :9].clone()))
    (model_outs, model_keys, model_values), (former_outs, former_keys, former_values) = results
    for (normed, feedback), (former_normed, former_feedback) in zip(model_outs, former_outs):
        assert torch.equal(normed, former_normed) and torch.equal(feedback, former_feedback)
    assert torch.equal(model_keys, former_keys) and torch.equal(model_values, former_values)
    assert model_keys.shape[0] == layers and model_keys.abs().sum() > 0
    with pytest.raises(ValueError, match="not both"):
        draft(ids, hidden_states=hidden, attention=DraftKVAttention(kv, 0), use_cache=True)
