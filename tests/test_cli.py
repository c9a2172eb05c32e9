"""The command line as a user meets it: bad input gives one clear line and exit code 2 (no traceback), outputs are
never overwritten by accident, `--help` and `--version` are instant, `--config` files hold any option."""

import argparse
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from helpers.cli import (
    assert_clean_error,
    run,
    tiny,  # noqa: F401 (fixture)
    train,
)
from safetensors import safe_open
from transformers import LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.cli import main as cli_main

torch.set_num_threads(1)


# ------------------------------------------------------------------------------------------------------------------
# newcomers: --help, --version, --debug


def test_help_and_version_do_not_import_torch():
    # Building every parser must not import torch or transformers (that is what made --help take 10 s).
    code = (
        "import sys; from eagle3_hf.cli import SUBCOMMANDS, build_parser, build_subparser, version_line\n"
        "from eagle3_hf.commands.train import quick_help\n"
        "build_parser(); [build_subparser(c) for c in SUBCOMMANDS if c != 'train']; quick_help(); version_line()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    for argv in (["--help"], ["train", "--help"], ["convert", "--help"], ["generate", "--help"], ["--version"]):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "eagle3_hf.cli", *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "| torch\n" not in done.stderr and "| transformers\n" not in done.stderr, argv
    version = subprocess.run([sys.executable, "-m", "eagle3_hf.cli", "--version"], capture_output=True, text=True)
    assert version.stdout.startswith("eagle3-hf 0.1.0 (transformers ") and "torch" in version.stdout


# What a newcomer mistypes is answered by the command line itself, before torch or transformers load (seconds).
_NO_TORCH = (
    "import sys\nfrom eagle3_hf.cli import main\ncode = main(sys.argv[1:])\n"
    "print('torch' in sys.modules, 'transformers' in sys.modules)\nsys.exit(code)"
)


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["generate", "--target", "smolm2"], ["Unknown target 'smolm2'", "did you mean 'smollm2'?"]),
        (
            ["generate", "--target", "nosuchmodel"],
            ["Unknown target 'nosuchmodel'", "expected a short name ('smollm2')"],
        ),
        (["bench", "--target", "SmolLM-2"], ["did you mean 'smollm2'?"]),  # every command checks --target first
        (
            ["generate", "--draft", "smollm2-135m"],
            [
                "--draft 'smollm2-135m': no such folder, shipped draft or Hub id",
                "did you mean 'smollm2-135m-instruct'?",
            ],
        ),
        (["generate", "--draft", "randon"], ["or 'random', 'lookup'", "did you mean 'random'?"]),
        (["generate", "--repeats", "0"], ["--repeats must be >= 1, got 0"]),
        (["generate", "--repeat-tokens", "-2"], ["--repeat-tokens must be >= 1, got -2"]),
        (["generate", "--corpus", "no/corpus.safetensors"], ["--corpus 'no/corpus.safetensors': no such file"]),
        (["generate", "--corpus", "c.safetensors", "--no-corpus"], ["--corpus FILE and --no-corpus contradict"]),
        (["bench", "--methods", "plain,corpus_tree"], ["--methods corpus_tree needs --corpus FILE"]),
    ],
)
def test_mistakes_are_answered_before_torch_loads(argv, fragments):
    done = subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout.strip() == "False False", done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"eagle3-hf {argv[0]}: error: "), done.stderr
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), (fragment, lines[0])


def test_a_mistyped_command_gets_a_suggestion():
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_hf.cli", "genrate", "--target", "smollm2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown command 'genrate'; did you mean 'generate'? choose from regenerate," in done.stderr
    done = subprocess.run([sys.executable, "-m", "eagle3_hf.cli", "xyzzy"], capture_output=True, text=True)
    assert done.returncode == 2 and "did you mean" not in done.stderr and "unknown command 'xyzzy'" in done.stderr


def test_every_option_has_help_and_shows_its_default():
    from eagle3_hf.cli import SUBCOMMANDS, build_subparser

    for command in (c for c in SUBCOMMANDS if c != "train"):  # train: TrainingArguments' own help, see below
        parser = build_subparser(command)
        formatter = parser._get_formatter()  # argparse keeps no public way to one option's help text
        for action in parser._actions:
            assert action.help and action.help.strip(), f"eagle3-hf {command} {action.option_strings}: no help"
            shown = formatter._get_help_string(action)
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                assert "default" in shown, f"eagle3-hf {command} {action.option_strings}: default not shown"
    text = " ".join(build_subparser("generate").format_help().split())
    for fragment in (
        "--max-new-tokens MAX_NEW_TOKENS most new tokens of the streamed answer",
        "(default: 128)",
        "--device DEVICE torch device",
        "(default: cpu)",
        "(default: the draft shipped for the target)",
        "(default: 5)",
        "(default: 32)",
        "(default: one per core that other jobs leave free, and no timing when none is)",
    ):
        assert fragment in text, fragment
    from eagle3_hf.commands.train import quick_help

    train_help = " ".join(quick_help().split())
    assert "(default: 0.95)" in train_help and "(default: None)" not in train_help  # None is not a default to show


