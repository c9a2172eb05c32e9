"""Draft side of one EAGLE-3 decoding cycle: keep the draft's cache in step, build the draft tree.

Position bookkeeping (P = number of tokens in the target cache, root = the last verified token,
which sits at target position P and is not yet in the target cache):

* the draft cache holds pairs (target feature h_t, token x_{t+1}) for t < P - pending, at draft
  position t; its last output (at position P-1) predicts the token after the root;
* tree nodes at depth d >= 1 are fed to the draft at position P + d - 1 with their parent's
  draft output as `hidden_states`; they are appended to the draft cache while the tree grows
  and cropped away afterwards (only verified pairs stay).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, additive_mask
from eagle3_hf.generation.tree import DraftTree, expand_topk, rerank, sample_children, select_frontier


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (works across transformers 5.x releases)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


@dataclass
class DraftState:
    """Per-call state of the draft: its cache and the output at the last verified position."""

    cache: DynamicCache
    length: int = 0  # positions held by the draft cache
    forward_calls: int = 0  # draft forwards run so far (the cost model times them)
    last_hidden: torch.Tensor | None = None  # [1, 1, H] draft state at position length-1
    last_logits: torch.Tensor | None = None  # [Vd] draft logits at position length-1
    # Verified (feature, next token) pairs not yet run through the draft (drafting was skipped).
    pending_features: list[torch.Tensor] = field(default_factory=list)  # each [1, n, 3Ht]
    pending_tokens: list[torch.Tensor] = field(default_factory=list)  # each [1, n]

    def add_verified(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.pending_features.append(features)
        self.pending_tokens.append(next_tokens)


@torch.no_grad()
def flush_pending(draft: Eagle3DraftModel, state: DraftState) -> None:
    """Run the draft over all pending verified pairs in one forward; refresh its last output."""
    if not state.pending_tokens:
        return
    features = torch.cat(state.pending_features, dim=1)
    tokens = torch.cat(state.pending_tokens, dim=1)
    state.pending_features.clear()
    state.pending_tokens.clear()
    n = tokens.shape[1]
    positions = torch.arange(state.length, state.length + n, device=tokens.device)[None]
    state.forward_calls += 1
    out = draft(
        input_ids=tokens,
        target_hidden_states=features.to(draft.fc.weight.dtype),
        position_ids=positions,
        cache=state.cache,
        logits_to_keep=1,
    )
    state.length += n
    state.last_hidden = out.last_hidden_state[:, -1:]
    state.last_logits = out.logits[0, -1]


def _tree_step_mask(
    ancestors: torch.Tensor, prefix_length: int, dtype: torch.dtype
) -> torch.Tensor:
    """Mask `[1, 1, k, prefix + fed]` for k frontier nodes: whole prefix + their fed ancestors and themselves."""
    k = ancestors.shape[0]
    allowed = torch.cat(
        [torch.ones(k, prefix_length, dtype=torch.bool, device=ancestors.device), ancestors], dim=1
    )
    return additive_mask(allowed[None, None], dtype)


@dataclass
class TreeBudget:
    depth: int  # most draft tokens on one root-to-leaf path
    top_k: int  # children per expanded node, and expanded nodes per level
    total_tokens: int  # tree size including the root
    # Called before each extra level with (best frontier path probability, nodes so far); False stops growth.
    grow: Callable[[float, int], bool] | None = None


@torch.no_grad()
def build_greedy_tree(
    draft: Eagle3DraftModel, state: DraftState, root_token: int, budget: TreeBudget
) -> DraftTree:
    """EAGLE-2 dynamic tree: top-k expansion by cumulative draft log-probability, then global rerank."""
    device = state.last_logits.device
    k = budget.top_k
    logp = torch.log_softmax(state.last_logits.float(), dim=-1)
    cand_scores, cand_ids = logp.topk(min(k, logp.numel()))  # depth-1 candidates
    all_scores = [cand_scores]
    all_ids = [cand_ids]
    all_parents = [torch.full_like(cand_ids, -1)]
    # frontier: candidate indices (into the flat candidate list), their hidden inputs and tokens
    frontier = torch.arange(cand_ids.numel(), device=device)
    frontier_scores = cand_scores
    frontier_hidden = state.last_hidden.expand(1, cand_ids.numel(), -1)
    ancestors = torch.zeros(cand_ids.numel(), 0, dtype=torch.bool, device=device)  # over fed nodes
    flat_ids = cand_ids
    flat_count = cand_ids.numel()
    fed = 0
    for level in range(1, budget.depth):
        if budget.grow is not None and not budget.grow(frontier_scores.max().exp().item(), flat_count):
            break
        kf = frontier.numel()
        ancestors = torch.cat([ancestors, torch.eye(kf, dtype=torch.bool, device=device)], dim=1)
        tokens = draft.draft_to_target_ids(flat_ids[frontier])[None]
        positions = torch.full((1, kf), state.length + level - 1, device=device)
        state.forward_calls += 1
        out = draft(
            input_ids=tokens,
            hidden_states=frontier_hidden,
            position_ids=positions,
            attention_mask=_tree_step_mask(ancestors, state.length, frontier_hidden.dtype),
            cache=state.cache,
        )
        fed += kf
        step_logp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [kf, Vd]
        child_ids, child_scores = expand_topk(frontier_scores, step_logp, k)  # [kf, k] each
        all_scores.append(child_scores.reshape(-1))
        all_ids.append(child_ids.reshape(-1))
        all_parents.append(frontier[:, None].expand_as(child_ids).reshape(-1))
        best, rows = select_frontier(child_scores, k)
        frontier = flat_count + best
        flat_count += child_ids.numel()
        flat_ids = torch.cat([flat_ids, child_ids.reshape(-1)])
        frontier_scores = child_scores.reshape(-1)[best]
        frontier_hidden = out.last_hidden_state[:, rows]
        ancestors = ancestors[rows]
    crop_cache(state.cache, state.length)
    scores = torch.cat(all_scores)
    parents = torch.cat(all_parents)
    kept, tree_parents = rerank(scores, parents, budget.total_tokens)
    target_ids = draft.draft_to_target_ids(flat_ids[kept])
    root = torch.tensor([root_token], device=device, dtype=target_ids.dtype)
    return DraftTree.from_parents(
        tokens=torch.cat([root, target_ids]),
        parents=tree_parents,
        scores=torch.cat([torch.zeros(1, device=device), scores[kept]]),
    )


@torch.no_grad()
def build_sampled_tree(
    draft: Eagle3DraftModel,
    state: DraftState,
    root_token: int,
    budget: TreeBudget,
    temperature: float,
    generator: torch.Generator | None = None,
) -> DraftTree:
    """A tree whose children are drawn without replacement from the draft distribution at `temperature`.

    Every drawn child is kept (in draw order): whether a node exists never depends on its own sampled value, only
    on its ancestors and on nodes drawn before it, which keeps recursive rejection sampling exact. The tree carries
    `draft_probs` `[T, V]`: row i is the draft distribution (target vocabulary) node i's children were drawn from.
    """
    device = state.last_logits.device
    vocab = draft.config.vocab_size
    remaining = budget.total_tokens - 1
    tokens: list[torch.Tensor] = [torch.tensor([root_token], device=device)]
    parents: list[int] = [-1]
    scores: list[float] = [0.0]
    q_rows: dict[int, torch.Tensor] = {}

    def draft_probs_over_target(logits: torch.Tensor) -> torch.Tensor:  # [n, Vd] -> [n, V]
        q = torch.softmax(logits.float() / temperature, dim=-1)
        full = torch.zeros(q.shape[0], vocab, device=device)
        full[:, draft.draft_to_target_ids(torch.arange(q.shape[-1], device=device))] = q
        return full

    def add_children(node: int, q_draft: torch.Tensor, count: int) -> list[int]:
        ids = sample_children(torch.log(q_draft), count, generator)  # draft ids, draw order
        new = []
        for d in ids.tolist():
            parents.append(node)
            scores.append(scores[node] + float(torch.log(q_draft[d])))
            tokens.append(draft.draft_to_target_ids(torch.tensor([d], device=device)))
            new.append(len(parents) - 1)
        return new

    q_root = torch.softmax(state.last_logits.float() / temperature, dim=-1)
    q_rows[0] = draft_probs_over_target(state.last_logits[None])[0]
    count = min(budget.top_k, remaining, int((q_root > 0).sum()))
    level_nodes = add_children(0, q_root, count)
    remaining -= len(level_nodes)
    hidden_of = {n: state.last_hidden[0, 0] for n in level_nodes}  # parent's draft output per node
    fed_index: dict[int, int] = {}
    for level in range(1, budget.depth):
        if remaining <= 0 or not level_nodes:
            break
        best = max(scores[n] for n in level_nodes)
        if budget.grow is not None and not budget.grow(float(torch.tensor(best).exp()), len(parents) - 1):
            break
        # expand the best `top_k` nodes of this level, ranked by cumulative draft log-probability
        frontier = sorted(level_nodes, key=lambda n: (-scores[n], n))[: budget.top_k]
        kf = len(frontier)
        fed_before = len(fed_index)
        anc = torch.zeros(kf, fed_before + kf, dtype=torch.bool, device=device)
        for row, node in enumerate(frontier):
            a = parents[node]
            while a > 0:
                anc[row, fed_index[a]] = True
                a = parents[a]
            anc[row, fed_before + row] = True
        for row, node in enumerate(frontier):
            fed_index[node] = fed_before + row
        state.forward_calls += 1
        out = draft(
            input_ids=torch.cat([tokens[n] for n in frontier])[None],
            hidden_states=torch.stack([hidden_of[n] for n in frontier])[None],
            position_ids=torch.full((1, kf), state.length + level - 1, device=device),
            attention_mask=_tree_step_mask(anc, state.length, state.last_hidden.dtype),
            cache=state.cache,
        )
        q_levels = torch.softmax(out.logits[0].float() / temperature, dim=-1)  # [kf, Vd]
        q_full = draft_probs_over_target(out.logits[0])
        next_level: list[int] = []
        for row, node in enumerate(frontier):
            if remaining <= 0:
                break
            count = min(budget.top_k, remaining, int((q_levels[row] > 0).sum()))
            q_rows[node] = q_full[row]
            children = add_children(node, q_levels[row], count)
            remaining -= len(children)
            for c in children:
                hidden_of[c] = out.last_hidden_state[0, row]
            next_level.extend(children)
        level_nodes = next_level
    crop_cache(state.cache, state.length)
    n_nodes = len(parents)
    draft_probs = torch.zeros(n_nodes, vocab, device=device)
    for node, row in q_rows.items():
        draft_probs[node] = row
    return DraftTree.from_parents(
        tokens=torch.cat(tokens),
        parents=torch.tensor(parents, device=device),
        scores=torch.tensor(scores, device=device),
        draft_probs=draft_probs,
    )
