"""Sizing a batch's trees from measured costs: the batch-1 cost model (cost_model.py) with A rows per forward.

A verify forward over A rows of T nodes costs what one forward over `A * T` tokens costs, so the measured verify
cost stays a line `a + b * tokens`, now over every row's nodes. What a cycle buys is summed over the rows: verifying
the `n` best nodes of every row (the rows share one node count, since the forward costs the widest row anyway)
maximises

    (A + calibration * sum_rows sum_{i<n} p_{row,i}) / (draft_cost + verify_cost(A * (n + 1)))

against a plain batched step's `A / verify_cost(A)`. The wider the batch, the more a tree token costs next to a
plain step's token (verify_cost is no longer near-flat once `A * T` tokens fill the matmuls), so the trees shrink as
the batch grows, down to plain batched steps where speculation does not pay; the consultation back-off of the
batch-1 model then stops even consulting the draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_hf.generation.cost_model import CycleCostModel

__all__ = ["BatchCostModel"]


@dataclass
class BatchCostModel(CycleCostModel):
    """A `CycleCostModel` whose verify cost is over all rows' tokens and whose gains are summed over `rows`."""

    rows: int = 1  # active rows this cycle (set by the loop before each decision)

    @classmethod
    def for_batch(cls, device_type: str, dtype: torch.dtype) -> BatchCostModel:
        single = CycleCostModel.for_device(device_type, dtype)
        return cls(verify=single.verify, draft_step=single.draft_step)

    def plain_rate(self) -> float:
        """Tokens per second of a plain batched step."""
        return self.rows / self.verify(self.rows)

    def worth_drafting(self, top_probabilities: torch.Tensor) -> bool:
        """Whether verifying the `m` best depth-1 candidates of every row (`top_probabilities` `[A, k]`, best first)
        beats a plain batched step, for some m."""
        probs = torch.as_tensor(top_probabilities, dtype=torch.float64).cpu().reshape(self.rows, -1)
        gains = self.calibration * torch.cumsum(probs, dim=1).sum(dim=0)  # [k]: verifying m = 1..k per row
        a, b = self.verify.coefficients()
        tokens = self.rows * torch.arange(2, probs.shape[1] + 2, dtype=torch.float64)
        return bool(((self.rows + gains) / (a + b * tokens)).max() > self.plain_rate())

    def worth_deeper(self, best_path_probability: float, nodes_so_far: int) -> bool:
        """Whether one more level pays: `best_path_probability` is summed over the rows' best frontier nodes,
        `nodes_so_far` counts one row's candidates; the level costs a draft step over the rows and `rows` more
        verified tokens."""
        per_token = self.verify(self.rows) / self.rows  # what a token is worth, in a plain step's time
        gain = self.calibration * best_path_probability * per_token
        width = self.rows * (nodes_so_far + 1)
        return gain > self.draft_step(self.rows) + (self.verify(width + self.rows) - self.verify(width))

    def choose_size(self, path_probabilities: torch.Tensor, draft_seconds: float) -> tuple[int, float]:
        """Best node count per row (root excluded) given every row's node path probabilities `[A, N]`, each row sorted
        in keep order, and the draft time already spent. Returns (n, predicted accepted tokens over the rows)."""
        probs = path_probabilities.double().cpu()
        cumulative = torch.cumsum(probs, dim=1).sum(dim=0)  # [N]
        gains = torch.cat([torch.zeros(1, dtype=torch.float64), self.calibration * cumulative])
        n = torch.arange(0, probs.shape[1] + 1, dtype=torch.float64)
        a, b = self.verify.coefficients()
        rates = (self.rows + gains) / (draft_seconds + a + b * self.rows * (n + 1))
        best = int(torch.argmax(rates))
        return best, float(cumulative[best - 1]) if best > 0 else 0.0

