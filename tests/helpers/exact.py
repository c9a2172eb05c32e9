"""bf16 targets wide enough to be row-invariant, and an MLP that is not, for row-exact verification's tests."""

import torch

from helpers.generation import FAMILIES, SHAPE

V = 256  # a larger vocabulary than test_generation's: bf16 near-ties between candidates become common

# Wider than test_generation's shapes: on this CPU a bf16 nn.Linear with 64 input features and 32-64 outputs is not
# row-invariant (1 row vs 18 can round differently); from 128 input features on it is, as in real targets.
BF16_SHAPE = dict(hidden_size=128, intermediate_size=256)


def bf16_target(family, implementation="sdpa", seed=0):
    model_class, config_class, extra = FAMILIES[family]
    extra = {k: v for k, v in extra.items() if k != "initializer_range"}  # default init: near-ties happen
    if "head_dim" in extra:
        extra = (
            {**extra, "head_dim": 32, "query_pre_attn_scalar": 32} if family == "gemma3" else {**extra, "head_dim": 32}
        )
    torch.manual_seed(seed)
    config = config_class(**{**SHAPE, **BF16_SHAPE, **extra, "vocab_size": V})
    config._attn_implementation = implementation
    return model_class(config).eval().to(torch.bfloat16)


class RowDependentMLP(torch.nn.Module):
    """An MLP whose rows round as if a kernel changed with the number of rows: exactness broken on purpose."""

    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        out = self.mlp(x)
        return out + 1e-2 * (x.shape[1] > 1)
