"""Linear layers with their weights prepacked for oneDNN's bf16 matmul on CPU (inference only).

A bf16 `nn.Linear` on a CPU with AMX or AVX-512 bf16 already runs oneDNN's bf16 matmul, but it receives the weight
in plain row-major layout and reorders it into the kernel's blocked layout on every call: for a small-batch
forward that reorder reads and writes the whole weight again, which is why a bf16 decoding step can cost more
than an fp32 one although it moves half the bytes. Reordering once, at load time, removes it. This is what
`torch.compile`'s CPU weight prepacking does; here it is done eagerly, module by module, on one model instance
that the caller names (nothing global is patched), with the same oneDNN kernel, so results are unchanged
(`prepack_linears` checks that on the first layer it packs and packs nothing if they are not bit-identical).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from eagle3_hf.modeling.head import Eagle3Head

__all__ = ["PackedLinear", "can_prepack", "prepack_linears"]


@functools.cache
def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if not (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    ):
        return False
    # oneDNN packs bf16 weights only on CPUs with bf16 instructions (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere
    # (an AVX2-only CPU) the reorder raises, so ask the CPU once with a tiny weight.
    try:
        mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=torch.bfloat16), 1)
    except RuntimeError:
        return False
    return True


def can_prepack(module: nn.Module) -> bool:
    """Whether `module` is a plain bias-free bf16 `nn.Linear` (or the draft's `Eagle3Head`) on CPU that oneDNN can
    prepack.

    Layers with a bias are left alone: for one-row inputs `nn.Linear` adds the bias in a separate rounding step, so
    a fused packed kernel would not match it bit for bit."""
    return (
        type(module) in (nn.Linear, Eagle3Head)
        and module.bias is None
        and module.weight.dtype == torch.bfloat16
        and module.weight.device.type == "cpu"
        and _ops_available()
    )


class PackedLinear(nn.Module):
    """`y = x W^T` with `W` held in oneDNN's blocked layout. Inference only: no gradients flow.

    `weight` stays as it was, so code that reads a layer's shape, dtype or device, and tied weights, keep working;
    the packed copy is what the matmul reads.
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 8) -> None:
        super().__init__()
        if not can_prepack(linear):
            raise ValueError(
                f"PackedLinear needs a bias-free bf16 nn.Linear on CPU and torch built with oneDNN; got "
                f"{type(linear).__name__} with weight {linear.weight.dtype} on {linear.weight.device}"
                f"{' and a bias' if linear.bias is not None else ''}."
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        # The hint only tunes the blocked layout; any batch size is computed correctly.
        self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"PackedLinear holds bf16 weights and takes bf16 inputs; got {x.dtype}.")
        flat = x.reshape(-1, self.in_features)  # [N, in]
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, None, "none", [None], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias=False"


def _packing_is_exact(linear: nn.Linear) -> bool:
    packed = PackedLinear(linear)
    with torch.no_grad():
        for rows in (1, 5):  # one decoding step, and a small tree
            probe = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(rows))
            probe = probe.to(torch.bfloat16)
            if not torch.equal(packed(probe), nn.functional.linear(probe, linear.weight)):
                return False
    return True


def prepack_linears(model: nn.Module) -> int:
    """Replace every prepackable `nn.Linear` inside `model` by a `PackedLinear`; return how many were replaced.

    Call it on a model that will only run inference (for instance a target and its draft before decoding): packed
    layers pass no gradients, and later changes to their weights are not seen. Layers that are not bf16, not on CPU
    or have a bias are left alone, and nothing is replaced when
    this torch build lacks the oneDNN ops or when a packed layer would not reproduce `nn.Linear` bit for bit.
    """
    candidates = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if can_prepack(child)
    ]
    if not candidates or not _packing_is_exact(candidates[0][2]):
        return 0
    for parent, name, child in candidates:
        setattr(parent, name, PackedLinear(child))
    return len(candidates)
