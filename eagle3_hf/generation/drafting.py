"""Draft side of one EAGLE-3 decoding cycle: keep the draft's cache in step, build the draft tree.

Position bookkeeping (P = number of tokens in the target cache, root = the last verified token,
which sits at target position P and is not yet in the target cache):

* the draft's KV buffer (`DraftKV`) holds pairs (target feature h_t, token x_{t+1}) for t < P - pending, at draft
  position t; its last output (at position P-1) predicts the token after the root;
* tree nodes at depth d >= 1 are fed to the draft at position P + d - 1 with their parent's draft output as
  hidden state; their keys/values go to the buffer's slots after the verified ones, which the next tree
  overwrites (only verified pairs count towards its length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from eagle3_hf.generation.draft_step import DraftKV, causal_block, draft_forward
from eagle3_hf.generation.timing import NO_TIMER, NullTimer
from eagle3_hf.generation.tree import DraftTree, rerank, sample_children
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer (works across transformers 5.x releases)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def editable_cache(cache: Any) -> DynamicCache:
    """The target cache to decode into; refuse caches whose entries cannot be selected and cropped."""
    if cache is None:
        return DynamicCache()
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"EAGLE-3 tree decoding edits the target KV cache (keeps only accepted tree nodes); a "
            f"{type(cache).__name__} cannot be edited that way. Use the default DynamicCache (no cache_implementation)."
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            f"EAGLE-3 decoding needs the target's hidden states for the whole prompt, so it prefills it itself; got a "
            f"cache already holding {cache.get_seq_length()} tokens. Pass no cache (or an empty DynamicCache)."
        )
    # A fresh cache: use plain full-attention layers, which can drop rejected nodes; sliding-window layers are
    # instead masked by the tree mask.
    return DynamicCache()


def keep_cache_entries(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Move entries `start + keep` to `start, start+1, ...` and drop the rest (the accepted path of a tree).

    Entries already in place (a root-only cycle, or a path along the first nodes) are not copied, and nothing is
    cropped when nothing follows them: per layer that is four tensor ops saved on every plain step."""
    n = keep.numel()
    if keep.tolist() != list(range(n)):
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                layer.keys[..., start : start + n, :] = layer.keys[..., start + keep, :]
                layer.values[..., start : start + n, :] = layer.values[..., start + keep, :]
    if cache.get_seq_length() > start + n:
        crop_cache(cache, start + n)