def test_debug_shows_the_traceback(capsys):
    assert_clean_error(*run(capsys, "generate", "--target", "nosuchtarget")[::2], "Unknown target 'nosuchtarget'")
    with pytest.raises(ValueError, match="Unknown target"):
        cli_main(["generate", "--target", "nosuchtarget", "--debug"])


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", "only-one-path"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the following arguments are required: dst" in err
    code, _, err = run(capsys, "bench", "--methods", "plain,bogus")
    assert_clean_error(code, err, "--methods 'plain,bogus'", "choose from plain, prompt_lookup")


# ------------------------------------------------------------------------------------------------------------------
# convert: never lose work


def test_convert_refuses_an_existing_file_or_folder_and_itself(tmp_path, tiny, capsys):
    root, _ = tiny
    src = root / "draft"
    existing = tmp_path / "existing.txt"
    existing.write_text("keep me")
    code, _, err = run(capsys, "convert", src, existing)
    assert_clean_error(code, err, "is an existing file")
    assert existing.read_text() == "keep me"
    busy = tmp_path / "busy"
    busy.mkdir()
    for name in ("config.json", "README.md", "model.safetensors.index.json"):
        (busy / name).write_text("earlier work")
    code, _, err = run(capsys, "convert", src, busy)
    assert_clean_error(code, err, "already exists and is not empty", "--overwrite-output-dir")
    assert sorted(os.listdir(busy)) == ["README.md", "config.json", "model.safetensors.index.json"]
    # With the flag the folder is replaced whole: no stale index or card of the earlier content is left behind.
    code, out, _ = run(capsys, "convert", src, busy, "--overwrite-output-dir")
    assert code == 0 and "Wrote the native draft" in out
    assert "model.safetensors.index.json" not in os.listdir(busy) and (busy / "model.safetensors").is_file()
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # no temporary sibling left over
    before = {n: (src / n).read_bytes() for n in os.listdir(src)}
    for extra in ([], ["--overwrite-output-dir"], ["--to", "eagle", "--overwrite-output-dir"]):
        code, _, err = run(capsys, "convert", src, src, *extra)
        assert_clean_error(code, err, "is (or holds) the checkpoint being read")
    assert {n: (src / n).read_bytes() for n in os.listdir(src)} == before


