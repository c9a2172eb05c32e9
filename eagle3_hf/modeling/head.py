"""The draft's head over its vocabulary: a bias-free linear layer whose call can also run a function of its weight.

Training computes the head and its loss in one function over every TTT step's rows (``head_cross_entropy``, in
`eagle3_hf.training.head_loss`), without the ``[M, Vd]`` logits the product alone would give. It still has to run
inside the head's own call: hooks around that call are what gather a sharded weight (FSDP2) and reduce its gradient.
So the head takes that function as an argument of its call, as the decoder layers take their attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Eagle3Head"]


class Eagle3Head(nn.Linear):
    """`lm_head`: ``[..., H] -> [..., Vd]``, an `nn.Linear` without bias (its state dict is ``weight`` alone).

    Called with a `weight_function`, it returns ``weight_function(hidden_states, self.weight, *args)`` instead of
    the product, computed inside its own call.
    """

    def forward(
        self, hidden_states: torch.Tensor, weight_function: Callable[..., Any] | None = None, *args: Any
    ) -> Any:
        if weight_function is None:
            return F.linear(hidden_states, self.weight, self.bias)
        return weight_function(hidden_states, self.weight, *args)