@dataclass
class DraftState:
    """Per-call state of the draft: its KV buffer and the output at the last verified position."""

    kv: DraftKV | None = None  # created on first use, in the draft's dtype
    forward_calls: int = 0  # draft forwards run so far (the cost model times them)
    last_hidden: torch.Tensor | None = None  # [1, 1, H] draft state at position length-1
    last_logits: torch.Tensor | None = None  # [Vd] draft logits at position length-1
    # Verified (feature, next token) pairs not yet run through the draft (drafting was skipped).
    pending_features: list[torch.Tensor] = field(default_factory=list)  # each [1, n, 3Ht]
    pending_tokens: list[torch.Tensor] = field(default_factory=list)  # each [1, n]

    @property
    def length(self) -> int:
        """Verified positions held by the draft's KV buffer."""
        return 0 if self.kv is None else self.kv.length

    def add_verified(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.pending_features.append(features)
        self.pending_tokens.append(next_tokens)


@torch.no_grad()
def flush_pending(draft: Eagle3DraftModel, state: DraftState) -> None:
    """Run the draft over all pending verified pairs in one forward; refresh its last output."""
    if not state.pending_tokens:
        return
    if state.kv is None:
        state.kv = DraftKV.for_draft(draft)
    features = torch.cat(state.pending_features, dim=1)
    tokens = torch.cat(state.pending_tokens, dim=1)
    state.pending_features.clear()
    state.pending_tokens.clear()
    n, start = tokens.shape[1], state.kv.length
    hidden = draft.fuse(features.to(draft.fc.weight.dtype))
    mask = causal_block(start, n, hidden.dtype, hidden.device) if n > 1 else None
    positions = torch.arange(start, start + n, device=tokens.device)
    state.forward_calls += 1
    logits, out = draft_forward(draft, state.kv, tokens, hidden, positions, start, mask, logits_to_keep=1)
    state.kv.length += n
    state.last_hidden = out[:, -1:]
    state.last_logits = logits[-1]


def top_children(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best draft ids of each row of `logits` `[n, Vd]` and their log-probabilities (fp32), `([n, k], [n, k])`.

    One fused log-softmax (computed in fp32 from the bf16 logits without a separate cast) and one top-k: on CPU a
    top-k over the raw logits plus a logsumexp for the chosen values measured no faster, in more ops.
    """
    values, ids = torch.log_softmax(logits, dim=-1, dtype=torch.float32).topk(min(k, logits.shape[-1]), dim=-1)
    return ids, values


@dataclass
class TreeBudget:
    depth: int  # most draft tokens on one root-to-leaf path
    top_k: int  # children per expanded node, and expanded nodes per level
    total_tokens: int  # tree size including the root
    # Called before each extra level with (best frontier path probability, nodes so far); False stops growth.
    grow: Callable[[float, int], bool] | None = None


@torch.no_grad()
def build_greedy_tree(
    draft: Eagle3DraftModel, state: DraftState, root_token: int, budget: TreeBudget, timer: NullTimer = NO_TIMER
) -> DraftTree:
    """EAGLE-2 dynamic tree: top-k expansion by cumulative draft log-probability, then global rerank.

    Level by level, the `top_k` best frontier nodes are fed to the draft together (one forward per level) at the
    position after their parent, each attending to the verified prefix, its own ancestors and itself.
    """
    mark = timer.now()
    device = state.last_logits.device
    k = budget.top_k
    prefix = state.length
    cand_ids, cand_scores = top_children(state.last_logits[None], k)  # depth-1 candidates, [1, k] each
    cand_ids, cand_scores = cand_ids[0], cand_scores[0]
    all_scores, all_ids, all_parents = [cand_scores], [cand_ids], [torch.full_like(cand_ids, -1)]
    # frontier: candidate indices (into the flat candidate list), their scores, hidden inputs and draft ids
    frontier = torch.arange(cand_ids.numel(), device=device)
    frontier_scores, frontier_ids = cand_scores, cand_ids
    frontier_hidden = state.last_hidden.expand(1, cand_ids.numel(), -1)
    dtype = frontier_hidden.dtype
    # Additive mask over [prefix | fed tree nodes]; the prefix columns stay 0, the tree block is rewritten per level.
    mask = torch.zeros(k, prefix + k * max(budget.depth - 1, 1), dtype=dtype, device=device)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    ancestors = torch.zeros(cand_ids.numel(), 0, dtype=torch.bool, device=device)  # [kf, fed]: over fed nodes
    # RoPE for every level at once: the nodes of level l all sit at position prefix + l - 1.
    cos, sin = draft.rotary_emb(frontier_hidden, torch.arange(prefix, prefix + budget.depth, device=device)[None])
    flat_count, fed = cand_ids.numel(), 0
    timer.add("draft: tree setup", mark)
    for level in range(1, budget.depth):
        mark = timer.now()
        if budget.grow is not None and not budget.grow(frontier_scores.max().exp().item(), flat_count):
            timer.add("draft: grow decision", mark)
            break
        timer.add("draft: grow decision", mark)
        mark = timer.now()
        kf = frontier.numel()
        ancestors = torch.cat([ancestors, torch.eye(kf, dtype=torch.bool, device=device)], dim=1)
        level_mask = mask[:kf, : prefix + fed + kf]
        level_mask[:, prefix:] = torch.where(ancestors, zero, blocked)
        ids = draft.draft_to_target_ids(frontier_ids)[None]
        positions = torch.full((kf,), prefix + level - 1, device=device)
        timer.add("draft: level mask and inputs", mark)
        state.forward_calls += 1
        logits, hidden = draft_forward(
            draft, state.kv, ids, frontier_hidden, positions, prefix + fed, level_mask,
            rotary=(cos[:, level - 1 : level], sin[:, level - 1 : level]), timer=timer,
        )  # fmt: skip
        fed += kf
        mark = timer.now()
        child_ids, child_logp = top_children(logits, k)  # [kf, k] each
        timer.add("draft: log-softmax and top-k", mark)
        mark = timer.now()
        child_scores = frontier_scores[:, None] + child_logp
        all_scores.append(child_scores.reshape(-1))
        all_ids.append(child_ids.reshape(-1))
        all_parents.append(frontier[:, None].expand_as(child_ids).reshape(-1))
        best = child_scores.reshape(-1).topk(min(k, child_scores.numel())).indices  # the next frontier
        rows = torch.div(best, child_ids.shape[1], rounding_mode="floor")
        frontier = flat_count + best
        flat_count += child_ids.numel()
        frontier_scores = child_scores.reshape(-1)[best]
        frontier_ids = child_ids.reshape(-1)[best]
        frontier_hidden = hidden[:, rows]
        ancestors = ancestors[rows]
        timer.add("draft: frontier bookkeeping", mark)
    mark = timer.now()
    scores = torch.cat(all_scores)
    kept, tree_parents = rerank(scores, torch.cat(all_parents), budget.total_tokens)
    target_ids = draft.draft_to_target_ids(torch.cat(all_ids)[kept])
    root = torch.tensor([root_token], device=device, dtype=target_ids.dtype)
    tree = DraftTree.from_parents(
        tokens=torch.cat([root, target_ids]),
        parents=tree_parents,
        scores=torch.cat([torch.zeros(1, device=device), scores[kept]]),
    )
    timer.add("draft: rerank and tree", mark)
    return tree


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
        dtype = state.last_hidden.dtype
        mask = torch.zeros(kf, state.length + fed_before + kf, dtype=dtype, device=device)
        mask[:, state.length :].masked_fill_(~anc, torch.finfo(dtype).min)
        state.forward_calls += 1
        logits, hidden = draft_forward(
            draft, state.kv, torch.cat([tokens[n] for n in frontier])[None],
            torch.stack([hidden_of[n] for n in frontier])[None],
            torch.full((kf,), state.length + level - 1, device=device), state.length + fed_before, mask,
        )  # fmt: skip
        q_levels = torch.softmax(logits.float() / temperature, dim=-1)  # [kf, Vd]
        q_full = draft_probs_over_target(logits)
        next_level: list[int] = []
        for row, node in enumerate(frontier):
            if remaining <= 0:
                break
            count = min(budget.top_k, remaining, int((q_levels[row] > 0).sum()))
            q_rows[node] = q_full[row]
            children = add_children(node, q_levels[row], count)
            remaining -= len(children)
            for c in children:
                hidden_of[c] = hidden[0, row]
            next_level.extend(children)
        level_nodes = next_level
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
