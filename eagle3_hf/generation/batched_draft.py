"""The draft side of batched EAGLE-3 decoding: one draft forward per tree level for every row of a batch.

Rows advance at their own pace (each accepts its own path), so the draft's KV buffer is shared column by column but
not position by position: column `c` of row `b` holds a verified (feature, next token) pair of that row when
`valid[b, c]`, and is a hole otherwise (left padding of the prompt, the unused part of a cycle's block). Holes are
masked out of every attention and never count towards a row's draft positions, so the draft sees each row exactly as
the batch-1 loop would (drafting.py), only laid out with gaps. Slots past `length` are scratch space for the tree
being drafted, as in `DraftKV`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from eagle3_hf.generation.draft_step import DraftKV
from eagle3_hf.generation.drafting import TreeBudget, top_children
from eagle3_hf.generation.tree import DraftTree, rerank
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, additive_mask

__all__ = ["BatchDraftKV", "BatchDraftState", "batched_draft_forward", "build_greedy_trees", "flush_rows"]


class BatchDraftKV(DraftKV):
    """`DraftKV` over A rows: keys and values `[num_layers, A, kv_heads, capacity, head_dim]` (`write` as there)."""

    def __init__(
        self, rows: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 512,
        num_layers: int = 1,
    ) -> None:  # fmt: skip
        super().__init__(kv_heads, head_dim, dtype, device, capacity=1, num_layers=num_layers)
        self.keys = torch.zeros(num_layers, rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    @classmethod
    def for_draft_rows(cls, draft: Eagle3DraftModel, rows: int, capacity: int = 512) -> BatchDraftKV:
        attn = draft.midlayer.self_attn
        weight = draft.lm_head.weight
        kv_heads = draft.config.num_key_value_heads or draft.config.num_attention_heads
        return cls(rows, kv_heads, attn.head_dim, weight.dtype, weight.device, capacity, len(draft.draft_layers()))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.keys = self.keys[:, rows]
        self.values = self.values[:, rows]

    def gather_columns(self, index: torch.Tensor) -> None:
        """Keep, per row, the columns `index` `[A, n]` (in that order) as columns `0..n-1`."""
        n = index.shape[1]
        layers, rows, heads, _, dim = self.keys.shape
        gather = index[None, :, None, :, None].expand(layers, rows, heads, n, dim)
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            buffer[:, :, :, :n] = buffer.gather(3, gather)  # gather copies first: source and target may overlap
        self.length = n


@dataclass
class BatchDraftState:
    """Per-call draft state of the rows still decoding (row i of every tensor is active row i)."""

    kv: BatchDraftKV | None = None
    valid: torch.Tensor | None = None  # [A, length] bool: the column holds a verified pair of that row
    positions: torch.Tensor | None = None  # [A] verified pairs per row: the next draft position
    last_hidden: torch.Tensor | None = None  # [A, 1, H] draft state at each row's last verified position
    last_logits: torch.Tensor | None = None  # [A, Vd]
    forward_calls: int = 0
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

    def compact(self) -> None:
        """Drop holes: per row, its valid columns in order, right-aligned after the fewest holes any row needs."""
        if self.kv is None:
            return
        index, self.valid = _right_aligned(self.valid)
        self.kv.gather_columns(index)


def _right_aligned(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column order `[A, n]` moving each row's valid columns (order kept) to the right end of `n = max valid` columns,
    and the new validity `[A, n]`."""
    keep = int(valid.sum(dim=1).max())
    order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, valid.shape[1] - keep :]
    return order, valid.gather(1, order)


def _attend_rows(q, keys, values, mask, scaling, softcap):
    """GQA attention over A rows, as draft_step's `_attend`: q `[A, h, S, d]`, keys/values `[A, kv, L, d]`, additive
    mask `[A, S, L]`. The query heads sharing a kv head are stacked along the query axis. Returns `[A, h, S, d]`."""
    rows, heads, seq, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = q.reshape(rows, kv_heads, groups * seq, dim)
    mask = mask.repeat(1, groups, 1)[:, None]  # [A, 1, g*S, L]
    if softcap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    else:  # Gemma-style logit soft-capping, which the fused kernel has no option for
        scores = torch.tanh(torch.matmul(q, keys.transpose(-1, -2)) * scaling / softcap) * softcap + mask
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype), values)
    return out.reshape(rows, heads, seq, dim)


