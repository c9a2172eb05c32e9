import argparse
import json
import os

import pytest
import torch
from helpers.regenerate import CountingGenerate, conversations, tiny_llama

from eagle3_hf.training.data import read_conversations
from eagle3_hf.training.regenerate import MANIFEST_NAME, list_shards, prompt_rounds, regenerate_responses

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model(tokenizer_dir):
    return tiny_llama(tokenizer_dir)


def by_id(output_dir):
    return {c["id"]: c["messages"] for c in read_conversations(output_dir)}


def run(model, tokenizer, records, output_dir, **kwargs):
    options = {"batch_size": 2, "max_new_tokens": MAX_NEW_TOKENS, "shard_size": 2, **kwargs}
    return regenerate_responses(model, tokenizer, records, output_dir, **options)


def test_prompt_rounds():
    s, u1, a1, u2, a2 = (
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
    )
    assert prompt_rounds([s, u1, a1, u2, a2]) == [[s, u1], [u2]]
    assert prompt_rounds([a1, u1, a2]) == [[u1]]  # an assistant greeting before any question is dropped
    assert prompt_rounds([s, a1, u1, u2]) == [[s, u1, u2]]  # trailing questions are answered too
    assert prompt_rounds([s, a1]) == [] and prompt_rounds([]) == []


def test_regenerates_every_assistant_turn_into_shards(model, tokenizer, tmp_path):
    records = conversations()
    paths = run(model, tokenizer, records, tmp_path)
    assert [os.path.basename(p) for p in paths] == ["shard_00000.jsonl", "shard_00001.jsonl", "shard_00002.jsonl"]
    assert list_shards(tmp_path) == paths
    with open(paths[0]) as f:
        first = [json.loads(line) for line in f]
    assert [r["id"] for r in first] == ["conv-0", "conv-1"]
    assert {t["from"] for r in first for t in r["conversations"]} == {"human", "gpt"}

    results = by_id(tmp_path)
    assert list(results) == [r["id"] for r in records]
    for record in records:
        messages = results[record["id"]]
        asked = [t["value"] for t in record["conversations"] if t["from"] != "gpt"]
        assert [m["content"] for m in messages if m["role"] != "assistant"] == asked
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(answers) == len(prompt_rounds(read_conversations([record])[0]["messages"]))
        assert "replaced" not in " ".join(answers)
        # A regenerated answer is the target's own greedy continuation of the prompt.
        prompt = tokenizer.apply_chat_template(
            messages[: messages.index(next(m for m in messages if m["role"] == "assistant"))],
            add_generation_prompt=True,
        )["input_ids"]
        expected = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        assert answers[0] == tokenizer.decode(expected[0, len(prompt) :], skip_special_tokens=True).strip()
    assert [m["role"] for m in results["conv-4"]] == ["system", "user", "assistant", "user", "assistant"]


