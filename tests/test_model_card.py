"""Model cards: written by save_pretrained, push_to_hub and the trainer with `huggingface_hub.ModelCard`, metadata that
validates, measurements from bench; the template ships inside the wheel, which installs and runs outside the tree."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from huggingface_hub.utils import validate_repo_id
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.bench.cards import bench_card, write_bench_card

ROOT = pathlib.Path(__file__).parents[1]
TARGET_ID = "tiny-org/tiny-llama"
REPORT = {
    "tau": 3.456,
    "speedup": 2.01,
    "identical": 1.0,
    "environment": {"cpu": "x86_64", "threads": 1},
    "tau_chain": 2.5,
    "acceptance_by_depth": [0.7, 0.6, None],
    "config": {"dtype": "float32", "num_prompts": 10, "max_new_tokens": 128},
}


@pytest.fixture(scope="module")
def draft():
    torch.manual_seed(0)
    target = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=96,
        )
    ).eval()
    target.config._name_or_path = TARGET_ID
    target.config.architectures = ["LlamaForCausalLM"]
    return Eagle3DraftModel.from_target(target)


def check_metadata(card: ModelCard) -> None:
    """What the Hub reads from a card: a valid base_model repo id, the library, the tags; model-index that parses."""
    data = card.data
    validate_repo_id(data.base_model)
    assert data.base_model == TARGET_ID and data.library_name == "eagle3_hf"
    assert {"eagle3", "speculative-decoding"} <= set(data.tags)
    if data.eval_results:
        name, results = model_index_to_eval_results(data.to_dict()["model-index"])
        assert name and all(r.metric_value is not None for r in results)


def test_save_pretrained_writes_a_card_with_valid_metadata_and_keeps_a_foreign_one(draft, tmp_path):
    draft.training_info = {"data": "conversations.jsonl", "steps": 12, "ttt_length": 3}
    draft.save_pretrained(tmp_path / "a")
    card = ModelCard.load(tmp_path / "a" / "README.md")
    check_metadata(card)
    assert "| training | 12 steps, TTT length 3 |" in card.text and "Not measured yet" in card.text
    assert json.loads((tmp_path / "a" / "training_info.json").read_text())["steps"] == 12
    # Reloaded and saved again, the draft keeps what training recorded.
    Eagle3DraftModel.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    assert "12 steps" in (tmp_path / "b" / "README.md").read_text()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "README.md").write_text("# my own notes\n")
    draft.training_info = None
    draft.save_pretrained(tmp_path / "c")
    assert (tmp_path / "c" / "README.md").read_text() == "# my own notes\n"


def test_bench_card_puts_acceptance_by_depth_in_the_metadata(draft, tmp_path):
    draft.save_pretrained(tmp_path)
    write_bench_card(str(tmp_path), REPORT, bench_command="eagle3-hf bench")
    card = ModelCard.load(tmp_path / "README.md")
    check_metadata(card)
    metrics = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert metrics == {
        "mean_accepted_tokens": 3.456,
        "mean_accepted_tokens_chain": 2.5,
        "speedup": 2.01,
        "acceptance_rate_depth_1": 0.7,
        "acceptance_rate_depth_2": 0.6,
    }
    assert "| 3.46 | 2.01x | 100% | x86_64 (1 thread) | float32 |" in card.text
    assert "tau 2.50; acceptance by depth (n-alpha) 0.70 / 0.60 / n/a." in card.text
    assert "near-ties" not in card.text  # float32: the verification is exact
    bf16 = {**REPORT, "identical": 0.23, "config": {**REPORT["config"], "dtype": "bfloat16"}}
    text = bench_card(str(tmp_path), bf16).text
    assert "| 23% | x86_64 (1 thread) | bfloat16 |" in text and "the target's own up to near-ties" in text
    # a local path or a short name is not a Hub id: no base_model rather than a wrong one
    config = json.loads((tmp_path / "config.json").read_text())
    for name in ("smollm2", str(tmp_path)):
        (tmp_path / "config.json").write_text(json.dumps({**config, "target_name_or_path": name}))
        assert bench_card(str(tmp_path), REPORT).data.base_model is None


def test_push_to_hub_uploads_the_card(draft, monkeypatch):
    uploaded = {}

    def create_repo(self, repo_id, **kwargs):
        return type("Url", (), {"repo_id": repo_id})()

    def upload_folder(self, repo_id, folder_path, **kwargs):
        uploaded.update({name.name: name.read_text() for name in pathlib.Path(folder_path).glob("*.md")})
        uploaded["files"] = sorted(p.name for p in pathlib.Path(folder_path).iterdir())

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    draft.push_to_hub("someone/my-draft")
    assert {"README.md", "config.json", "model.safetensors"} <= set(uploaded["files"])
    card = uploaded["README.md"]
    assert "base_model: tiny-org/tiny-llama" in card and "🤗 transformers model" not in card


def test_trainer_writes_our_card_not_the_stock_one(draft, tmp_path):
    from datasets import Dataset

    from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments

    rows = Dataset.from_list([{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}] * 2)
    args = Eagle3TrainingArguments(
        str(tmp_path), max_steps=1, report_to="none", use_cpu=True, feature_mode="offline", build_draft_vocab=False
    )
    trainer = Eagle3Trainer(
        draft,
        args,
        train_dataset=rows.map(
            lambda r: {
                "target_hidden_states": [[0.0] * 192] * 4,
                "target_top_logits": [[0.0] * 4] * 4,
                "target_top_ids": [[0, 1, 2, 3]] * 4,
            }
        ),
    )
    trainer.create_model_card(model_name="x", dataset="y")
    card = ModelCard.load(tmp_path / "README.md")
    check_metadata(card)
    assert "fine-tuned version of" not in card.text and "the None dataset" not in card.text


def test_model_cards_holds_each_shipped_drafts_card_as_the_package_ships_it():
    from eagle3_hf.modeling.shipped import SHIPPED_DRAFTS

    folder, shipped = ROOT / "model_cards", ROOT / "eagle3_hf" / "drafts"
    drafts = sorted(SHIPPED_DRAFTS.values())
    assert drafts == sorted(p.name for p in shipped.iterdir() if (p / "config.json").is_file())
    assert sorted(p.stem for p in folder.glob("*.md") if p.name != "README.md") == drafts  # none missing, none stale
    for name in drafts:  # the package's card is the source: the wheel carries it with the weights
        assert (folder / f"{name}.md").read_bytes() == (shipped / name / "README.md").read_bytes(), (
            f"model_cards/{name}.md differs from the shipped card: cp eagle3_hf/drafts/{name}/README.md "
            f"model_cards/{name}.md"
        )
    index = (folder / "README.md").read_text(encoding="utf-8")
    assert all(f"]({name}.md)" in index for name in drafts)
    assert "](../eagle3_hf/modeling/templates/model_card.md)" in index  # where the one template lives


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package built as a wheel (from a copy of the sources, without build isolation) and installed with pip
    into a folder outside the source tree: (wheel, site folder)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"
    skip = shutil.ignore_patterns(
        ".venv", ".git", "tests", "examples", "build", "*.egg-info", "__pycache__", "work_data", "runs"
    )
    shutil.copytree(ROOT, source, ignore=skip)
    pip = [sys.executable, "-m", "pip", "-q"]
    done = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    wheel = next((tmp / "dist").glob("eagle3_hf-*.whl"))
    done = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(tmp / "site"), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return wheel, tmp / "site"


def run_installed(site, *argv, timeout=600):
    """Run a command with the installed copy first on the path, in a folder outside the source tree."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, cwd=site.parent, env=env, timeout=timeout
    )