def test_speculators_export_carries_identity_and_embedding(tmp_path, tiny, capsys):
    root, target = tiny
    code, _, err = run(capsys, "convert", root / "draft", tmp_path / "a", "--to", "speculators")
    assert_clean_error(code, err, "must carry the token embedding", "--target")
    assert not (tmp_path / "a").exists()
    # A name other tools cannot load (a short name of ours) is refused; a local folder or a Hub id is written.
    from eagle3_hf.modeling.layouts import save_speculators

    draft = Eagle3DraftModel.from_pretrained(root / "draft", target=target)
    draft.config.target_name_or_path = "mytarget"
    with pytest.raises(ValueError, match="'mytarget', which is neither a Hub id"):
        save_speculators(draft, tmp_path / "b")
    assert (
        run(capsys, "convert", root / "draft", tmp_path / "b", "--to", "speculators", "--target", root / "target")[0]
        == 0
    )
    verifier = json.loads((tmp_path / "b" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(root / "target"), "architectures": ["LlamaForCausalLM"]}
    # The target in bfloat16: the exported embedding keeps the target's precision, the rest the draft's.
    LlamaForCausalLM.from_pretrained(root / "target", dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    code, _, err = run(
        capsys,
        "convert",
        root / "draft",
        tmp_path / "spec",
        "--to",
        "speculators",
        "--target",
        tmp_path / "bf16",
        "--target-id",
        "tiny-org/tiny-llama",
    )
    assert code == 0, err
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    verifier = config["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "tiny-org/tiny-llama", "architectures": ["LlamaForCausalLM"]}
    with safe_open(str(tmp_path / "spec" / "model.safetensors"), "pt") as f:
        embedding = f.get_tensor("embed_tokens.weight")
        assert f.get_tensor("fc.weight").dtype == torch.float32
    assert embedding.dtype == torch.bfloat16
    assert torch.equal(embedding, target.get_input_embeddings().weight.to(torch.bfloat16))
    # A short name is recorded as the Hub id it stands for.
    from eagle3_hf.targets import target_hub_id

    assert target_hub_id("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_target_folder_as_the_draft_says_so(tiny, capsys):
    root, _ = tiny
    code, _, err = run(capsys, "convert", root / "target", root / "never")
    assert_clean_error(code, err, "This is a full model (LlamaForCausalLM, 8 layers), not an EAGLE-3 draft")


def test_draft_config_errors_name_the_file_and_the_key(tmp_path, tiny, capsys):
    root, _ = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes((root / "draft" / "model.safetensors").read_bytes())
    (broken / "config.json").write_text('{"model_type": "eagle3_draft",')
    code, _, err = run(capsys, "convert", broken, tmp_path / "out")
    assert_clean_error(code, err, "config.json' is not valid JSON")
    config = json.loads((root / "draft" / "config.json").read_text())
    config["hiden_size"] = config.pop("hidden_size")
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run(capsys, "convert", broken, tmp_path / "out")
    assert_clean_error(code, err, "unknown key 'hiden_size'; did you mean 'hidden_size'?")


def test_bind_refuses_a_target_with_another_embedding(tiny):
    _, target = tiny
    draft = Eagle3DraftModel.from_target(target)
    torch.manual_seed(1)
    other = LlamaForCausalLM(target.config).eval()  # the same shapes, other weights
    with pytest.raises(ValueError, match="embedding differs from the target's"):
        bind_target(draft, other)
    assert bind_target(draft, target) is draft  # its own target still binds


# ------------------------------------------------------------------------------------------------------------------
# generate / bench: bad values fail at once, before any model is loaded


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--target", "nosuchtarget"], ["Unknown target 'nosuchtarget'", "expected a short name ('smollm2')"]),
        (["--target", "smolm2"], ["Did you mean 'smollm2'?"]),
        (["--target", "/no/such/folder"], ["Unknown target '/no/such/folder': no such file or folder"]),
        (["--temperature", "-1"], ["--temperature must be >= 0"]),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:99"], ["--device cuda"]),
        (["--device", "toaster"], ["'toaster' is not a device name"]),
    ],
)
def test_generate_bad_input(capsys, argv, fragments):
    assert_clean_error(*run(capsys, "generate", *argv)[::2], *fragments)


def test_bench_checks_plot_and_outputs_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the [plot] extra were not installed
    code, _, err = run(capsys, "bench", "--plot", tmp_path / "a.png")
    assert_clean_error(code, err, "--plot needs matplotlib", "eagle3-hf[plot]")
    monkeypatch.delitem(sys.modules, "matplotlib")
    (tmp_path / "report.json").write_text("{}")
    code, _, err = run(capsys, "bench", "--json", tmp_path / "report.json")
    assert_clean_error(code, err, "already exists", "--overwrite-output-dir")


# ------------------------------------------------------------------------------------------------------------------
# train


def test_train_never_overwrites_and_refuses_zero_steps(chat_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = train(capsys, chat_target, out, "--max-steps", "0")
    assert_clean_error(code, err, "--max-steps must be a positive number of steps")
    assert not out.exists()
    for length, fragment in (("1", "max_length must be None or >= 3"), ("2", "max_length must be None or >= 3")):
        assert_clean_error(*train(capsys, chat_target, out, "--max-steps", "1", "--max-length", length)[::2], fragment)
    code, _, err = train(capsys, chat_target, out, "--max-steps", "2", "--save-steps", "1")
    assert code == 0, err
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, _, err = train(capsys, chat_target, out, "--max-steps", "1")
    assert_clean_error(code, err, "already exists and is not empty", "--overwrite-output-dir", "--resume")
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # not a byte touched
    code, out_text, err = train(capsys, chat_target, out, "--max-steps", "1", "--overwrite-output-dir")
    assert code == 0, err
    assert "removed 2 earlier checkpoint(s)" in out_text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert not (out / ".saving-draft.tmp").exists()
    card = (out / "README.md").read_text()
    assert "library_name: eagle3_hf" in card and "fine-tuned version of" not in card


def test_train_config_file_holds_every_option_and_tensorboard_logs(chat_target, tmp_path, capsys):
    pytest.importorskip("tensorboard")  # the [tensorboard] extra; installed with [dev]
    folder, data = chat_target
    out = tmp_path / "run"
    config = tmp_path / "train.yaml"
    # Required options (target, data, output) and TrainingArguments fields the old CLI never exposed.
    config.write_text(
        f"target: {folder}\ndata: [{data}]\noutput_dir: {out}\nmax_steps: 5\nttt_length: 2\n"
        "draft_vocab_size: 64\nlogging_steps: 1\nreport_to: tensorboard\nlr_scheduler_type: constant\n"
        "learning_rate: 3e-3\nsave_strategy: 'no'\n"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, err = run(capsys, "train", "--config", config, "--max-steps", "2")  # a flag beats the file
    assert code == 0, err
    assert not [w for w in caught if issubclass(w.category, FutureWarning)]  # the CLI causes no deprecation
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and not list(out.glob("checkpoint-*"))
    assert {log["learning_rate"] for log in state["log_history"] if "learning_rate" in log} == {3e-3}
    assert list(out.rglob("events.out.tfevents.*")), sorted(str(p) for p in out.rglob("*"))
    (tmp_path / "bad.json").write_text('{"target": "x", "nonsense_option": 1}')
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--config", str(tmp_path / "bad.json")])
    assert exit_info.value.code == 2 and "unknown option(s) in" in capsys.readouterr().err
    (tmp_path / "broken.json").write_text('{"target": ')
    assert_clean_error(*run(capsys, "train", "--config", tmp_path / "broken.json")[::2], "is not valid JSON")


@pytest.mark.slow
def test_two_processes_with_accelerate_launch_print_once(chat_target, tmp_path):
    # The README's command: `accelerate launch --multi_gpu --num_processes 2` starts two processes on a CPU-only
    # machine too (`--cpu` alone would run one); only the first prints.
    import socket

    folder, data = chat_target
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(port),
        "-m",
        "eagle3_hf.cli",
        "train",
        "--target",
        str(folder),
        "--data",
        str(data),
        "--output",
        str(tmp_path / "run"),
        "--max-steps",
        "2",
        "--ttt-length",
        "2",
        "--draft-vocab-size",
        "64",
        "--logging-steps",
        "1",
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root)  # this checkout's package, from any folder
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Saved the draft to") == 1 and done.stdout.count("Data: 12 of 12") == 1, done.stdout
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    # Two processes of batch 1 take 2 of the 12 conversations a step: 2 steps are a third of an epoch (one
    # process would have made a sixth).
    assert state["global_step"] == 2 and state["epoch"] == pytest.approx(2 / 6)


def test_readme_set_up_is_what_a_newcomer_can_run():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    set_up = readme[readme.index("## Set up") : readme.index("## Using it")]
    assert '".[dev,plot]"' in set_up  # bench --plot works after the Set up
    # Linux's default index serves torch's multi-GB CUDA build: the CPU wheels' index is written out, not referred to
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in set_up
    assert "Python 3.10" in set_up and "python -m venv" in set_up  # the version it needs, in its own environment
    assert 'python -m pytest -q -m "not slow"' in set_up and "pip check" in set_up  # the fast tests; why pip check
    assert "sharegpt.json" not in readme  # no file that nobody has
    assert "--num_processes 2 --cpu" not in readme and "accelerate launch --multi_gpu --num_processes 2" in readme


def test_tree_options_on_a_generation_config_and_other_methods_refused(tiny):
    from transformers import GenerationConfig

    _, target = tiny
    draft = bind_target(Eagle3DraftModel.from_target(target).eval(), target)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    common = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True}
    config = GenerationConfig(tree_depth=2, tree_top_k=1, tree_total_tokens=3, adaptive_tree=False, **common)
    out = target.generate(ids, assistant_model=draft, generation_config=config, attention_mask=torch.ones_like(ids))
    assert set(out.tree_sizes) == {3}  # the config's tree, verified in full every cycle
    out = target.generate(
        ids, assistant_model=draft, generation_config=config, tree_total_tokens=2, attention_mask=torch.ones_like(ids)
    )
    assert set(out.tree_sizes) == {2}  # a call argument beats the config
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens asks for prompt-lookup decoding"):
        target.generate(ids, assistant_model=draft, prompt_lookup_num_tokens=3, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_assistant_tokens sizes the chains .* pass tree_depth"):
        target.generate(ids, assistant_model=draft, num_assistant_tokens=4, max_new_tokens=2)
    with pytest.warns(UserWarning, match="num_assistant_tokens=4 is ignored by EAGLE-3 decoding"):
        target.generate(
            ids, assistant_model=draft, generation_config=GenerationConfig(num_assistant_tokens=4, max_new_tokens=2)
        )
