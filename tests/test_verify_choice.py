"""`exact_verify="auto"` (generation/verify_choice.py): row-exact verification where the row-invariance probe proves
it bit for bit, one tree-masked call where it does not; True warns once where the probe fails; the output says which
verification ran and why. Targets are made row-invariant on purpose (`rowwise_linears`), and one MLP row-dependent
on purpose, so both sides run on any CPU."""

import warnings

import pytest
import torch
from helpers.exact import RowDependentMLP, V, bf16_target
from helpers.exactness import rowwise_linears
from helpers.probes import (
    probes,  # noqa: F401 (fixture)
)

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.generation.verify_choice import PROVEN, check_exact_verify, choose_verification

NEW = 16


def exact_target():
    return rowwise_linears(bf16_target("llama"))


def broken_target():
    target = rowwise_linears(bf16_target("llama"))
    target.model.layers[1].mlp = RowDependentMLP(target.model.layers[1].mlp)
    return target


def generate(target, draft, **kwargs):
    prompt = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    return target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        **kwargs,
    )


def test_auto_runs_row_exact_where_the_probe_proves_it_and_output_equals_plain(probes):
    target = exact_target()
    torch.manual_seed(1)
    draft = bind_target(Eagle3DraftModel.from_target(target), target)
    out = generate(target, draft)
    assert out.verification == "row-exact" and out.verification_reason.startswith(PROVEN)
    assert "bit for bit" in out.verification_reason
    prompt_len = 9
    plain = type(target).generate(
        target,
        out.sequences[:, :prompt_len],
        attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
        do_sample=False,
        max_new_tokens=NEW,
    )
    assert out.sequences.tolist() == plain.tolist()
    generate(target, draft)  # the same setting: the probe is not run again
    assert len(probes) == 1


def test_auto_verifies_in_one_call_where_the_probe_fails(probes):
    target = broken_target()
    torch.manual_seed(1)
    draft = bind_target(Eagle3DraftModel.from_target(target), target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never warns: it chooses
        out = generate(target, draft)
    assert out.verification == "one-call"
    assert "not exact here" in out.verification_reason and "model.layers.1.mlp" in out.verification_reason
    assert len(probes) == 1


def test_forced_row_exact_where_the_probe_fails_warns_once_naming_the_hardware(probes):
    target = broken_target()
    torch.manual_seed(1)
    draft = bind_target(Eagle3DraftModel.from_target(target), target)
    with pytest.warns(
        UserWarning, match=r"exact_verify=True on hardware where .* first at model\.layers\.1\.mlp .*CPU"
    ):
        out = generate(target, draft, exact_verify=True)
    assert out.verification == "row-exact" and "not exact here" in out.verification_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(target, draft, exact_verify=True)  # once per setting
    assert len(probes) == 1


def test_off_runs_one_call_without_probing(probes):
    target = exact_target()
    torch.manual_seed(1)
    out = generate(target, bind_target(Eagle3DraftModel.from_target(target), target), exact_verify=False)
    assert out.verification == "one-call" and out.verification_reason == "exact_verify=False"
    assert probes == []


@pytest.mark.slow
def test_a_new_setting_is_probed_again(probes):
    target = exact_target()
    assert choose_verification(target).exact
    assert choose_verification(target).exact
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        choose_verification(target)
    finally:
        torch.set_num_threads(threads)
    assert len(probes) == 2


def test_batches_and_other_devices_verify_in_one_call_without_probing(probes):
    target = exact_target()
    choice = choose_verification(target, "auto", rows=4)
    assert not choice.exact and "batch of 4" in choice.reason
    target.config._attn_implementation = "flex_attention"  # an implementation row-exact verification does not cover
    choice = choose_verification(target)
    assert not choice.exact and "flex_attention" in choice.reason
    assert probes == []


def test_a_batch_reports_its_verification_and_refuses_forced_row_exact():
    target = exact_target()
    torch.manual_seed(1)
    draft = bind_target(Eagle3DraftModel.from_target(target), target)
    prompts = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(attention_mask=torch.ones_like(prompts), assistant_model=draft, do_sample=False, max_new_tokens=8)
    out = target.generate(prompts, return_dict_in_generate=True, **kwargs)
    assert out.verification == "one-call" and "batch of 2" in out.verification_reason
    with pytest.raises(ValueError, match=r"exact_verify=True\) supports batch size 1; got a batch of 2"):
        target.generate(prompts, exact_verify=True, **kwargs)


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_a_bad_setting_names_the_value(value):
    with pytest.raises(ValueError, match=rf"exact_verify must be 'auto', True or False; got {value!r}"):
        check_exact_verify(value)
    target = exact_target()
    torch.manual_seed(1)
    with pytest.raises(ValueError, match="exact_verify must be"):
        generate(target, bind_target(Eagle3DraftModel.from_target(target), target), exact_verify=value)


def test_none_means_auto():
    assert check_exact_verify(None) == "auto" and check_exact_verify(True) is True
