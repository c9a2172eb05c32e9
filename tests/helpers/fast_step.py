"""A target and draft pair and a batch for the fused training step's tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel

V = 96

METRICS = ("step_correct", "step_supervised", "step_in_vocab")


def make_pair(num_hidden_layers: int = 1):
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=V,
        )
    )
    target.eval()
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40, num_hidden_layers=num_hidden_layers)
    with torch.no_grad():  # move every weight off its init so that each one matters
        for name, param in draft.named_parameters():
            if name != "embed_tokens.weight":
                param.add_(torch.randn_like(param) * 0.2)
    return target, draft.train()


def make_batch(target, draft):
    """Two padded rows (12 and 9 tokens), supervised on a prompt-free tail, with out-of-vocabulary targets."""
    torch.manual_seed(1)
    ids = torch.randint(0, V, (2, 12))
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, 9:] = 0
    with torch.no_grad():
        out = target(ids, attention_mask=attention, output_hidden_states=True)
    loss_mask = torch.zeros(2, 12)
    loss_mask[0, 3:] = 1
    loss_mask[1, 5:9] = 1
    assert not draft.t2d[out.logits.argmax(-1)[loss_mask.bool()]].all()  # some positions carry no loss
    return ids, attention, loss_mask, draft.target_features(out.hidden_states), out.logits
