"""`--enable-thinking/--no-enable-thinking`: one setting, passed to the chat template by regenerate, training and
bench alike (`eagle3_hf.modeling.chat_template`), recorded where each run is recorded and checked against it."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers.cli_argv import argv
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf.bench.runner import read_prompts
from eagle3_hf.cli import build_subparser
from eagle3_hf.commands.bench import draft_thinking_mismatch
from eagle3_hf.commands.train import parse_cli, quick_help
from eagle3_hf.modeling import chat_template
from eagle3_hf.modeling.chat_template import apply_chat_template, has_thinking_switch
from eagle3_hf.training.data import build_dataset
from eagle3_hf.training.regenerate import MANIFEST_NAME, regenerate_responses
from eagle3_hf.training.tokenise import tokenise_data

# Qwen3-style: undefined -> the template's default (nothing), True -> an open think block, False -> an empty one,
# the same in the generation prompt and before each assistant answer (so that training can locate the answers).
THINKING_TEMPLATE = (
    "{%- set think = '' -%}"
    "{%- if enable_thinking is defined -%}{%- set think = '<think>' if enable_thinking else '<think></think>' -%}"
    "{%- endif -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{{ think }}{% endif %}"
    "{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{{ think }}{%- endif -%}"
)
PLAIN_TEMPLATE = (
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
# The text each setting puts after the assistant header.
OPENING = {None: "assistant\nHi", True: "assistant\n<think>Hi", False: "assistant\n<think></think>Hi"}
SETTINGS = [None, True, False]
CONVERSATION = [{"role": "user", "content": "What is two and two?"}, {"role": "assistant", "content": "Hi"}]


@pytest.fixture
def thinking_tokenizer(tokenizer):
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def think_part(text: str) -> str:
    """What sits between the last assistant header and the answer or the end of the prompt."""
    return text.rsplit("assistant\n", 1)[1].split("Hi")[0]


@pytest.mark.parametrize("setting", SETTINGS)
def test_helper_passes_the_setting_only_when_given(thinking_tokenizer, setting):
    assert has_thinking_switch(thinking_tokenizer)
    text = apply_chat_template(
        thinking_tokenizer, CONVERSATION[:1], enable_thinking=setting, tokenize=False, add_generation_prompt=True
    )
    assert text.endswith(
        {None: "assistant\n", True: "assistant\n<think>", False: "assistant\n<think></think>"}[setting]
    )


@pytest.mark.parametrize("setting", SETTINGS)
def test_training_renders_with_the_setting(thinking_tokenizer, setting):
    dataset, _ = build_dataset(
        [{"messages": CONVERSATION}], thinking_tokenizer, max_length=256, enable_thinking=setting
    )
    ids, mask = dataset[0]["input_ids"], dataset[0]["loss_mask"]
    text = thinking_tokenizer.decode(ids)
    assert OPENING[setting] in text and text.count("<think>") == (setting is not None)
    # The think block is the template's, not the target's answer: only "Hi" and its end-of-turn are supervised.
    assert thinking_tokenizer.decode([i for i, m in zip(ids, mask) if m]) == "Hi<|im_end|>"


@pytest.mark.parametrize("setting", SETTINGS)
def test_regenerate_prompts_use_the_setting_and_the_manifest_records_it(
    thinking_tokenizer, tmp_path, monkeypatch, setting
):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(thinking_tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=thinking_tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    prompts, generate = [], model.generate

    def spy(*args, **kwargs):
        prompts.extend(thinking_tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=False))
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    regenerate_responses(
        model, thinking_tokenizer, [{"messages": CONVERSATION[:1]}], tmp_path, max_new_tokens=2, enable_thinking=setting
    )
    assert len(prompts) == 1 and think_part(prompts[0] + "Hi") == think_part(OPENING[setting])
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["enable_thinking"] == setting
    # The same folder with another setting holds answers to other prompts: refused.
    other = setting is not True  # another setting than this one
    with pytest.raises(ValueError, match="enable_thinking"):
        regenerate_responses(
            model,
            thinking_tokenizer,
            [{"messages": CONVERSATION[:1]}],
            tmp_path,
            max_new_tokens=2,
            enable_thinking=other,
        )


@pytest.mark.parametrize("setting", SETTINGS)
def test_bench_prompts_use_the_setting(thinking_tokenizer, tmp_path, setting):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "What is two and two?"}) + "\n")
    (ids,) = read_prompts(str(path), thinking_tokenizer, None, enable_thinking=setting)
    assert think_part(thinking_tokenizer.decode(ids[0]) + "Hi") == think_part(OPENING[setting])


def test_training_warns_when_the_data_was_regenerated_with_another_setting(thinking_tokenizer, tmp_path, caplog):
    folder = tmp_path / "regen"
    folder.mkdir()
    (folder / MANIFEST_NAME).write_text(json.dumps({"format": 1, "enable_thinking": False}))
    (folder / "shard_00000.jsonl").write_text(json.dumps({"id": "a", "messages": CONVERSATION}) + "\n")
    with caplog.at_level(logging.WARNING):
        tokenise_data(thinking_tokenizer, str(folder), 256, enable_thinking=False)
    assert not [r for r in caplog.records if "regenerated" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        tokenise_data(thinking_tokenizer, str(folder), 256, enable_thinking=True)
    (warning,) = [r.getMessage() for r in caplog.records if "regenerated" in r.getMessage()]
    assert (
        "--no-enable-thinking" in warning
        and "renders them with --enable-thinking:" in warning
        and str(folder) in warning
    )


def test_bench_warns_when_the_draft_was_trained_with_another_setting():
    draft = SimpleNamespace(training_info={"enable_thinking": None})
    assert draft_thinking_mismatch(draft, None, "d") is None
    warning = draft_thinking_mismatch(draft, False, "d")
    assert "The draft d was trained with the template's default" in warning and "--no-enable-thinking" in warning
    draft.training_info = {"steps": 3}  # trained before the setting was recorded: nothing to compare
    assert draft_thinking_mismatch(draft, True, "d") is None


def test_a_template_without_a_switch_warns_once_and_renders_the_default(tokenizer, caplog, monkeypatch):
    tokenizer.chat_template = PLAIN_TEMPLATE
    monkeypatch.setattr(chat_template, "_warned", set())
    assert not has_thinking_switch(tokenizer)
    plain = apply_chat_template(tokenizer, CONVERSATION, tokenize=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert apply_chat_template(tokenizer, CONVERSATION, enable_thinking=True, tokenize=False) == plain
        assert apply_chat_template(tokenizer, CONVERSATION, enable_thinking=None, tokenize=False) == plain
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "--enable-thinking has no effect" in warning and tokenizer.name_or_path in warning


@pytest.mark.parametrize("command", ["regenerate", "bench", "features", "vocab", "evaluate", "corpus", "generate"])
def test_cli_flags(command):
    parser = build_subparser(command)
    required = {
        "regenerate": ["--target", "t", "--data", "d", "--output", "o"],
        "features": ["--target", "t", "--data", "d", "--output", "o"],
        "vocab": ["--target", "t", "--data", "d", "--output", "o"],
        "evaluate": ["--draft", "x", "--target", "t", "--data", "d"],
        "corpus": ["--target", "t", "--data", "d", "--output", "o"],
    }.get(command, [])
    assert parser.parse_args(required).enable_thinking is None
    assert parser.parse_args([*required, "--enable-thinking"]).enable_thinking is True
    assert parser.parse_args([*required, "--no-enable-thinking"]).enable_thinking is False
    assert "--enable-thinking, --no-enable-thinking" in parser.format_help()


def test_train_cli_flags():
    base = ["--target", "smollm2", "--data", "d", "--output-dir", "o"]
    assert parse_cli(base).enable_thinking is None
    assert parse_cli([*base, "--enable-thinking"]).enable_thinking is True
    assert parse_cli([*base, "--enable-thinking", "false"]).enable_thinking is False
    assert parse_cli([*base, "--no-enable-thinking"]).enable_thinking is False
    assert "--enable-thinking" in quick_help() and "--no-enable-thinking" in quick_help()


def test_train_refuses_the_flag_with_offline_features(tmp_path):
    from eagle3_hf.commands.train_checks import check_train_arguments

    args = parse_cli(
        ["--target", "smollm2", "--features", "f", "--output-dir", str(tmp_path / "o"), "--no-enable-thinking"]
    )
    with pytest.raises(ValueError, match="--no-enable-thinking sets how train renders --data"):
        check_train_arguments(args)


def test_train_command_records_the_setting(chat_target, tmp_path):
    from eagle3_hf.cli import main as cli_main

    folder, data = chat_target
    out = tmp_path / "run"
    assert (
        cli_main(
            argv(
                "train",
                target=folder,
                data=data,
                max_steps=1,
                ttt_length=1,
                draft_vocab_size=40,
                output=out,
                no_enable_thinking=True,
            )
        )
        == 0
    )
    assert json.loads((out / "training_info.json").read_text())["enable_thinking"] is False


def test_offline_features_record_the_setting_and_train_takes_it(chat_target, tmp_path):
    from eagle3_hf.cli import main as cli_main
    from eagle3_hf.commands.train import _thinking_info

    folder, data = chat_target
    features = tmp_path / "features"
    assert (
        cli_main(argv("features", target=folder, data=data, output=features, no_enable_thinking=True, logits_top_k=8))
        == 0
    )
    assert json.loads((features / "features.json").read_text())["enable_thinking"] is False
    out = tmp_path / "run"
    assert (
        cli_main(
            argv("train", target=folder, features=features, max_steps=1, ttt_length=1, draft_vocab_size=40, output=out)
        )
        == 0
    )
    assert json.loads((out / "training_info.json").read_text())["enable_thinking"] is False
    # folders that disagree, or one written before the setting was recorded: nothing is recorded
    for manifests in ([{"enable_thinking": True}, {"enable_thinking": None}], [{"enable_thinking": None}, {}]):
        assert _thinking_info(SimpleNamespace(), SimpleNamespace(manifests=manifests), offline=True) == {}
