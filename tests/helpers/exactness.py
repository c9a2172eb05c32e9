"""Probe-first bf16 exactness for the tests: what a test may assert depends on what this CPU's kernels do.

Row-exact verification gives every tree node the attention call of its own one-token step, so a tree forward equals
one-token steps bit for bit only where the rest of the target (its projections, MLP and head) is row-invariant: a
bf16 matmul over 16 rows giving the 1-row result bit for bit. That holds on the AMX Xeons measured, and not on an AMD
EPYC with avx512_bf16 and no AMX, where SmolLM2's `mlp.down_proj` rounds 16 rows differently from one. So a test of
bf16 exactness asks the row-invariance probe first (`probe_row_exactness`, what `bench` runs):

- **exact**: the probe proves the verify forward reproduces one-token steps: the test asserts token identity or
  bitwise equality, as it always did;
- **near-tie**: it does not: the test asserts what the package promises there: the probe names the first op that
  differs, and every greedy divergence from plain output is a near-tie of the fp32 target (its top-2 margin below
  `NEAR_TIE_ULPS` ulps of the decoded precision, as `bench` measures it).

Each such test is parametrized by the case (`EXPECTATIONS`) and skips the one the probe did not choose, with the
probe's own answer as the reason, so the test id says which case ran and the skip says why the other did not.
`rowwise_linears` makes a target row-invariant on purpose (every linear layer computed one row at a time), which lets
a test reach the exact case on any CPU.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from eagle3_hf.bench.report import NEAR_TIE_ULPS, divergence
from eagle3_hf.generation.probe import ProbeResult
from eagle3_hf.generation.verify_choice import probe_for_target

EXPECTATIONS = ("exact", "near-tie")

_scorers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its fp32 copy


def expectation(probe: ProbeResult) -> str:
    """The case a probe result puts a test in: "exact" where row-exact verification was proven bit for bit."""
    return "exact" if probe.identical and probe.exact_verify else "near-tie"


def probe_for(target: nn.Module) -> ProbeResult:
    """The row-exact probe of `target` in its current setting: the one `exact_verify="auto"` asks, and its cache."""
    return probe_for_target(target)


def case(target: nn.Module, expect: str) -> ProbeResult:
    """The probe's result if it puts `target` in case `expect`; otherwise skips, saying which case runs instead."""
    if expect not in EXPECTATIONS:
        raise ValueError(f"expect must be one of {EXPECTATIONS}, got {expect!r}")
    probe = probe_for(target)
    chosen = expectation(probe)
    if chosen != expect:
        pytest.skip(f"the {chosen} case runs on this CPU: {probe.describe()}")
    return probe


def fp32_scorer(target: nn.Module) -> nn.Module:
    """An fp32 copy of `target` (its own weights, widened exactly): the reference `divergence` measures margins on."""
    if target not in _scorers:
        _scorers[target] = copy.deepcopy(target).float().eval()
    return _scorers[target]


def assert_near_ties(
    target,
    prompt: torch.Tensor,
    reference: list[int],
    other: list[int],
    probe: ProbeResult,
    label: str = "",
    scorer: nn.Module | None = None,
) -> dict | None:
    """The near-tie case's promise for one greedy output: the probe names the op that breaks exactness, and where
    `other` (a continuation of `prompt` `[1, P]`) leaves `reference`, the fp32 target's top-2 margin there is below
    `NEAR_TIE_ULPS` ulps of `target`'s precision. Returns the divergence (None when the outputs agree)."""
    assert probe.first_difference, f"{label}: the probe found a difference but named no op ({probe.describe()})"
    if other == reference:
        return None
    found = divergence(scorer or fp32_scorer(target), prompt, reference, other, same_precision=target)
    assert found is not None
    assert found["margin_ulps"] < NEAR_TIE_ULPS, (
        f"{label}: output left plain greedy at token {found['position']} where the fp32 target's top-2 margin is "
        f"{found['margin_ulps']:.1f} ulp (>= {NEAR_TIE_ULPS:g}): not a rounding flip ({probe.describe()})"
    )
    return found


class RowwiseLinear(nn.Linear):
    """`nn.Linear` computed one row at a time: row-invariant by construction, whatever the CPU's matmul kernels do
    with several rows (each row is the 1-row call a one-token step makes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = torch.cat([F.linear(row[None], self.weight, self.bias) for row in rows])  # [N, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])


def rowwise_linears(model: nn.Module) -> nn.Module:
    """Turn every `nn.Linear` of `model` into a `RowwiseLinear` in place (same parameters); returns `model`."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowwiseLinear
    return model
