"""Sizing each decoding cycle from measured costs and the draft's own confidence.

EAGLE-2 observed that a draft's cumulative path probability estimates how likely a tree node is to be accepted. With
verify costs measured on this device, that turns tree sizing into a small optimisation: verify the n best nodes
maximising

    (1 + calibration * sum_{i<n} p_i) / (draft_cost + verify_cost(n + 1))

where draft_cost is what the cycle's drafting actually took; a tree is started only when verifying some of the
draft's best next tokens beats a plain step (`worth_drafting`), and grown a level only when that level's best node
pays for its draft step (`worth_deeper`). The calibration factor (measured accepted / predicted accepted) corrects
drafts that are over- or under-confident. Consulting the draft costs a draft step even when it then declines, so a
poor draft would still cost a few percent: each consultation is scored by the tokens it gained over plain decoding
in the same time (negative for a declined one), and while the recent consultations together lose, the draft is not
even consulted for a growing number of tokens (exponential backoff). A useful draft that declines at unsure tokens
keeps being consulted, because its drafted cycles win more than its declines cost. A batch's cycles that verify trees
are scored the same way (`Backoff`), and while they lose the batch takes plain steps without asking the proposer at
all (`plain_due`): there a tree's tokens are dear next to a plain step's, and a cycle's lookups cost too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch


@dataclass
class LinearCost:
    """Running least-squares fit of seconds = a + b * n over recent observations."""

    prior_a: float
    prior_b: float
    samples: deque = field(default_factory=lambda: deque(maxlen=64))  # recent observations only: load drifts

    def observe(self, n: int, seconds: float) -> None:
        self.samples.append((float(n), float(seconds)))

    def coefficients(self) -> tuple[float, float]:
        # plain floats: the fit runs on the host every cycle and must read no tensor (transfers.py)
        if not self.samples:
            return self.prior_a, self.prior_b
        xs, ts = [s[0] for s in self.samples], [s[1] for s in self.samples]
        xm, tm = sum(xs) / len(xs), sum(ts) / len(ts)
        if max(xs) - min(xs) < 1.0:  # all at one size: the level is known, the slope ratio is the prior's
            scale = tm / max(self.prior_a + self.prior_b * xm, 1e-9)
            return max(self.prior_a * scale, 1e-9), self.prior_b * scale
        b = sum((x - xm) * (t - tm) for x, t in zip(xs, ts)) / sum((x - xm) ** 2 for x in xs)
        b = max(b, 0.0)
        a = max(tm - b * xm, 1e-9)
        return a, b

    def __call__(self, n: int) -> float:
        a, b = self.coefficients()
        return a + b * n


# Priors before a call has measured anything, per (device type, dtype): verify cost a + b*n relative to one token
# (a = 1) and one draft level relative to one token. Measured with a ~135M-parameter target and its one-layer draft
# (scripts/research/verify_cost.py, scripts/research/draft_step_cost.py): on a CPU with bf16 matmul units,
# verifying 32 tokens costs ~1.5x one token in bf16 but ~3x in fp32; on a GPU a few dozen tokens cost about one.
# They only shape the first cycles and the slope while every cycle verifies one size: measured times replace them.
_PRIORS: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    ("cpu", torch.float32): (1.0 / 15, 0.10),
    ("cpu", torch.bfloat16): (1.0 / 60, 0.05),
    ("cpu", torch.float16): (1.0 / 15, 0.10),
}
_GPU_PRIOR = (1.0 / 200, 0.10)
# At batch > 1, cycles between plain steps measuring what one costs now (the context grows; one plain step in this
# many cycles forgoes at most one cycle's gain: ~1.5% where a batch drafts every cycle)
PLAIN_REFRESH = 64


@dataclass
class Backoff:
    """Exponential backoff over scored decisions: each score is the tokens a decision gained over plain decoding in
    the same time; while the recent ones together lose, the next `skip` chances are passed, twice as many each time
    (at most `max_skip`), and one that pays again resets it."""

    max_skip: int = 32
    scores: deque = field(default_factory=lambda: deque(maxlen=16))
    skip: int = 0
    next_skip: int = 1

    def score(self, net_tokens: float) -> None:
        self.scores.append(net_tokens)
        if sum(self.scores) >= 0.0:
            self.next_skip, self.skip = 1, 0
        else:
            self.skip = self.next_skip
            self.next_skip = min(self.next_skip * 2, self.max_skip)

    def allow(self) -> bool:
        """Whether to take this chance (each refusal uses up one of the skips)."""
        if self.skip > 0:
            self.skip -= 1
            return False
        return True


@dataclass
class CycleCostModel:
    """Per-call scheduler state, for one prompt or a batch of `rows`. Costs are in seconds; only their ratios matter.

    A verify forward over A rows of T nodes costs what one forward over `A * T` tokens costs, so the measured verify
    cost is a line `a + b * tokens` over every row's nodes, and what a cycle buys is summed over the rows: verifying
    the `n` best nodes of every row (the rows share one node count: the forward costs the widest row anyway)
    maximises `(A + calibration * sum_rows sum_{i<n} p_{row,i}) / (draft_cost + verify_cost(A * (n + 1)))` against
    a plain step's `A / verify_cost(A)`. With A = 1 that is the formula of the module docstring; as the batch grows a
    tree token costs more next to a plain step's, so trees shrink, down to plain batched steps.

    A batch's plain step is measured apart from the line (`plain`, seconds against rows, from the cycles that verify
    the roots alone): a plain step of a batch is one forward whose width the line, fit mostly at tree widths, does not
    follow (on a CPU 4 rows' plain step costs about what one row's does, and their first extra node each 1.3x it), so
    the line alone overrates a plain step and with it every tree. At batch > 1 a plain step is taken whenever that
    measurement is missing or `PLAIN_REFRESH` cycles old (`plain_due`): it costs what plain decoding costs.

    The default priors (before measurements arrive) are a middle ground: verifying 16 tokens costs ~1.5x one token,
    one draft step ~15% of a target step; `for_device` gives the ones measured for a device and precision.
    """

    verify: LinearCost = field(default_factory=lambda: LinearCost(prior_a=1.0, prior_b=1.0 / 30))
    draft_step: LinearCost = field(default_factory=lambda: LinearCost(prior_a=0.15, prior_b=0.0))
    accepted: float = 0.0  # measured accepted draft tokens (excluding bonus)
    predicted: float = 0.0  # sum of predicted acceptance for the same cycles
    prior_weight: float = 2.0  # pseudo-cycles of calibration 1.0 before measurements dominate
    # the draft's consultations, scored by `after_consultation`: not consulted for a while when they lose
    consultations: Backoff = field(default_factory=Backoff)
    # a batch's cycles that verified trees or consulted the draft, scored by `after_tree_cycle`: plain steps for a
    # while when they lose (no proposer asked: its lookups and bookkeeping cost a batch a few percent of a step)
    trees: Backoff = field(default_factory=Backoff)
    rows: int = 1  # rows decoding this cycle (a batch's loop sets it before each decision)
    plain: LinearCost | None = None  # measured plain steps, seconds against rows (None: the verify line's prior)
    since_plain: int = 0  # cycles since the last plain step

    def __post_init__(self) -> None:
        if self.plain is None:
            self.plain = LinearCost(prior_a=self.verify.prior_a, prior_b=self.verify.prior_b)

    @classmethod
    def for_device(cls, device_type: str, dtype: torch.dtype) -> CycleCostModel:
        """A cost model whose priors fit verifying in `dtype` on a `device_type` ("cpu", "cuda", ...) device."""
        slope, draft = _PRIORS.get((device_type, dtype), _GPU_PRIOR if device_type != "cpu" else (1.0 / 30, 0.15))
        return cls(verify=LinearCost(prior_a=1.0, prior_b=slope), draft_step=LinearCost(prior_a=draft, prior_b=0.0))

    @property
    def calibration(self) -> float:
        return (self.accepted + self.prior_weight) / (self.predicted + self.prior_weight)

    def record_cycle(self, predicted: float, accepted: int) -> None:
        self.predicted += predicted
        self.accepted += accepted

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A verify forward of `rows` rows `width` nodes wide took `seconds` (width 1: a plain step)."""
        self.verify.observe(rows * width, seconds)
        if width == 1:
            self.plain.observe(rows, seconds)
            self.since_plain = 0
        else:
            self.since_plain += 1

    def plain_step(self) -> float:
        """Seconds of a plain step over every row: for a batch measured where plain steps ran, else the verify line's
        (one row's: its verify cost is nearly flat over a tree's width, and the line fits its plain step)."""
        return self.plain(self.rows) if self.rows > 1 and self.plain.samples else self.verify(self.rows)

    def plain_due(self) -> bool:
        """Whether this cycle of a batch should be a plain step, without asking the proposer: to measure one (see the
        class docstring), or because the batch's recent trees lost (`after_tree_cycle`). One row never skips here:
        its tree nodes cost little next to its plain step, and its draft has its own backoff (`consult_draft`)."""
        if self.rows == 1:
            return False
        return not self.plain.samples or self.since_plain >= PLAIN_REFRESH or not self.trees.allow()

    def plain_rate(self) -> float:
        """Tokens per second of a plain step over every row."""
        return self.rows / self.plain_step()

    def worth_drafting(self, top_probabilities: torch.Tensor | list | float) -> bool:
        """Whether verifying the `m` best depth-1 candidates of every row (`top_probabilities` `[k]` or `[A, k]`, most
        likely first) beats a plain step, for some m. Those candidates come from the draft output already computed,
        so they cost only the wider verify; deeper levels must pay for their draft steps themselves (`worth_deeper`).
        That is `choose_size` with no draft time spent choosing more than the roots (whose rate is a plain step's)."""
        return self.choose_size(top_probabilities, 0.0)[0] > 0

    def worth_deeper(self, best_path_probability: float, nodes_so_far: int) -> bool:
        """Whether one more draft level can pay: its best node (`best_path_probability`, summed over the rows' best
        frontier nodes) must be worth more than a draft step over the rows and `rows` more verified tokens
        (`nodes_so_far` counts one row's candidates)."""
        per_token = self.plain_step() / self.rows  # what a token is worth, in a plain step's time
        gain = self.calibration * best_path_probability * per_token
        width = self.rows * (nodes_so_far + 1)
        return gain > self.draft_step(self.rows) + (self.verify(width + self.rows) - self.verify(width))

    def choose_size(self, path_probabilities: torch.Tensor | list | float, draft_seconds: float) -> tuple[int, float]:
        """Best number of non-root nodes to verify per row, given node path probabilities `[N]` (or `[A, N]`, a row
        each; a tensor or lists, rows of unequal length padded with zeros) sorted in keep order (a prefix is always a
        valid tree) and the draft time this cycle already spent. Returns (n, predicted accepted tokens over the rows);
        n = 0 verifies the roots alone (the draft's work is then wasted, but a wider verify would lose more)."""
        if isinstance(path_probabilities, torch.Tensor):  # a host tensor (the loop hands lists: it reads nothing)
            path_probabilities = path_probabilities.double().cpu().tolist()
        values = path_probabilities if isinstance(path_probabilities, list) else [path_probabilities]
        rows = values if values and isinstance(values[0], list) else [values]
        if len(rows) != self.rows:  # one flat list for several rows: `rows` equal chunks
            flat = [p for row in rows for p in row]
            size = len(flat) // self.rows
            rows = [flat[i * size : (i + 1) * size] for i in range(self.rows)]
        width = max(len(row) for row in rows)
        cumulative = [0.0] * width  # [N]: summed over the rows, each row's running total
        for row in rows:
            total = 0.0
            for i in range(width):
                total += row[i] if i < len(row) else 0.0
                cumulative[i] += total
        a, b = self.verify.coefficients()
        calibration = self.calibration
        best, best_rate = 0, self.rows / (draft_seconds + self.plain_step())
        for n in range(1, width + 1):
            rate = (self.rows + calibration * cumulative[n - 1]) / (draft_seconds + a + b * self.rows * (n + 1))
            if rate > best_rate:  # the first of equal rates, as argmax takes it
                best, best_rate = n, rate
        return best, cumulative[best - 1] if best > 0 else 0.0

    def after_consultation(self, net_tokens: float) -> None:
        """Score a consultation -- tokens it produced minus what plain decoding would have produced in the same time
        (`(accepted + rows) - seconds * plain_rate()` for a drafted cycle, `-draft_seconds * plain_rate()` for a
        declined one) -- and back off exponentially while the recent consultations together lose."""
        self.consultations.score(net_tokens)

    def consult_draft(self) -> bool:
        return self.consultations.allow()

    def after_tree_cycle(self, net_tokens: float) -> None:
        """Score a batch's cycle that verified trees or consulted the draft (`tokens - seconds * plain_rate()`), and
        take plain steps, exponentially more of them, while the recent ones together lose."""
        self.trees.score(net_tokens)