def test_batching_does_not_change_greedy_answers(model, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(model, "generate", spy := CountingGenerate(model))
    one = run(model, tokenizer, conversations(), tmp_path / "one", batch_size=1, shard_size=5)
    first_round = [lengths[0] for lengths in spy.prompt_lengths[:5]]
    assert first_round == sorted(first_round) and len(set(first_round)) == 5  # shortest prompts first
    many = run(model, tokenizer, conversations(), tmp_path / "many", batch_size=5, shard_size=5)
    assert len(one) == len(many) == 1
    assert by_id(tmp_path / "one") == by_id(tmp_path / "many")


def test_resume_skips_finished_conversations_and_matches_one_run(model, tokenizer, tmp_path, monkeypatch):
    run(model, tokenizer, conversations(), tmp_path / "whole")

    resumed = tmp_path / "resumed"
    run(model, tokenizer, conversations()[:3], resumed)
    assert sorted(by_id(resumed)) == ["conv-0", "conv-1", "conv-2"]
    spy = CountingGenerate(model)
    monkeypatch.setattr(model, "generate", spy)
    paths = run(model, tokenizer, conversations(), resumed)
    # Only conv-3 (two rounds) and conv-4 (two rounds) were answered: 4 prompts, in 2 rounds of one batch each.
    assert spy.batch_sizes == [2, 2]
    assert len(paths) == 3
    assert by_id(resumed) == by_id(tmp_path / "whole")

    monkeypatch.setattr(model, "generate", spy := CountingGenerate(model))
    assert run(model, tokenizer, conversations(), resumed) == paths
    assert spy.batch_sizes == []


def test_killed_run_leaves_only_whole_shards(model, tokenizer, tmp_path, monkeypatch):
    run(model, tokenizer, conversations(), tmp_path / "whole")

    killed = tmp_path / "killed"
    # Shard 0 (conv-0 one round, conv-1 two rounds) takes 2 generate calls; die in the middle of shard 1.
    monkeypatch.setattr(model, "generate", CountingGenerate(model, fail_on_call=3))
    with pytest.raises(RuntimeError, match="killed"):
        run(model, tokenizer, conversations(), killed)
    assert sorted(os.listdir(killed)) == [MANIFEST_NAME, "shard_00000.jsonl"]
    # A half-written temporary shard, as a kill during the write would leave it, holds ids that must be redone.
    (killed / ".shard_00001.jsonl.tmp").write_text('{"id": "conv-2", "conversations": []}\n{"id": "conv-3", "conv')
    monkeypatch.setattr(model, "generate", model.generate.generate)
    run(model, tokenizer, conversations(), killed)
    assert sorted(os.listdir(killed)) == [MANIFEST_NAME, "shard_00000.jsonl", "shard_00001.jsonl", "shard_00002.jsonl"]
    assert by_id(killed) == by_id(tmp_path / "whole")


def test_long_prompts_stop_their_conversation(model, tokenizer, tmp_path):
    records = conversations(2)
    records[1]["conversations"][2]["value"] = "long " * 100  # the second round of conv-1 is too long
    records.append({"id": "too-long", "conversations": [{"from": "human", "value": "long " * 100}]})
    run(model, tokenizer, records, tmp_path, max_prompt_length=80)
    results = by_id(tmp_path)
    assert sorted(results) == ["conv-0", "conv-1"]
    assert [m["role"] for m in results["conv-1"]] == ["user", "assistant"]


def test_repeated_ids_are_made_unique(model, tokenizer, tmp_path):
    records = conversations(2)
    records[1]["id"] = "conv-0"
    records.append({**conversations(1)[0], "id": "conv-0#1"})
    run(model, tokenizer, records, tmp_path)
    assert sorted(by_id(tmp_path)) == ["conv-0", "conv-0#1", "conv-0#2"]


def test_tokenizer_settings_are_restored(model, tokenizer, tmp_path):
    tokenizer.pad_token = None
    assert tokenizer.padding_side == "right"
    run(model, tokenizer, conversations(2), tmp_path)
    assert tokenizer.pad_token is None and tokenizer.padding_side == "right"
    assert len(by_id(tmp_path)) == 2


def test_sampling_is_seeded(model, tokenizer, tmp_path):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run(model, tokenizer, conversations(2), tmp_path / name, do_sample=True, temperature=1.5, seed=seed)
    assert by_id(tmp_path / "a") == by_id(tmp_path / "b")
    assert by_id(tmp_path / "a") != by_id(tmp_path / "c")
    before = torch.random.get_rng_state()
    run(model, tokenizer, conversations(2), tmp_path / "d", do_sample=True, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random state is left alone


def test_bad_arguments(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        run(model, tokenizer, conversations(1), tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="temperature must be > 0 when sampling, got 0"):
        run(model, tokenizer, conversations(1), tmp_path, do_sample=True, temperature=0)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        run(model, tokenizer, conversations(1), tmp_path)
    (tmp_path / "shard_00000.jsonl").write_text('{"no_id": 1}\n')
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="is not a shard written by regenerate_responses"):
        run(model, tokenizer, conversations(1), tmp_path)


def test_a_folder_of_answers_to_other_prompts_is_refused(model, tokenizer, tmp_path, capsys):
    out = tmp_path / "out"
    without_ids = [{"conversations": c["conversations"]} for c in conversations(3)]  # ids are their positions
    run(model, tokenizer, without_ids, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # Another data set of the same length (the same position ids), one with other ids, other generation settings.
    other = [{"conversations": [{"from": "human", "value": f"Something else {i}"}]} for i in range(3)]
    other_ids = [{"id": f"other-{i}", **record} for i, record in enumerate(other)]
    for records, changed in ((other, "data"), (other_ids, "data"), (without_ids, "max_new_tokens")):
        with pytest.raises(ValueError, match=f"already holds answers of another run \\({changed}: "):
            run(model, tokenizer, records, out, max_new_tokens=MAX_NEW_TOKENS + (records is without_ids))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # The same data continued after --skip-conversations: the command knows it by the data's first conversation.
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(4)))
    folder = tmp_path / "cli"
    args = ["--data", data, "--output", folder, "--max-new-tokens", MAX_NEW_TOKENS, "--max-conversations", 2]
    from eagle3_hf.commands import regenerate as command

    def cli(*extra):
        parser = argparse.ArgumentParser()
        command.add_cli_arguments(parser)
        return command.run_cli(parser.parse_args([str(a) for a in ["--target", "unused", *args, *extra]]))

    loaded = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("eagle3_hf.targets.load_target", lambda *a, **k: loaded.append(1) or model)
        patch.setattr("eagle3_hf.targets.load_tokenizer", lambda *a, **k: tokenizer)
        assert cli() == 0 and cli("--skip-conversations", 2) == 0
        assert sorted(by_id(folder)) == ["conv-0", "conv-1", "conv-2", "conv-3"]
        data.write_text("".join(json.dumps(r) + "\n" for r in other_ids))
        with pytest.raises(ValueError, match="already holds answers of another run"):
            cli()
    assert len(loaded) == 2  # the refusal came before the target was loaded
