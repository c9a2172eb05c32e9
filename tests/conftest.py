"""Shared test fixtures: one torch thread, and SmolLM2's real tokenizer as a cached plain folder."""

import pytest
import torch
from transformers import AutoTokenizer

from eagle3_hf.targets import SMOLLM2, cached_plain_copy


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
    return cached_plain_copy(SMOLLM2, folder, include_model=False)


@pytest.fixture
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)
