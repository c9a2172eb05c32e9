"""The row-invariance probe's answer kept on disk (generation/probe_cache.py): a second process on the same machine
does not run the probe again, a change in what decides the answer does, a corrupt file is ignored with a warning, and
the cache can be refreshed or turned off. Every test points the cache at a temporary folder (conftest.py turns it
off for all the others)."""

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from helpers.probes import probes  # noqa: F401 (a fixture: counts the probe's runs)

from eagle3_hf.generation.probe_cache import CACHE_ENV, REFRESH_ENV, probe_cache_dir, probe_key
from eagle3_hf.generation.verify_choice import probe_for_target

ROOT = Path(__file__).resolve().parents[1]

# The target, built the same way here and in the second process (its weights do not decide the answer).
TARGET = textwrap.dedent(
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def make_target(dtype=torch.float32, layers=2):
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        )
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config).eval().to(dtype)
    """
)
# The second process: counts the probe's runs and prints them with the answer it got.
CHILD = TARGET + textwrap.dedent(
    """
    import json
    import eagle3_hf.generation.verify_choice as verify_choice

    torch.set_num_threads(1)
    runs = []
    real = verify_choice.probe_row_exactness
    verify_choice.probe_row_exactness = lambda model, *a, **k: runs.append(1) or real(model, *a, **k)
    result = verify_choice.probe_for_target(make_target())
    print(json.dumps({"runs": len(runs), "answer": result.describe()}))
    """
)
_namespace: dict = {}
exec(TARGET, _namespace)
make_target = _namespace["make_target"]


@pytest.fixture
def cache(monkeypatch, tmp_path, probes):
    """The probe's disk cache in a temporary folder; returns (folder, list of probe runs)."""
    folder = tmp_path / "probes"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    monkeypatch.delenv(REFRESH_ENV, raising=False)
    return folder, probes


def test_a_second_process_does_not_run_the_probe_again(cache):
    folder, runs = cache
    first = probe_for_target(make_target())
    assert len(runs) == 1 and len(list(folder.glob("*.json"))) == 1
    env = {**os.environ, CACHE_ENV: str(folder), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert child.returncode == 0, child.stderr[-2000:]
    told = json.loads(child.stdout.strip().splitlines()[-1])
    assert told == {"runs": 0, "answer": first.describe()}


def test_the_same_setting_reads_the_disk_and_a_changed_one_runs_the_probe(cache):
    folder, runs = cache
    probe_for_target(make_target())
    probe_for_target(make_target())  # another model object: the answer comes from the disk
    assert len(runs) == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        probe_for_target(make_target())  # the thread count decides it
    finally:
        torch.set_num_threads(threads)
    assert len(runs) == 2
    probe_for_target(make_target(torch.bfloat16))  # the dtype
    probe_for_target(make_target(layers=3))  # the target's layers
    assert len(runs) == 4 and len(list(folder.glob("*.json"))) == 4


def test_the_key_names_what_decides_the_answer():
    target = make_target()
    key = probe_key(target)
    assert key["threads"] == torch.get_num_threads() and key["dtype"] == "torch.float32"
    assert key["torch"] == torch.__version__ and key["attn_implementation"] == "sdpa"
    assert "cpu" in key and "cpu_flags" in key
    assert probe_key(make_target()) == key  # other weights, same shapes: the same key
    for other in (make_target(layers=3), make_target(torch.bfloat16)):
        assert probe_key(other)["model"] != key["model"] or probe_key(other)["dtype"] != key["dtype"]
    target.config._attn_implementation = "eager"
    assert probe_key(target)["attn_implementation"] == "eager"


def test_a_corrupt_file_is_ignored_with_a_warning_and_replaced(cache):
    folder, runs = cache
    answer = probe_for_target(make_target())
    (path,) = folder.glob("*.json")
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="Ignoring the row-invariance probe's cache file"):
        again = probe_for_target(make_target())
    assert len(runs) == 2 and (again.identical, again.first_difference) == (answer.identical, answer.first_difference)
    assert json.loads(path.read_text())["result"]["identical"] == answer.identical  # rewritten whole
    path.write_text(json.dumps({"key": probe_key(make_target()), "result": {"identical": True}}))
    with pytest.warns(UserWarning, match="expected"):
        probe_for_target(make_target())
    assert len(runs) == 3


def test_refresh_runs_the_probe_again(cache, monkeypatch):
    folder, runs = cache
    target = make_target()
    probe_for_target(target)
    probe_for_target(target, refresh=True)
    assert len(runs) == 2
    monkeypatch.setenv(REFRESH_ENV, "1")
    probe_for_target(make_target())  # the disk's answer is not trusted
    probe_for_target(target)  # the process's own is
    assert len(runs) == 3


def test_the_cache_can_be_turned_off_and_follows_xdg(cache, monkeypatch, tmp_path):
    folder, runs = cache
    monkeypatch.setenv(CACHE_ENV, "off")
    assert probe_cache_dir() is None
    probe_for_target(make_target())
    probe_for_target(make_target())
    assert len(runs) == 2 and not folder.exists()
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert probe_cache_dir() == tmp_path / "xdg" / "eagle3_hf" / "probes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert probe_cache_dir() == tmp_path / "home" / ".cache" / "eagle3_hf" / "probes"


def test_an_unwritable_cache_warns_and_still_answers(cache, monkeypatch, tmp_path):
    folder, runs = cache
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "probes"))  # a folder inside a file cannot be made
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = probe_for_target(make_target())
    assert len(runs) == 1 and result.nodes > 1
    assert any("Could not keep" in str(w.message) for w in caught)