def batched_draft_forward(
    draft: Eagle3DraftModel,
    kv: BatchDraftKV,
    input_ids: torch.Tensor,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slot: int,
    mask: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draft_step.draft_forward` over A rows: input_ids `[A, S]` (target ids), hidden `[A, S, H]`, positions
    `[A, S]`, keys/values written at slots `[slot, slot + S)` of every row, additive mask `[A, S, slot + S]`.

    Returns (the normed output `[A, S, H]`, for the head; the state to feed back `[A, S, H]`).
    """
    embeds = draft.embed_tokens(input_ids).to(hidden.dtype)
    rotary = rotary or draft.rotary_emb(hidden, positions)
    out = hidden
    for index, layer in enumerate(draft.draft_layers()):
        attn = layer.self_attn
        x, residual = layer.layer_input(embeds, out)
        q, k, v = layer.qkv(x, rotary)  # [A, h, S, d], [A, kv, S, d] x2
        keys, values = kv.write(slot, k, v, index)
        attended = _attend_rows(q, keys, values, mask, attn.scaling, getattr(attn, "attn_logit_softcapping", None))
        out = layer.finish(residual, attn.o_proj(attended.transpose(1, 2).reshape(*q.shape[:1], q.shape[2], -1)))
    normed = draft.norm(out)
    return normed, normed if draft.config.norm_output else out


@torch.no_grad()
def flush_rows(draft: Eagle3DraftModel, state: BatchDraftState) -> None:
    """Run the draft over every row's pending verified pairs in one forward; refresh each row's last output."""
    if not state.pending:
        return
    features = torch.cat([f for f, _, _ in state.pending], dim=1)  # [A, n, 3Ht]
    tokens = torch.cat([t for _, t, _ in state.pending], dim=1)  # [A, n]
    valid = torch.cat([v for _, _, v in state.pending], dim=1)  # [A, n]
    state.pending.clear()
    rows, n = tokens.shape
    device = tokens.device
    if state.kv is None:
        state.kv = BatchDraftKV.for_draft_rows(draft, rows)
        state.valid = torch.zeros(rows, 0, dtype=torch.bool, device=device)
        state.positions = torch.zeros(rows, dtype=torch.long, device=device)
    start = state.kv.length
    hidden = draft.fuse(features.to(draft.fc.weight.dtype))
    # a pair sees the row's earlier pairs and itself; a hole sees only itself (an empty row would give NaNs)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    block = (causal[None] & valid[:, None, :]) | torch.eye(n, dtype=torch.bool, device=device)[None]
    allowed = torch.cat([state.valid[:, None, :].expand(rows, n, start), block], dim=2)
    positions = (state.positions[:, None] + valid.long().cumsum(dim=1) - 1).clamp(min=0)
    state.forward_calls += 1
    normed, feedback = batched_draft_forward(draft, state.kv, tokens, hidden, positions, start,
                                             additive_mask(allowed, hidden.dtype))  # fmt: skip
    state.kv.length += n
    state.valid = torch.cat([state.valid, valid], dim=1)
    state.positions = state.positions + valid.sum(dim=1)
    # each row's last verified pair (every block gives each row at least one)
    last = n - 1 - valid.flip(1).long().argmax(dim=1)  # [A]
    picked = torch.arange(rows, device=device)
    state.last_hidden = feedback[picked, last][:, None]
    state.last_logits = draft.lm_head(normed[picked, last])


@torch.no_grad()
def build_greedy_trees(
    draft: Eagle3DraftModel, state: BatchDraftState, roots: torch.Tensor, budget: TreeBudget
) -> list[DraftTree]:
    """`drafting.build_greedy_tree` for every active row at once (roots `[A]`): top-k expansion by cumulative draft
    log-probability, one draft forward per level for all rows, then each row's own global rerank.

    Every row expands the same number of nodes per level, so the levels need no padding; each node sits at its own
    row's draft position (`positions + level - 1`) and sees its row's verified pairs, its ancestors and itself.
    """
    device = roots.device
    rows, k = roots.numel(), budget.top_k
    prefix = state.kv.length
    cand_ids, cand_scores = top_children(state.last_logits, k)  # [A, k0] each
    k0 = cand_ids.shape[1]
    all_scores, all_ids = [cand_scores], [cand_ids]
    all_parents = [torch.full_like(cand_ids, -1)]
    frontier = torch.arange(k0, device=device).expand(rows, k0)  # indices into each row's flat candidate list
    frontier_scores, frontier_ids = cand_scores, cand_ids
    frontier_hidden = state.last_hidden.expand(rows, k0, -1)
    width = frontier_hidden.shape[-1]
    ancestors = torch.zeros(rows, k0, 0, dtype=torch.bool, device=device)  # [A, kf, fed]: over fed nodes
    steps = torch.arange(budget.depth, device=device)
    cos, sin = draft.rotary_emb(frontier_hidden, state.positions[:, None] + steps[None])  # every level at once
    flat_count, fed = k0, 0
    for level in range(1, budget.depth):
        # the batch cost model weighs a level by every row's best frontier node together
        best = frontier_scores.max(dim=1).values.exp().sum().item()
        if budget.grow is not None and not budget.grow(best, flat_count):
            break
        kf = frontier.shape[1]
        eye = torch.eye(kf, dtype=torch.bool, device=device).expand(rows, kf, kf)
        ancestors = torch.cat([ancestors, eye], dim=2)
        allowed = torch.cat([state.valid[:, None, :].expand(rows, kf, prefix), ancestors], dim=2)
        state.forward_calls += 1
        normed, feedback = batched_draft_forward(
            draft, state.kv, draft.draft_to_target_ids(frontier_ids), frontier_hidden,
            (state.positions + level - 1)[:, None].expand(rows, kf), prefix + fed,
            additive_mask(allowed, frontier_hidden.dtype),
            rotary=(cos[:, level - 1 : level], sin[:, level - 1 : level]),
        )  # fmt: skip
        fed += kf
        child_ids, child_logp = top_children(draft.lm_head(normed), k)  # [A, kf, k] each
        child_scores = (frontier_scores[:, :, None] + child_logp).reshape(rows, -1)
        all_scores.append(child_scores)
        all_ids.append(child_ids.reshape(rows, -1))
        all_parents.append(frontier[:, :, None].expand_as(child_ids).reshape(rows, -1))
        best = child_scores.topk(min(k, child_scores.shape[1]), dim=1).indices  # [A, k]: the next frontier
        parent_rows = torch.div(best, child_ids.shape[2], rounding_mode="floor")
        frontier = flat_count + best
        flat_count += child_scores.shape[1]
        frontier_scores = child_scores.gather(1, best)
        frontier_ids = child_ids.reshape(rows, -1).gather(1, best)
        frontier_hidden = feedback.gather(1, parent_rows[:, :, None].expand(-1, -1, width))
        ancestors = ancestors.gather(1, parent_rows[:, :, None].expand(-1, -1, ancestors.shape[2]))
    scores, ids, parents = torch.cat(all_scores, 1), torch.cat(all_ids, 1), torch.cat(all_parents, 1)
    trees = []
    for row in range(rows):
        kept, tree_parents = rerank(scores[row], parents[row], budget.total_tokens)
        target_ids = draft.draft_to_target_ids(ids[row, kept])
        trees.append(DraftTree.from_parents(
            tokens=torch.cat([roots[row : row + 1].to(target_ids.dtype), target_ids]), parents=tree_parents,
            scores=torch.cat([torch.zeros(1, device=device), scores[row, kept]]),
        ))  # fmt: skip
    return trees
