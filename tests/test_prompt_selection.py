"""Which prompts `eagle3-hf regenerate` answers: repeats and evaluation prompts are dropped before the target runs."""

import argparse
import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3_hf.training.data import read_conversations
from eagle3_hf.training.prompt_selection import (
    dedupe_prompts,
    exclude_prompts,
    normalize_prompt,
    read_evaluation_prompts,
)


def conversation(cid, *turns):
    """turns: (role, text) pairs."""
    return {"id": cid, "messages": [{"role": role, "content": text} for role, text in turns]}


def ids(conversations):
    return [c["id"] for c in conversations]


def test_normalize_prompt():
    assert normalize_prompt("  Hello,\n\n  World\t!  ") == "hello, world !"


def test_repeated_prompts_are_answered_once_in_input_order():
    data = [
        conversation("a", ("user", "Continue")),
        conversation("b", ("user", "Explain quantum computing"), ("assistant", "one answer")),
        conversation("c", ("user", "  continue\n")),  # the same prompt, other case and whitespace
        conversation("d", ("user", "explain   QUANTUM computing"), ("assistant", "another answer")),
        conversation("e", ("system", "Be brief."), ("user", "Continue")),  # a system prompt makes it another prompt
    ]
    kept, dropped = dedupe_prompts(data)
    assert ids(kept) == ["a", "b", "e"] and dropped == 2


def test_a_conversation_inside_a_longer_one_is_answered_there():
    # Doc2Dial ships every prefix of a dialogue: the longest one's rounds answer all of them.
    one = ("user", "I need help with my benefits.")
    two = ("user", "For my survivors.")
    three = ("user", "How do I apply?")
    data = [
        conversation("p1", one),
        conversation("p2", one, ("assistant", "Sure."), two),
        conversation("p3", one, ("assistant", "Certainly."), two, ("assistant", "OK."), three),
        conversation("other", two),  # the same text, but not the opening round of anything
    ]
    kept, dropped = dedupe_prompts(data)
    assert ids(kept) == ["p3", "other"] and dropped == 2
    assert dedupe_prompts([]) == ([], 0)


def test_evaluation_prompts_from_question_files_and_conversation_files(tmp_path):
    questions = tmp_path / "question.jsonl"
    questions.write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a  haiku.", "Now in French."]})
        + "\n"
        + json.dumps({"question_id": 82, "category": "math", "turns": ["What is 2+2?"]})
        + "\n"
    )
    chats = tmp_path / "held_out.json"
    chats.write_text(
        json.dumps(
            [{"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}]}]
        )
    )
    prompts = read_evaluation_prompts([questions, chats])
    assert prompts == {"write a haiku.", "now in french.", "what is 2+2?", "name a colour."}

    data = [
        conversation("keep", ("user", "Write a poem.")),
        conversation("first", ("user", "write a haiku.")),
        conversation("second", ("user", "Hi"), ("assistant", "Hello"), ("user", "Now in  French.")),
        conversation("answer", ("user", "Tell me"), ("assistant", "What is 2+2?")),  # an answer, not a prompt
    ]
    kept, dropped = exclude_prompts(data, prompts)
    assert ids(kept) == ["keep", "answer"] and dropped == 2


def test_evaluation_prompt_files_that_hold_none_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'.*missing.jsonl': no such file"):
        read_evaluation_prompts([tmp_path / "missing.jsonl"])
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"question_id": 1, "turns": ["   "]}) + "\n")
    with pytest.raises(ValueError, match="empty.jsonl'.*no prompt in it"):
        read_evaluation_prompts([empty])


def test_the_command_never_asks_the_target_a_dropped_prompt(tokenizer_dir, tmp_path):
    from eagle3_hf.commands import regenerate as command

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    asked = []
    generate = model.generate

    def recording_generate(*args, **kwargs):
        asked.extend(tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=True))
        return generate(*args, **kwargs)

    model.generate = recording_generate
    data = tmp_path / "data.jsonl"
    records = [
        {"id": "a", "conversations": [{"from": "human", "value": "Tell me a story"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Write a haiku."}]},
        {"id": "c", "conversations": [{"from": "human", "value": "tell me  a story"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "Count to three"}]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "turns": ["Write a haiku."]}) + "\n")

    def cli(output, *extra):
        parser = argparse.ArgumentParser()
        command.add_cli_arguments(parser)
        args = ["--target", "unused", "--data", data, "--output", output, "--max-new-tokens", 2, *extra]
        return command.run_cli(parser.parse_args([str(a) for a in args]))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("eagle3_hf.targets.load_target", lambda *a, **k: model)
        patch.setattr("eagle3_hf.targets.load_tokenizer", lambda *a, **k: tokenizer)
        assert cli(tmp_path / "out", "--exclude-prompts", questions) == 0
        assert sorted(c["id"] for c in read_conversations(tmp_path / "out")) == ["a", "d"]
        assert not any("haiku" in prompt for prompt in asked)
        assert sum("story" in prompt.lower() for prompt in asked) == 1
        asked.clear()
        assert cli(tmp_path / "all", "--no-dedupe") == 0  # without either, every conversation is answered
        assert sorted(c["id"] for c in read_conversations(tmp_path / "all")) == ["a", "b", "c", "d"]
