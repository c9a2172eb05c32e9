"""The decoding loop's state and contracts, apart from the code that runs them, so that nothing imports back.

A call's state is split by who owns it:
- `Emission` (emission.py writes it): the output buffer, each row's tokens, lengths and stopping, the streamer's
  progress and the scores the output keeps;
- `CycleStats` (engine.record_cycle writes it): per row and cycle what was verified and accepted, and the times;
- `DecodeRun`, the loop's own (engine.py): the target, its cache and columns, the proposer, the options, the cost
  model and its clock, the roots on the device -- holding the other two.

A proposer (proposers.py) never sees the run: each call hands it a `CycleView`, what a proposer may read of the
cycle (the options, the active rows' sequences and roots, the cost model it consults and feeds its draft timings,
the clock), and it answers with a `Proposal`. engine.py, emission.py and proposers.py import this module and not
each other (tests/test_layout.py fails on an import circle in generation/, type-only imports included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from eagle3_hf.generation.cost_model import CycleCostModel
from eagle3_hf.generation.drafting import TreeBudget
from eagle3_hf.generation.exact_attention import ExactAttention
from eagle3_hf.generation.hybrid import RowTree
from eagle3_hf.generation.target_cache import TargetColumns
from eagle3_hf.generation.transfers import Clock
from eagle3_hf.generation.verification import AcceptResult

__all__ = ["CycleRecord", "CycleStats", "CycleView", "DecodeRun", "Emission", "Proposal", "Proposer"]


@dataclass
class CycleRecord:
    """What one cycle did, handed to the call's `eagle3_observer` (e.g. scripts/research/cycle_profile.py). Only what
    the loop knows anyway: the times are those the cost model measures; nothing else is timed for an observer."""

    past: int  # target cache columns before the cycle
    rows: list[int]  # the rows that took part (indices into the batch)
    tree_sizes: list[int]  # per row: nodes verified, root included
    emitted: list[int]  # per row: tokens it appended
    parents: list[list[int]]  # per row: its tree's parents
    draft_s: float  # proposing (the draft's forwards, the lookup, sizing)
    verify_s: float  # the target forward, acceptance and the cache and proposer updates
    consulted: bool  # whether the draft was consulted


@dataclass
class Emission:
    """What emission owns: every row's output so far and how it stops. "Rows" are the B prompts; "active" rows those
    still decoding, in the order of the caches' rows."""

    out: torch.Tensor  # [B, capacity] every row's sequence so far (the padded prompt included)
    lengths: list[int]  # tokens of `out` per row
    tokens: list[list[int]]  # the host's copy of each row's `out[row, :lengths[row]]` (the loop never reads `out`)
    starts: list[int]  # left padding per row (the target and the lookup never see it)
    stopping_criteria: StoppingCriteriaList
    pad_token_id: int | None
    pad_finished: bool  # plain generate() pads finished rows only when an EOS criterion is present
    max_length: int
    streamer: Any = None
    output_scores: bool = False
    output_logits: bool = False
    # set from `out` and `lengths` by __post_init__
    stop_lengths: list[int | None] = field(init=False)  # a row's length when a criterion fired
    active: list[int] = field(init=False)
    streamed: int = field(init=False)  # columns of `out` handed to the streamer
    prompt_length: int = field(init=False)  # columns of the padded prompt
    scores: list[list[torch.Tensor]] = field(init=False)  # output_scores: per row, one [V] per token
    raw_logits: list[list[torch.Tensor]] = field(init=False)  # output_logits: likewise

    def __post_init__(self) -> None:
        rows = self.batch_size
        self.stop_lengths, self.active = [None] * rows, list(range(rows))
        self.streamed = self.prompt_length = self.lengths[0]
        self.scores, self.raw_logits = [[] for _ in range(rows)], [[] for _ in range(rows)]

    @property
    def device(self) -> torch.device:
        return self.out.device

    @property
    def batch_size(self) -> int:
        return self.out.shape[0]

    def roots(self) -> list[int]:
        """Each active row's last token: the root of its next tree."""
        return [self.tokens[row][-1] for row in self.active]

    def longest_cached(self) -> int:
        """The most tokens an active row holds in the target cache (every output token but the last, no padding)."""
        return max(self.lengths[row] - self.starts[row] for row in self.active) - 1

    def new_tokens(self) -> list[list[int]]:
        """Each row's generated tokens (its prompt left out)."""
        return [tokens[self.prompt_length :] for tokens in self.tokens]


@dataclass
class CycleStats:
    """What the cycles did, per row and cycle, and the call's times (the output's statistics)."""

    rows: int
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    accept_lengths: list[list[int]] = field(init=False)  # per row, per cycle: tokens it added
    tree_sizes: list[list[int]] = field(init=False)  # per row, per cycle: nodes verified (root included)
    accept_sources: list[list[tuple[int, int, int, int]]] = field(init=False)  # per row, per cycle

    def __post_init__(self) -> None:
        self.accept_lengths = [[] for _ in range(self.rows)]
        self.tree_sizes = [[] for _ in range(self.rows)]
        self.accept_sources = [[] for _ in range(self.rows)]


