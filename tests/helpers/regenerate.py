"""A tiny Llama over SmolLM2's vocabulary, ShareGPT-style conversations, and a generate() that counts its calls."""

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def tiny_llama(tokenizer_dir, num_hidden_layers=2):
    """A tiny random Llama over SmolLM2's full vocabulary; large init so that its greedy choices are clear-cut."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        initializer_range=0.5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).eval()


def conversations(n=5):
    """Prompts of different lengths; some have two user turns, one has a system prompt and a trailing question."""
    records = []
    for i in range(n):
        turns = [
            {"from": "human", "value": "Tell me about the number " + "seven " * (i + 1)},
            {"from": "gpt", "value": "An old answer that must be replaced."},
        ]
        if i % 2:
            turns += [{"from": "human", "value": f"And {i}?"}, {"from": "gpt", "value": "Also replaced."}]
        if i == 4:
            turns = [{"from": "system", "value": "Answer briefly."}, *turns, {"from": "human", "value": "Why?"}]
        records.append({"id": f"conv-{i}", "conversations": turns})
    return records


class CountingGenerate:
    """Wraps model.generate to record how many prompts each call received, optionally failing on a given call."""

    def __init__(self, model, fail_on_call=None):
        self.generate, self.fail_on_call, self.batch_sizes, self.prompt_lengths = model.generate, fail_on_call, [], []

    def __call__(self, *args, **kwargs):
        if self.fail_on_call is not None and len(self.batch_sizes) == self.fail_on_call:
            raise RuntimeError("killed")
        self.batch_sizes.append(kwargs["input_ids"].shape[0])
        self.prompt_lengths.append(kwargs["attention_mask"].sum(dim=1).tolist())
        # Left padding: every prompt ends at the last column, so new tokens follow it directly.
        assert kwargs["attention_mask"][:, -1].all()
        return self.generate(*args, **kwargs)