def test_the_wheel_ships_the_draft_and_the_template(installed):
    wheel, site = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = "eagle3_hf/drafts/smollm2-135m-instruct/"
    assert {shipped + n for n in ("config.json", "model.safetensors", "README.md", "training_info.json")} <= names
    assert "eagle3_hf/modeling/templates/model_card.md" in names
    # The card renders from the template inside the wheel itself (zipimport: no file of the source tree is read).
    code = (
        f"import sys; sys.path.insert(0, {str(wheel)!r})\n"
        "import eagle3_hf.modeling.model_card as m; assert m.__file__.startswith(sys.path[0]), m.__file__\n"
        "print(m.build_model_card({'target_name_or_path': 'org/name', 'draft_vocab_size': 8, 'vocab_size': 9}))\n"
    )
    done = run_installed(site, sys.executable, "-c", code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "base_model: org/name" in done.stdout and "# EAGLE-3 draft for org/name" in done.stdout
    # Installed: the console script answers --help and --version, and the shipped draft's card renders.
    for flag, expected in (("--help", "convert"), ("--version", "eagle3-hf 0.1.0")):
        done = run_installed(site, sys.executable, site / "bin" / "eagle3-hf", flag)
        assert done.returncode == 0 and expected in done.stdout, done.stderr
    code = (
        "import eagle3_hf, sys; assert eagle3_hf.__file__.startswith(sys.path[1]), eagle3_hf.__file__\n"
        "from importlib import resources; from eagle3_hf.bench.cards import bench_card\n"
        "draft = resources.files('eagle3_hf').joinpath('drafts', 'smollm2-135m-instruct')\n"
        "print(bench_card(str(draft)).data.base_model)\n"
    )
    done = run_installed(site, sys.executable, "-c", code)
    assert done.returncode == 0 and done.stdout.strip() == "HuggingFaceTB/SmolLM2-135M-Instruct", done.stderr


@pytest.mark.slow
def test_the_readme_main_command_from_the_installed_wheel(installed):
    _, site = installed
    done = run_installed(
        site,
        sys.executable,
        site / "bin" / "eagle3-hf",
        "generate",
        "--target",
        "smollm2",
        "--max-new-tokens",
        "8",
        "--no-compare",
        "--repeats",
        "1",
        "--threads",  # times even where other jobs (another test worker) hold a core
        "1",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # the shipped draft, found inside the installed package
    assert done.stdout.startswith("Loading SmolLM2-135M-Instruct")
    assert "its shipped draft smollm2-135m-instruct" in done.stdout
    assert "\nEAGLE-3: 8 tokens; tau " in done.stdout and "timed (" in done.stdout and "  EAGLE-3 " in done.stdout
