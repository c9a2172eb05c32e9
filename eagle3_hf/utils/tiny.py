"""Tiny random targets and data for tests and examples: the whole pipeline in seconds on a CPU.

`make_tiny_target` is a random 8-layer Llama whose head is sharpened so that its next-token choice is a clear
function of the context; `synthetic_dataset` holds arithmetic token sequences (a 4-token prompt, then supervised
"assistant" tokens); `write_tiny_chat_target` saves such a target with a small ChatML tokenizer as a plain folder, and
`tiny_sharegpt` gives ShareGPT records for it.
"""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["CHATML", "VOCAB", "make_tiny_target", "synthetic_dataset", "tiny_sharegpt", "write_tiny_chat_target"]

VOCAB = 64


def make_tiny_target(vocab_size: int = VOCAB, seed: int = 0) -> LlamaForCausalLM:
    """A random 8-layer Llama (hidden 32) with a sharpened head, in eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    target = LlamaForCausalLM(config)
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)  # logits with std ~3, so the target has clear preferences
    return target.eval()


def synthetic_dataset(
    num_rows: int = 32, seq_len: int = 24, vocab_size: int = VOCAB, prompt_len: int = 4, seed: int = 0
) -> Dataset:
    """Rows x_{t+1} = (x_t + d) mod V (d in 1..3) with ids 1..V-1; loss_mask 0 on the prompt, 1 after."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num_rows):
        start = int(torch.randint(1, vocab_size, (1,), generator=generator))
        step = int(torch.randint(1, 4, (1,), generator=generator))
        ids = [1 + (start + step * t) % (vocab_size - 1) for t in range(seq_len)]
        rows.append(
            {
                "id": str(i),
                "input_ids": ids,
                "loss_mask": [0] * prompt_len + [1] * (seq_len - prompt_len),
                "attention_mask": [1] * seq_len,
            }
        )
    return Dataset.from_list(rows)


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def tiny_sharegpt(num: int = 12) -> list[dict]:
    """ShareGPT records about small sums: "what is two plus three?" -> "two plus three is five."."""
    records = []
    for i in range(num):
        a, b = i % 5, (2 * i + 1) % 5
        question = f"what is {_WORDS[a]} plus {_WORDS[b]}?"
        answer = f"{_WORDS[a]} plus {_WORDS[b]} is {_WORDS[a + b]}. anything else?"
        records.append(
            {
                "id": f"sum-{i}",
                "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
            }
        )
    return records


def write_tiny_chat_target(folder: str) -> str:
    """Save a tiny random Llama and a small byte-level BPE tokenizer with a ChatML template as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [t["value"] for r in tiny_sharegpt(50) for t in r["conversations"]] + ["user assistant system"]
    tokenizer.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    target = make_tiny_target(vocab_size=len(fast))
    target.config.pad_token_id = fast.pad_token_id
    target.save_pretrained(folder)
    return folder
