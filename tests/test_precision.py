"""Precision auto-detection, the thread default, and prepacked bf16 linear layers."""

import pytest
import torch
from torch import nn

from eagle3_hf.modeling.packed_linear import PackedLinear, can_prepack, prepack_linears
from eagle3_hf.utils.precision import (
    cpu_flags,
    default_threads,
    emulated_bf16_warning,
    has_native_bf16_matmul,
    resolve_dtype,
    short_name,
)


def test_cpu_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n\n")
    assert cpu_flags(str(info)) == {"fpu", "sse2", "avx2", "amx_bf16", "amx_tile"}
    assert cpu_flags(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize(
    "flags, expected",
    [
        ({"avx2", "avx512f", "amx_bf16"}, torch.bfloat16),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx2", "fma", "avx512f", "avx512bw"}, torch.float32),
        (set(), torch.float32),
    ],
    ids=["amx", "avx512-bf16", "no-bf16-units", "unknown-cpu"],
)
def test_auto_precision_follows_the_cpu(flags, expected):
    if expected == torch.bfloat16 and not torch.backends.mkldnn.is_available():
        expected = torch.float32  # bf16 units are reached through oneDNN; without it, fp32
    assert has_native_bf16_matmul(flags) == (expected == torch.bfloat16)
    assert resolve_dtype("auto", "cpu", flags=flags) == expected


def test_explicit_precision_wins_and_bad_names_are_refused():
    assert resolve_dtype("float32", "cpu", flags={"amx_bf16"}) == torch.float32
    assert resolve_dtype("bfloat16", "cpu", flags=set()) == torch.bfloat16
    assert resolve_dtype("auto", "meta", flags={"amx_bf16"}) == torch.float32  # neither CPU nor CUDA: fp32
    with pytest.raises(ValueError, match=r"Unknown dtype 'bf16'; expected one of auto, float32, bfloat16"):
        resolve_dtype("bf16")
    assert [short_name(d) for d in (torch.float32, torch.bfloat16, torch.float16)] == ["fp32", "bf16", "fp16"]
    with pytest.raises(ValueError, match="float64"):
        short_name(torch.float64)
    assert default_threads() >= 1


def test_bf16_asked_for_on_a_cpu_that_emulates_it_is_warned_about():
    message = emulated_bf16_warning("bfloat16", "cpu", flags={"avx2", "fma"})
    assert "--dtype bfloat16 on a CPU without native bf16 matmul" in message and "--dtype float32" in message
    assert emulated_bf16_warning("float32", "cpu", flags={"avx2"}) is None
    assert emulated_bf16_warning("bfloat16", "cuda", flags={"avx2"}) is None  # the GPU decides, not the CPU
    if torch.backends.mkldnn.is_available():
        assert emulated_bf16_warning("bfloat16", "cpu", flags={"avx2", "amx_bf16"}) is None


def test_prepacked_linears_compute_exactly_what_nn_linear_does():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(40, 24, bias=False),
        nn.ReLU(),
        nn.Linear(24, 16, bias=False),
        nn.Linear(16, 8),
        nn.Linear(8, 8, bias=False),
    )
    model[:4].to(torch.bfloat16)  # left alone: layer 3 (a bias) and layer 4 (fp32)
    x = torch.randn(2, 5, 40).to(torch.bfloat16)
    with torch.no_grad():
        before = model[4](model[:4](x).float())
        replaced = prepack_linears(model)
        after = model[4](model[:4](x).float())
    if not can_prepack(nn.Linear(2, 2, bias=False).to(torch.bfloat16)):
        assert replaced == 0  # this torch build has no oneDNN prepacking: nothing changes
        return
    assert replaced == 2
    assert [type(m) for m in model] == [PackedLinear, nn.ReLU, PackedLinear, nn.Linear, nn.Linear]
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="takes bf16 inputs; got torch.float32"):
        model[0](torch.randn(1, 40))
    with pytest.raises(ValueError, match="needs a bias-free bf16 nn.Linear on CPU.*weight torch.float32"):
        PackedLinear(nn.Linear(4, 4, bias=False))
