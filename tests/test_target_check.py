"""The draft-fits-target check (`Eagle3DraftConfig.check_target_config`) runs once per load or bind and once per
generate() call, and a draft of another target fails with its one clear error wherever it meets the target."""

from __future__ import annotations

import subprocess
import sys
from unittest import mock

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_hf import Eagle3DraftConfig, Eagle3DraftModel, bind_target

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def make_target(vocab_size: int = 96) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, vocab_size=vocab_size)).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A target and a draft for it saved as a folder (with its embedding)."""
    target = make_target()
    folder = tmp_path_factory.mktemp("draft")
    Eagle3DraftModel.from_target(target).save_pretrained(folder)
    return target, folder


@pytest.fixture
def checks():
    """`check_target_config`, still checking, with its calls counted."""
    real = Eagle3DraftConfig.check_target_config
    with mock.patch.object(Eagle3DraftConfig, "check_target_config", autospec=True, side_effect=real) as counted:
        yield counted


def test_once_per_load_or_bind(saved, checks):
    target, folder = saved
    Eagle3DraftModel.from_pretrained(folder, target=target)
    assert checks.call_count == 1
    checks.reset_mock()
    Eagle3DraftModel.from_target(target)
    assert checks.call_count == 1
    checks.reset_mock()
    draft = Eagle3DraftModel.from_pretrained(folder)
    assert checks.call_count == 0
    bind_target(draft, target)
    assert checks.call_count == 1


def test_once_per_generate_call(saved, checks):
    target, folder = saved
    draft = bind_target(Eagle3DraftModel.from_pretrained(folder), target)
    checks.reset_mock()
    ids = torch.randint(0, 96, (1, 5))
    target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, do_sample=False, max_new_tokens=3)
    assert checks.call_count == 1


def test_a_draft_of_another_target_fails_once_with_the_clear_error(saved, checks):
    _, folder = saved
    other = make_target(vocab_size=104)
    with pytest.raises(ValueError, match=r"built for another target: .*vocabulary size 104 \(draft expects 96\)"):
        Eagle3DraftModel.from_pretrained(folder, target=other)
    assert checks.call_count == 1
    draft = Eagle3DraftModel.from_pretrained(folder)  # no target: nothing checked, nothing routed
    ids = torch.randint(0, 96, (1, 5))
    bind_target(Eagle3DraftModel.from_target(other), other)  # routes `other.generate`
    checks.reset_mock()
    with pytest.raises(ValueError, match="built for another target"):
        other.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=3)
    assert checks.call_count == 1


def test_a_draft_fits_its_target_without_the_decoding_loop_loaded():
    """Loading and fitting need nothing above `modeling/`: no registry, nothing imported behind the user's back."""
    code = f"""
import sys
from transformers import LlamaConfig, LlamaForCausalLM
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
target = LlamaForCausalLM(LlamaConfig(**{SHAPE!r}, vocab_size=96))
draft = Eagle3DraftModel.from_target(target)
print("generation loaded:", "eagle3_hf.generation" in sys.modules)
print("generate routed:", "generate" in vars(target))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "generation loaded: False" in out.stdout
    assert "generate routed: False" in out.stdout


def test_an_unbound_target_says_how_to_bind_it(saved):
    """Loading a draft for a target does not route its generate(); the stock path's error names `bind_target`."""
    target, folder = saved
    other = make_target()  # never bound (the module fixture's target may have been)
    draft = Eagle3DraftModel.from_pretrained(folder, target=other)
    ids = torch.randint(0, 96, (1, 5))
    with pytest.raises(AttributeError, match=r"eagle3_hf\.bind_target\(draft, target\)"):
        other.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=3)
    bind_target(draft, other)
    out = other.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft, max_new_tokens=3)
    assert torch.equal(out, other.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3))


def test_bind_target_refuses_what_it_cannot_bind(saved):
    target, _ = saved
    with pytest.raises(ValueError, match="bind_target expects an Eagle3DraftModel or a ContextLookup, got str"):
        bind_target("draft", target)
