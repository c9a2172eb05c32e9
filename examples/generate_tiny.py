"""EAGLE-3 tree decoding with a tiny random target and an untrained draft, on CPU, in seconds.

The output equals plain greedy generate token for token, whatever the draft proposes.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel, bind_target

torch.manual_seed(0)
target = LlamaForCausalLM(
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
    )
).eval()
draft = bind_target(Eagle3DraftModel.from_target(target).eval(), target)  # bound to `target`

ids = torch.randint(3, 32, (1, 8))
out = target.generate(
    ids,
    assistant_model=draft,
    max_new_tokens=40,
    do_sample=False,
    return_dict_in_generate=True,
    attention_mask=torch.ones_like(ids),
)
plain = target.generate(ids, max_new_tokens=40, do_sample=False, attention_mask=torch.ones_like(ids))
print("identical to plain greedy:", torch.equal(out.sequences, plain))
print("accepted tokens per cycle:", out.accept_lengths)
