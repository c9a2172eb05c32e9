"""Shared test fixtures: one torch thread, the devices to run on, SmolLM2's real tokenizer as a cached plain folder,
a tiny chat target."""

import contextlib
import json
import os
import pathlib

import pytest
import torch
from helpers.devices import DEVICE_DTYPES, DEVICES
from transformers import AutoTokenizer

from eagle3_hf.modeling.shipped import SMOLLM2
from eagle3_hf.targets import cached_plain_copy
from eagle3_hf.utils import tiny

# The tests never read or write the user's cache of row-invariance probe answers (generation/probe_cache.py): an
# answer kept from another checkout or torch build must not decide a test, and tests write nothing into $HOME. Tests
# of that cache point it at a temporary folder; subprocesses (the CLI's tests) inherit this.
os.environ["EAGLE3_HF_PROBE_CACHE"] = "off"
os.environ.pop("EAGLE3_HF_REFRESH_PROBE", None)


def _dtype_id(case: tuple[str, torch.dtype]) -> str:
    return f"{case[0]}-{str(case[1]).removeprefix('torch.')}"


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Each device the tests can run on: ``"cpu"``, and ``"cuda"`` when available."""
    return request.param


@pytest.fixture(params=DEVICE_DTYPES, ids=[_dtype_id(c) for c in DEVICE_DTYPES])
def device_dtype(request) -> tuple[str, torch.dtype]:
    """``(device, dtype)``: the CPU in fp32, and CUDA (when available) in fp32, fp16 and bf16 (where supported)."""
    return request.param


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls on a busy 2-core machine: a second thread spends its time waiting (one thread is far faster).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer_dir(request, tmp_path_factory):
    # The pytest cache keeps the plain copy between sessions: parsing the GGUF tokenizer takes several seconds.
    cache = getattr(request.config, "cache", None)
    folder = cache.mkdir("eagle3_hf_smollm2_tokenizer") if cache else tmp_path_factory.mktemp("smollm2_tokenizer")
    with _exclusive(pathlib.Path(folder).with_suffix(".lock")):  # parallel workers write the first copy once
        return cached_plain_copy(SMOLLM2, folder, include_model=False)


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path):
    """Hold an exclusive lock on `lock_path` (a file) while the block runs; a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # Windows: the tests run in one process there unless asked otherwise
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_setup():
    """The tiny target, a draft whose 40-id vocabulary is counted on the rows, and 5 synthetic rows of 12, 10, 8, 6
    and 4 tokens (so that collated batches carry padding)."""
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.training.trainer import install_draft_vocab

    target = tiny.make_tiny_target()
    rows = tiny.synthetic_dataset(num_rows=5, seq_len=12)
    rows = rows.map(
        lambda r, i: {k: r[k][: 12 - 2 * i] for k in ("input_ids", "loss_mask", "attention_mask")}, with_indices=True
    )
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=40)
    install_draft_vocab(draft, rows)
    return target, draft, rows


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny random Llama with a chat-template tokenizer saved as a plain folder, and a ShareGPT JSONL for it."""
    folder = tmp_path_factory.mktemp("tiny_chat_target")
    tiny.write_tiny_chat_target(str(folder))
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny.tiny_sharegpt()))
    return folder, data


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks it adds
def pytest_collection_modifyitems(config, items):
    # The fast tier (`-m "not slow"`) runs the first case of each `grid` test: every law still runs there, on one
    # family, tree or setting; the full suite runs every case. `grid(by=("expect",))` keeps the first case of each
    # value of those parameters (the exact and near-tie cases, one of which the CPU's probe skips at run time).
    seen: set[tuple] = set()
    for item in items:
        marker = item.get_closest_marker("grid")
        if marker is None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        key = (item.nodeid.split("::")[0], item.originalname, *(params.get(p) for p in marker.kwargs.get("by", ())))
        if key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)
