"""Sampled draft trees for A rows, one draft forward per level.

The rule that keeps recursive rejection sampling exact (verification.py): a node's children are drawn without
replacement from the draft distribution stored for it, every drawn child is kept, and which nodes grow (and how
many children they get) is decided before drawing them -- whether a node exists never depends on its own sampled
value, only on its ancestors and on nodes drawn before it (a reranking by score, as greedy trees get, would keep a
child because its sampled token scored well and so bias acceptance). Each tree carries `draft_probs` `[T, V]`: row
i is the draft distribution (target vocabulary) node i's children were drawn from. Rows differ in how many nodes
they expand at a level (their budgets and supports differ), so each level feeds `kf = max` rows' frontiers, shorter
frontiers padded with dummy rows that see only themselves; every level's nodes take `kf` fresh scratch columns after
the verified pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eagle3_hf.generation.drafting import DraftState, TreeBudget
from eagle3_hf.generation.tree import DraftTree, HostTree, read_on_host, sample_children
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel

__all__ = ["build_sampled_trees"]


@dataclass
class _RowTree:
    """One row's tree as it grows."""

    tokens: list[int]
    draft_probs: torch.Tensor  # [1 + budget, V]: row i, node i's children's draft distribution (zeros: a leaf)
    parents: list[int] = field(default_factory=lambda: [-1])
    scores: list[float] = field(default_factory=lambda: [0.0])
    hidden_of: dict[int, torch.Tensor] = field(default_factory=dict)  # node -> its parent's draft output [H]
    column: dict[int, int] = field(default_factory=dict)  # fed node -> its scratch column (after the prefix)
    level_nodes: list[int] = field(default_factory=list)
    remaining: int = 0

    def add_children(
        self, node: int, q_draft: torch.Tensor, hidden: torch.Tensor, top_k: int, to_target: torch.Tensor
    ) -> list[int]:
        """Draw `node`'s children from `q_draft` `[Vd]` (ids mapped by `to_target`), to be fed `hidden` `[H]`."""
        self.draft_probs[node, to_target] = q_draft
        count = min(top_k, self.remaining, int((q_draft > 0).sum()))
        ids = sample_children(torch.log(q_draft), count)  # draft ids, draw order
        tokens, log_q = read_on_host([to_target[ids], torch.log(q_draft[ids])])  # one read
        new = []
        for token, value in zip(tokens, log_q):
            self.parents.append(node)
            self.scores.append(self.scores[node] + value)
            self.tokens.append(int(token))
            new.append(len(self.parents) - 1)
            self.hidden_of[new[-1]] = hidden
        self.remaining -= len(new)
        return new


@torch.no_grad()
def build_sampled_trees(
    draft: Eagle3DraftModel,
    state: DraftState,
    roots: torch.Tensor,
    budget: TreeBudget,
    temperature: float,
    totals: list[int] | None = None,
) -> list[DraftTree]:
    """A sampled tree per active row (roots `[A]`) of at most `totals[row]` nodes (default `budget.total_tokens`),
    root included, each carrying `draft_probs` `[T, V]`."""
    device = roots.device
    to_target = draft.draft_to_target_ids(torch.arange(state.last_logits.shape[-1], device=device))
    q_root = torch.softmax(state.last_logits.float() / temperature, dim=-1)  # [A, Vd]
    rows: list[_RowTree] = []
    for r, root in enumerate(roots.tolist()):
        total = budget.total_tokens if totals is None else totals[r]
        row = _RowTree([root], torch.zeros(total, draft.config.vocab_size, device=device), remaining=total - 1)
        row.level_nodes = row.add_children(0, q_root[r], state.last_hidden[r, 0], budget.top_k, to_target)
        rows.append(row)
    fed = 0  # scratch columns fed so far, after the verified ones
    for level in range(1, budget.depth):
        frontiers = [_frontier(row, budget) for row in rows]
        kf = max(len(f) for f in frontiers)
        if kf == 0:
            break
        allowed = torch.zeros(len(rows), kf, fed + kf, dtype=torch.bool, device=device)
        tokens = torch.zeros(len(rows), kf, dtype=torch.long, device=device)
        hidden = state.last_hidden.new_zeros(len(rows), kf, state.last_hidden.shape[-1])
        for r, (row, frontier) in enumerate(zip(rows, frontiers)):
            for i, node in enumerate(frontier):
                a = row.parents[node]
                while a > 0:  # its fed ancestors
                    allowed[r, i, row.column[a]] = True
                    a = row.parents[a]
                row.column[node] = fed + i
                tokens[r, i] = row.tokens[node]
                hidden[r, i] = row.hidden_of[node]
        allowed[:, :, fed:] |= torch.eye(kf, dtype=torch.bool, device=device)  # itself (dummy rows: only itself)
        normed, feedback = state.forward(
            draft, tokens, hidden, (state.positions + level - 1)[:, None].expand(-1, kf), allowed
        )
        fed += kf
        q_levels = torch.softmax(draft.lm_head(normed).float() / temperature, dim=-1)  # [A, kf, Vd]
        for r, (row, frontier) in enumerate(zip(rows, frontiers)):
            next_level: list[int] = []
            for i, node in enumerate(frontier):
                if row.remaining <= 0:
                    break
                next_level.extend(row.add_children(node, q_levels[r, i], feedback[r, i], budget.top_k, to_target))
            row.level_nodes = next_level  # (a row with no frontier is out of budget or stopped: [] changes nothing)
    return [DraftTree.on_host(HostTree(r.tokens, r.parents, r.scores), r.draft_probs[: len(r.parents)]) for r in rows]


def _frontier(row: _RowTree, budget: TreeBudget) -> list[int]:
    """The nodes this row expands at the next level: its best `top_k` of the current one (none once out of budget)."""
    if row.remaining <= 0 or not row.level_nodes:
        return []
    best = max(row.scores[n] for n in row.level_nodes)
    if budget.grow is not None and not budget.grow(float(torch.tensor(best).exp()), len(row.parents) - 1):
        row.level_nodes = []
        return []
    return sorted(row.level_nodes, key=lambda n: (-row.scores[n], n))[: budget.top_k]