@dataclass(frozen=True)
class CycleView:
    """What a proposer may read of the current cycle (never the run itself): the tree options, the active rows'
    sequences and roots, and the cost model it consults and feeds its draft timings, with the clock to time them.
    A live view, valid during the call it is handed to (the loop builds a new one for every call)."""

    budget: TreeBudget
    do_sample: bool
    temperature: float
    adaptive_tree: bool
    device: torch.device
    cost: CycleCostModel
    clock: Clock
    root_ids: torch.Tensor | None  # [A] each active row's last token on the device (None before the prefill's)
    _emission: Emission = field(repr=False)

    @property
    def rows(self) -> int:
        """Active rows this cycle."""
        return len(self._emission.active)

    def roots(self) -> list[int]:
        """Each active row's last token (the root of its tree), from the host's copy."""
        return self._emission.roots()

    def sequence(self, i: int) -> list[int]:
        """Active row `i`'s tokens so far, its left padding left out (a copy)."""
        row = self._emission.active[i]
        return self._emission.tokens[row][self._emission.starts[row] :]

    def longest_cached(self) -> int:
        """The most tokens an active row holds in the target cache."""
        return self._emission.longest_cached()


@dataclass
class Proposal:
    """A cycle's proposal: a tree per active row, or None for a plain step of every row."""

    rows: list[RowTree] | None = None
    consulted: bool = False  # the draft was consulted (the cost model scores what that gained)


class Proposer:
    """The interface the decoding loop calls (proposers.py). `needs_hidden_states`: whether the loop must ask the
    target for its hidden states (the draft reads them; a lookup does not)."""

    needs_hidden_states = False

    def prefill(
        self, view: CycleView, features: torch.Tensor | None, next_tokens: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """What the prompt's forward gave: per row and prompt column, the tapped features `[A, N, 3Ht]` (None without
        hidden states), the token that follows `[A, N]`, and whether the column is a real token `[A, N]`."""

    def propose(self, view: CycleView, roots: torch.Tensor) -> Proposal:
        """A tree per active row, rooted at `roots` `[A]` (each row's last token, on the device)."""
        raise NotImplementedError

    def observe(
        self,
        view: CycleView,
        proposal: Proposal,
        results: list[AcceptResult],
        features: torch.Tensor | None,
        tokens: torch.Tensor,
        keep: torch.Tensor,
    ) -> None:
        """Each active row's accepted path (`results`), and per row the accepted tokens' features `[A, W, 3Ht]` with
        the token that follows each `[A, W]` (`keep` `[A, W]`: the column is one of the row's). The proposal's trees
        carry their `host` lists by then."""

    def select_rows(self, rows: list[int], index: torch.Tensor) -> None:
        """Only the active rows `rows` (indices into the current ones; `index`, the same on the device) go on (the
        others finished)."""

    def finish(self, outputs: list[list[int]]) -> None:
        """The call is over: `outputs`, each row's generated tokens."""


@dataclass
class DecodeRun:
    """The loop's own state for one decoding call, holding what emission owns (`emission`) and the statistics
    (`stats`)."""

    model: PreTrainedModel
    proposer: Proposer
    logits_processor: LogitsProcessorList
    budget: TreeBudget
    cache: DynamicCache  # the target's
    layer_ids: list[int]  # the target layers the draft reads (empty without a draft)
    emission: Emission
    do_sample: bool = False
    temperature: float = 1.0
    adaptive_tree: bool = True
    cost: CycleCostModel = field(default_factory=CycleCostModel)
    exact: ExactAttention | None = None  # row-exact verification (one row); None: one tree-masked call
    observer: Callable[[CycleRecord], None] | None = None  # told what each cycle did (research scripts); None: nobody
    columns: TargetColumns | None = None
    root_ids: torch.Tensor | None = None  # [A] each active row's last token on the device: the next trees' roots
    stats: CycleStats = field(init=False)
    clock: Clock = field(init=False)  # the cost model's clock on the run's device

    def __post_init__(self) -> None:
        self.stats = CycleStats(self.emission.batch_size)
        self.clock = Clock(self.device)

    @property
    def device(self) -> torch.device:
        return self.emission.device

    @property
    def active(self) -> list[int]:
        return self.emission.active

    def view(self) -> CycleView:
        """What the proposer may read of this cycle."""
        return CycleView(
            budget=self.budget,
            do_sample=self.do_sample,
            temperature=self.temperature,
            adaptive_tree=self.adaptive_tree,
            device=self.device,
            cost=self.cost,
            clock=self.clock,
            root_ids=self.root_ids,
            _emission=self.emission,
        )
