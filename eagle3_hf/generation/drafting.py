"""Draft side of a decoding cycle for A rows: keep the draft's cache in step with what was verified, build trees.

Position bookkeeping, per row (P = the row's tokens in the target cache; the root, its last verified token, sits at
target position P and is not yet in the target cache):

* the draft's KV buffer (`DraftKV`) holds the row's pairs (target feature h_t, token x_{t+1}) for t < P - pending, at
  draft position t; its last output (at position P - 1) predicts the token after the root;
* rows advance at their own pace (each accepts its own path), so the buffer is shared column by column but not
  position by position: column c of row b holds a verified pair of that row when `valid[b, c]`, and is a hole
  otherwise (left padding, the unused part of a cycle's block); holes are masked out of every attention and never
  count towards a row's draft positions, so each row sees exactly what it would alone;
* tree nodes at depth d >= 1 are fed to the draft at position P + d - 1 with their parent's draft output as hidden
  state; their keys/values go to the buffer's slots after the verified ones, which the next tree overwrites.

Trees: greedy (EAGLE-2's dynamic tree, here) and sampled (sampled_trees.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eagle3_hf.generation.draft_step import DraftKV, draft_forward
from eagle3_hf.generation.tree import DraftTree
from eagle3_hf.modeling.masks import additive_mask
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel

__all__ = ["DraftState", "TreeBudget", "build_greedy_trees", "catch_up", "top_children"]


@dataclass
class TreeBudget:
    depth: int  # most draft tokens on one root-to-leaf path
    top_k: int  # children per expanded node, and expanded nodes per level
    total_tokens: int  # tree size including the root
    # Called before each extra level with (best frontier path probability summed over the rows, one row's nodes so
    # far); False stops growth.
    grow: Callable[[float, int], bool] | None = None


@dataclass
class DraftState:
    """Per-call draft state of the rows still decoding (row i of every tensor is active row i)."""

    kv: DraftKV | None = None  # created on first use, in the draft's dtype
    valid: torch.Tensor | None = None  # [A, kv.length] bool: the column holds a verified pair of that row
    positions: torch.Tensor | None = None  # [A] verified pairs per row: the next draft position
    last_hidden: torch.Tensor | None = None  # [A, 1, H] draft state at each row's last verified position
    last_logits: torch.Tensor | None = None  # [A, Vd]
    forward_calls: int = 0  # draft forwards run so far (the cost model times them)
    # verified pairs not yet run through the draft, as padded blocks: features [A, n, 3Ht], tokens [A, n], valid [A, n]
    pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def add_verified(self, features: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor) -> None:
        self.pending.append((features, next_tokens, valid))

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the active rows `rows` (indices into the current rows), e.g. when others finished."""
        if self.kv is not None:
            self.kv.select_rows(rows)
            self.valid, self.positions = self.valid[rows], self.positions[rows]
            self.last_hidden, self.last_logits = self.last_hidden[rows], self.last_logits[rows]
        self.pending = [(f[rows], t[rows], v[rows]) for f, t, v in self.pending]

    def compact(self, keep: int) -> None:
        """Drop holes: per row, its valid columns in order, right-aligned after the fewest holes any row needs (`keep`
        columns: the most pairs a row has, which the caller knows without reading `valid`)."""
        if self.kv is None:
            return
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.valid.shape[1] - keep :]
        self.valid = self.valid.gather(1, order)
        self.kv.gather_columns(order)

    def forward(
        self,
        draft: Eagle3DraftModel,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        visible: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`draft_forward` over S new columns per row, written after the verified columns and the F scratch columns
        fed before them this tree: each sees its row's verified pairs, and of the rest what `visible` `[A, S, F + S]`
        allows."""
        rows, new, width = visible.shape
        allowed = torch.cat([self.valid[:, None, :].expand(rows, new, -1), visible], dim=2)
        self.forward_calls += 1
        slot = self.kv.length + width - new
        return draft_forward(draft, self.kv, ids, hidden, positions, slot, additive_mask(allowed, hidden.dtype), rotary)


@torch.no_grad()
def catch_up(draft: Eagle3DraftModel, state: DraftState) -> None:
    """Run the draft over every row's pending verified pairs in one forward; refresh each row's last output."""
    if not state.pending:
        return
    features, tokens, valid = (torch.cat(blocks, dim=1) for blocks in zip(*state.pending))  # [A, n, 3Ht], [A, n] x2
    state.pending.clear()
    rows, n = tokens.shape
    device = tokens.device
    if state.kv is None:
        state.kv = DraftKV(draft, rows=rows)
        state.valid = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        state.positions = torch.zeros(rows, dtype=torch.long, device=device)
    hidden = draft.fuse(features.to(draft.fc.weight.dtype))
    # a pair sees the row's earlier pairs and itself; a hole sees only itself (an empty row would give NaNs)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    block = (causal[None] & valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=device)[None]
    positions = (state.positions[:, None] + valid.long().cumsum(dim=1) - 1).clamp(min=0)
    normed, feedback = state.forward(draft, tokens, hidden, positions, block)
    state.kv.length += n
    state.valid = torch.cat([state.valid, valid], dim=1)
    state.positions = state.positions + valid.sum(dim=1)
    # each row's last verified pair (every block gives each row at least one)
    last = n - 1 - valid.flip(1).long().argmax(dim=1)  # [A]
    picked = torch.arange(rows, device=device)
    state.last_hidden = feedback[picked, last][:, None]
    state.last_logits = draft.lm_head(normed[picked, last])


def top_children(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best draft ids of each row of `logits` `[..., Vd]` and their log-probabilities (fp32).

    One fused log-softmax (computed in fp32 from the bf16 logits without a separate cast) and one top-k: on CPU a
    top-k over the raw logits plus a logsumexp for the chosen values measured no faster, in more ops.
    """
    values, ids = torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(min(k, logits.shape[-1]), dim=-1)
    return ids, values


@torch.no_grad()
def build_greedy_trees(
    draft: Eagle3DraftModel, state: DraftState, roots: torch.Tensor, budget: TreeBudget
) -> list[DraftTree]:
    """EAGLE-2 dynamic trees for every active row at once (roots `[A]`): top-k expansion by cumulative draft
    log-probability, one draft forward per level for all rows, then each row's own global rerank.

    Every row expands the same number of nodes per level, so the levels need no padding; each node sits at its own
    row's draft position (`positions + level - 1`) and sees its row's verified pairs, its ancestors and itself.
    """
    device = roots.device
    rows, k = roots.numel(), budget.top_k
    cand_ids, cand_scores = top_children(state.last_logits, k)  # [A, k0] each
    k0 = cand_ids.shape[1]
    levels = [(cand_scores, cand_ids, torch.full_like(cand_ids, -1))]  # per level: scores, ids, parents [A, n] each
    frontier = torch.arange(k0, device=device).expand(rows, k0)  # indices into each row's flat candidate list
    frontier_scores, frontier_ids = cand_scores, cand_ids
    frontier_hidden = state.last_hidden.expand(rows, k0, -1)
    width = frontier_hidden.shape[-1]
    ancestors = torch.zeros(rows, k0, 0, dtype=torch.bool, device=device)  # [A, kf, fed]: over the nodes fed so far
    steps = torch.arange(budget.depth, device=device)
    cos, sin = draft.rotary_emb(frontier_hidden, state.positions[:, None] + steps[None])  # every level at once
    flat_count = k0
    for level in range(1, budget.depth):
        # the batch cost model weighs a level by every row's best frontier node together (one read per level)
        best = frontier_scores.max(dim=1).values.exp().sum() if budget.grow is not None else None
        if best is not None and not budget.grow(best.item(), flat_count):
            break
        kf = frontier.shape[1]
        eye = torch.eye(kf, dtype=torch.bool, device=device).expand(rows, kf, kf)
        ancestors = torch.cat([ancestors, eye], dim=2)
        normed, feedback = state.forward(
            draft,
            draft.draft_to_target_ids(frontier_ids),
            frontier_hidden,
            (state.positions + level - 1)[:, None].expand(rows, kf),
            ancestors,
            rotary=(cos[:, level - 1 : level], sin[:, level - 1 : level]),
        )
        child_ids, child_logp = top_children(draft.lm_head(normed), k)  # [A, kf, k] each
        child_scores = (frontier_scores[:, :, None] + child_logp).reshape(rows, -1)
        child_parents = frontier[:, :, None].expand_as(child_ids).reshape(rows, -1)
        levels.append((child_scores, child_ids.reshape(rows, -1), child_parents))
        best = child_scores.topk(min(k, child_scores.shape[1]), dim=1).indices  # [A, k]: the next frontier
        parent_rows = torch.div(best, child_ids.shape[2], rounding_mode="floor")
        frontier = flat_count + best
        flat_count += child_scores.shape[1]
        frontier_scores = child_scores.gather(1, best)
        frontier_ids = child_ids.reshape(rows, -1).gather(1, best)
        frontier_hidden = feedback.gather(1, parent_rows[:, :, None].expand(-1, -1, width))
        ancestors = ancestors.gather(1, parent_rows[:, :, None].expand(-1, -1, ancestors.shape[2]))
    scores, ids, parents = (torch.cat(parts, 1) for parts in zip(*levels))  # [A, N]
    kept, tree_parents = _rerank_rows(scores, parents, budget.total_tokens)  # [A, M], [A, 1 + M]
    tokens = torch.cat([roots[:, None].to(ids.dtype), draft.draft_to_target_ids(ids.gather(1, kept))], dim=1)
    kept_scores = torch.cat([torch.zeros(rows, 1, device=device), scores.gather(1, kept)], dim=1)
    return [DraftTree(tokens=tokens[row], parents=tree_parents[row], scores=kept_scores[row]) for row in range(rows)]


def _rerank_rows(scores: torch.Tensor, parents: torch.Tensor, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tree.cut_host` for every row at once on the device, unchecked (a row's scores never increase from parent to child: sums of
    log-probabilities; ties go to the lower index, a parent's), so nothing is read on the host. Returns the kept
    candidates `[A, M]` ascending and each row's tree parents `[A, 1 + M]`."""
    rows, candidates = scores.shape
    kept = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : min(candidates, total_tokens - 1)]
    kept = kept.sort(dim=1).values
    new_index = torch.zeros_like(parents)  # [A, N]: final node of each candidate (0: not kept)
    new_index.scatter_(1, kept, torch.arange(1, kept.shape[1] + 1, device=kept.device).expand_as(kept))
    kept_parents = parents.gather(1, kept)
    mapped = torch.where(kept_parents >= 0, new_index.gather(1, kept_parents.clamp(min=0)), 0)
    return kept, torch.cat([torch.full((rows, 1), -1, dtype=mapped.dtype, device=mapped.device), mapped], dim=1)
