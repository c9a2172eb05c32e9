"""A tiny target saved as a folder for the benchmark's tests."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def _tiny_target(vocab=24):
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=vocab,
            eos_token_id=None,
            bos_token_id=None,
        )
    ).eval()
