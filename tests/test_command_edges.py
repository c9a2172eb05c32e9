"""The command line's edges: a missing or broken draft is refused before the target loads, a Hub id of a target
with a shipped draft finds it, a Hub that cannot be reached is answered at once (from the cache, or with one line),
an empty prompt and an absurd token count get one line, `--target` reads the same in every subcommand, and
`generate` times on the cores other jobs leave free."""

import json
import socket

import pytest
import torch
from transformers import AutoTokenizer

from eagle3_hf.cli import SUBCOMMANDS, build_subparser
from eagle3_hf.cli import main as cli_main

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def one_line_error(capsys, argv, *fragments):
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return out, lines[0]


@pytest.fixture
def no_target_load(monkeypatch):
    """Make loading any target fail loudly: an error that comes first was found before the target loaded."""
    from eagle3_hf import targets

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the error was found")

    monkeypatch.setattr(targets, "load_target", refuse)


@pytest.fixture
def offline(monkeypatch):
    """A process that cannot reach the Hub (HF_HUB_OFFLINE), with an empty Hugging Face cache of its own."""
    from huggingface_hub import constants

    from eagle3_hf.utils.hub import hub_unreachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_unreachable.cache_clear()
    yield constants
    hub_unreachable.cache_clear()


def fake_cache(root, repo_id, files=("config.json",)):
    """A Hugging Face cache holding `files` of `repo_id` (as huggingface_hub lays it out) under `root`."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for name in files:
        (repo / "snapshots" / "abc123" / name).write_text("{}")
    return root


@pytest.fixture(scope="module")
def saved_draft(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_hf import Eagle3DraftModel

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, vocab_size=64
    )
    target = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("draft")
    Eagle3DraftModel.from_target(target).save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------------------------------------
# the draft: checked before the target loads


def test_convert_of_a_missing_folder_says_so_in_one_line(capsys, tmp_path, no_target_load):
    _, line = one_line_error(
        capsys, ["convert", "draft/", tmp_path / "out"], "SRC 'draft/': no such folder, shipped draft or Hub id"
    )
    assert "repo id" not in line.lower() and "alphanumeric" not in line  # not huggingface_hub's naming rules
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_an_empty_or_broken_draft_folder_is_refused_before_the_target_loads(
    command, capsys, tmp_path, saved_draft, no_target_load
):
    def argv(folder):
        if command == "convert":
            return ["convert", folder, tmp_path / "out", "--target", "smollm2"]
        return ["generate", "--draft", folder]

    what = "SRC" if command == "convert" else "--draft"
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(capsys, argv(empty), f"{what} '{empty}' is no draft checkpoint: no config.json (it is empty)")

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": ')
    one_line_error(capsys, argv(broken), "config.json' is not valid JSON")

    (broken / "config.json").write_text((saved_draft / "config.json").read_text())
    one_line_error(capsys, argv(broken), f"{what} '{broken}' holds no weights: expected one of model.safetensors")

    weights = (saved_draft / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # an interrupted copy
    one_line_error(capsys, argv(broken), "model.safetensors' is not a safetensors file, or it is truncated")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    one_line_error(capsys, argv(broken), "is not a safetensors file")


def test_the_folder_check_passes_a_whole_checkpoint_and_its_sharded_form(tmp_path, saved_draft):
    from eagle3_hf.modeling.checkpoint_check import check_checkpoint_folder

    check_checkpoint_folder(saved_draft)  # a folder save_pretrained wrote
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((saved_draft / "config.json").read_text())
    (sharded / "shard-1.safetensors").write_bytes((saved_draft / "model.safetensors").read_bytes())
    index = {"weight_map": {"fc.weight": "shard-1.safetensors", "norm.weight": "shard-2.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lists shards that are not there: shard-2.safetensors"):
        check_checkpoint_folder(sharded)
    index["weight_map"]["norm.weight"] = "shard-1.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    check_checkpoint_folder(sharded)


# ------------------------------------------------------------------------------------------------------------------
# Hub ids: the shipped draft, and a Hub that cannot be reached


def test_the_hub_id_of_a_target_with_a_shipped_draft_finds_it():
    from eagle3_hf.commands.generate import _loading_line
    from eagle3_hf.draft_names import check_draft_option
    from eagle3_hf.modeling.shipped import shipped_draft_name, shipped_draft_path, short_name_of

    assert short_name_of(SMOLLM2_HUB_ID) == short_name_of(SMOLLM2_HUB_ID.lower()) == "smollm2"
    assert shipped_draft_path(SMOLLM2_HUB_ID) == shipped_draft_path("smollm2")
    assert shipped_draft_name(SMOLLM2_HUB_ID) == "smollm2-135m-instruct"
    check_draft_option(SMOLLM2_HUB_ID, None)
    with pytest.raises(ValueError, match=r"No draft is shipped for target 'org/other' \(shipped for: 'smollm2'"):
        shipped_draft_path("org/other")
    args = build_subparser("generate").parse_args(["--target", SMOLLM2_HUB_ID])
    assert _loading_line(args) == f"Loading {SMOLLM2_HUB_ID} and its shipped draft smollm2-135m-instruct ..."


def test_offline_a_hub_target_is_refused_at_once_naming_the_installed_copy(capsys, offline, monkeypatch, tmp_path):
    monkeypatch.setattr(offline, "HF_HUB_CACHE", str(tmp_path))
    out, line = one_line_error(
        capsys,
        ["generate", "--target", SMOLLM2_HUB_ID],
        f"Cannot load the target '{SMOLLM2_HUB_ID}': the Hub cannot be reached (HF_HUB_OFFLINE is set)",
        "--target smollm2",
    )
    assert out == ""  # refused before the loading line: nothing was loaded, nothing was fetched
    one_line_error(capsys, ["generate", "--draft", "org/some-draft"], "Cannot load the draft 'org/some-draft'")


def test_offline_a_cached_hub_repo_loads_from_the_cache(offline, monkeypatch, tmp_path):
    from eagle3_hf.target_names import hub_target_kwargs
    from eagle3_hf.utils.hub import hub_kwargs_for

    monkeypatch.setattr(offline, "HF_HUB_CACHE", str(fake_cache(tmp_path, SMOLLM2_HUB_ID)))
    assert hub_target_kwargs(SMOLLM2_HUB_ID, None) == {"local_files_only": True}
    assert hub_target_kwargs(str(tmp_path), None) == {}  # a folder is no Hub id
    assert hub_target_kwargs(SMOLLM2_HUB_ID, "file.gguf") == {}
    with pytest.raises(ValueError, match="Cannot load the draft 'org/not-cached'"):
        hub_kwargs_for("org/not-cached", "the draft")


def test_the_hub_probe(monkeypatch):
    from huggingface_hub import constants

    from eagle3_hf.utils.hub import hub_kwargs_for, hub_unreachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    asked = []

    def no_network(address, timeout):
        asked.append((address, timeout))
        raise OSError(-2, "Name or service not known")

    monkeypatch.setattr(socket, "create_connection", no_network)
    hub_unreachable.cache_clear()
    try:
        assert hub_unreachable() == "huggingface.co: Name or service not known"
        hub_unreachable()
        assert asked == [(("huggingface.co", 443), 2.0)]  # asked once per process, briefly

        class Connection:
            def close(self):
                pass

        monkeypatch.setattr(socket, "create_connection", lambda address, timeout: Connection())
        hub_unreachable.cache_clear()
        assert hub_unreachable() is None and hub_kwargs_for("org/anything", "the target") == {}
        monkeypatch.setattr(socket, "create_connection", no_network)
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")  # behind a proxy only a request can tell
        hub_unreachable.cache_clear()
        assert hub_unreachable() is None
    finally:
        hub_unreachable.cache_clear()


# ------------------------------------------------------------------------------------------------------------------
# generate's prompt and token count


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_an_empty_prompt_is_refused(capsys, prompt, no_target_load):
    out, _ = one_line_error(capsys, ["generate", "--prompt", prompt], "--prompt is empty")
    assert out == ""


def test_cap_new_tokens():
    from eagle3_hf.commands.generate import cap_new_tokens

    assert cap_new_tokens(128, 20, 8192) == (128, None)
    assert cap_new_tokens(128, 20, None) == (128, None)
    tokens, line = cap_new_tokens(100_000_000, 20, 8192)
    assert tokens == 8172
    assert line == (
        "--max-new-tokens 100000000 is more than the target's 8192 positions leave after this 20-token prompt: "
        "capped at 8172."
    )
    with pytest.raises(ValueError, match="The prompt is 8192 tokens, and the target's context holds 8192"):
        cap_new_tokens(1, 8192, 8192)


def test_an_absurd_max_new_tokens_is_capped_with_a_line(chat_target, capsys, tmp_path):
    folder, _ = chat_target
    small = tmp_path / "target"
    small.mkdir()
    for path in folder.iterdir():
        if path.is_file() and path.suffix != ".jsonl":
            (small / path.name).write_bytes(path.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(small)
    chat = [{"role": "user", "content": "hi"}]
    prompt_length = len(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"])
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = prompt_length + 4
    (small / "config.json").write_text(json.dumps(config))
    argv = ["generate", "--target", small, "--draft", "random", "--prompt", "hi", "--max-new-tokens", "100000000"]
    assert cli_main([str(a) for a in [*argv, "--threads", "1", "--dtype", "float32", "--repeats", "1"]]) == 0
    out = capsys.readouterr().out
    assert f"after this {prompt_length}-token prompt: capped at 4.\n" in out
    assert "\nEAGLE-3: 4 tokens" in out


# ------------------------------------------------------------------------------------------------------------------
# --target: one description


def test_target_reads_the_same_in_every_subcommand():
    from eagle3_hf.commands.options import TARGET_HELP
    from eagle3_hf.commands.train import build_parser as build_train_parser

    found = {}
    for command in SUBCOMMANDS:
        parser = build_train_parser() if command == "train" else build_subparser(command)
        (action,) = [a for a in parser._actions if "--target" in a.option_strings]
        found[command] = action.help
    assert set(found) == set(SUBCOMMANDS)
    for command, text in found.items():
        assert text.startswith(TARGET_HELP), (command, text)


# ------------------------------------------------------------------------------------------------------------------
# bench --markdown: one table, every configuration, against plain and against prompt lookup at its best


def test_bench_methods_all_and_markdown_to_the_terminal(tmp_path):
    from eagle3_hf.bench.runner import METHODS
    from eagle3_hf.commands.bench import STDOUT, _check_options

    parser = build_subparser("bench")
    assert parser.parse_args(["--markdown"]).markdown == STDOUT
    assert parser.parse_args(["--markdown", "t.md"]).markdown == "t.md"
    every = _check_options(parser.parse_args(["--methods", "all"]))
    assert every == tuple(m for m in METHODS if m not in ("prompt_lookup", "corpus_tree"))  # no corpus: no corpus_tree
    (tmp_path / "corpus.safetensors").write_bytes(b"")
    corpus = str(tmp_path / "corpus.safetensors")
    assert _check_options(parser.parse_args(["--methods", "all", "--corpus", corpus]))[-1] == "corpus_tree"


def test_the_markdown_table_has_the_ratio_to_prompt_lookup_at_its_best():
    from eagle3_hf.bench.report import format_markdown

    report = {
        "tokens_per_s": {"plain_bf16": 20.0, "prompt_lookup3_bf16": 25.0, "prompt_lookup5_bf16": 24.0, "hybrid": 30.0},
        "speedup_by_method": {
            "plain_bf16": 1.0,
            "prompt_lookup3_bf16": 1.25,
            "prompt_lookup5_bf16": 1.2,
            "hybrid": 1.5,
        },
        "fastest_plain": "plain_bf16",
        "best_prompt_lookup": "prompt_lookup3_bf16",
        "environment": {
            "cpu": "Some EPYC",
            "threads": 2,
            "vector_cpu_flags": ["avx2", "avx512f"],
            "date": "2026-12-07",
        },
    }
    lines = format_markdown(report).splitlines()
    assert lines[0] == (
        "| configuration | tokens/s (median) | vs `plain_bf16` (fastest plain) | vs `prompt_lookup3_bf16` (prompt lookup "
        "at its best) |"
    )
    assert lines[1] == "|---|---|---|---|"
    assert lines[2:6] == [
        "| `plain_bf16` | 20.00 | 1.00x | 0.80x |",
        "| `prompt_lookup3_bf16` | 25.00 | 1.25x | 1.00x |",
        "| `prompt_lookup5_bf16` | 24.00 | 1.20x | 0.96x |",
        "| `hybrid` | 30.00 | 1.50x | 1.20x |",
    ]
    assert "Some EPYC" in lines[7] and "vector units: avx2, avx512f, measured 2026-12-07." in lines[7]
    assert sum(line.startswith("|---") for line in lines) == 1  # one table


def test_bench_markdown_prints_one_table_in_place_of_the_text_table(chat_target, capsys, tmp_path):
    folder, _ = chat_target
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "count to three"}) + "\n")
    argv = ["bench", "--target", folder, "--prompts", prompts, "--every", "1", "--max-new-tokens", "4"]
    argv += ["--repeats", "1", "--methods", "plain,prompt_lookup_sweep", "--threads", "1", "--dtype", "float32"]
    assert cli_main([str(a) for a in [*argv, "--markdown"]]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0].startswith("| configuration | tokens/s (median) | vs `plain_")
    assert "(prompt lookup at its best) |" in table[0]
    names = [row.split("|")[1].strip(" `") for row in table[2:]]
    assert {"plain_fp32", "prompt_lookup3_fp32", "prompt_lookup5_fp32", "prompt_lookup10_fp32"} <= set(names)
    assert "vs fastest plain\n" not in out and "Hardware: " in out  # the markdown, not the text table
