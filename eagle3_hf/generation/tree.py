"""Draft trees as plain tensors, and the EAGLE-2 rules that build them.

A tree of ``T`` nodes is described by two 1-D ``LongTensor``s of length ``T``:

* ``tokens[i]``: the (target-vocabulary) token at node ``i``;
* ``parents[i]``: the index of ``i``'s parent, with ``parents[0] == -1`` and ``parents[i] < i`` (parents precede
  their children). Node 0 is the root: the last verified token, whose successor the target predicts.

Children of a node are ordered by index, and index order is sibling order (draw order for sampled trees).

Every function here is pure (no module state, no model) and follows the device of its inputs.

Building greedy (temperature 0) trees, EAGLE-2 style (``drafting.build_greedy_trees``):

1. every frontier node gets its ``top_k`` best children with cumulative scores (sum of draft log-probs along the
   path);
2. the ``top_k`` best of those ``k_f * top_k`` children become the next frontier;
3. after the last level, ``rerank`` keeps the ``total_tokens - 1`` best candidates over all levels and
   returns the parent array of the final tree (root first, parents before children).

Building sampled (temperature > 0) trees needs a different rule. Verification by recursive rejection sampling
(``verification.sample_accept``) is lossless only if each node's children are draws *without replacement* from
the draft distribution stored for that node, kept in draw order, and if the decision to include a child never
depends on that child's own sampled value (only on its ancestors and earlier siblings). Reranking by score
violates this: a child kept because its sampled token scored well biases acceptance. So sampled trees use
``sample_children`` and keep **every** drawn child of each expanded node, with the number of children per
expanded node (and which nodes to expand) decided before drawing them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


__all__ = [
    "DraftTree",
    "children_lists",
    "rerank",
    "sample_children",
    "target_tree_mask",
    "tree_attention_mask",
    "tree_depths",
    "verification_mask",
]


@dataclass(frozen=True)
class DraftTree:
    """A draft tree ready for verification.

    Attributes:
        tokens: ``LongTensor [T]``, target-vocabulary ids; ``tokens[0]`` is the root (last verified token).
        parents: ``LongTensor [T]``, ``parents[0] == -1`` and ``parents[i] < i``.
        depths: ``LongTensor [T]``, root at depth 0.
        scores: ``FloatTensor [T]``, cumulative draft log-prob of the path to each node (root 0.0).
        draft_probs: optional ``FloatTensor [T, V]``; row ``i`` is the draft distribution over the target
            vocabulary from which node ``i``'s children were drawn (sampled trees only; rows of unexpanded
            nodes are unused).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        scores: torch.Tensor,
        draft_probs: torch.Tensor | None = None,
    ) -> "DraftTree":
        """Build a tree, deriving the depths from `parents`."""
        return cls(tokens=tokens, parents=parents, depths=tree_depths(parents), scores=scores, draft_probs=draft_probs)

    def __post_init__(self):
        num_nodes = self.parents.shape[0] if self.parents.dim() == 1 else -1
        for name in ("tokens", "depths", "scores"):
            value = getattr(self, name)
            if value.dim() != 1 or value.shape[0] != num_nodes:
                raise ValueError(
                    f"DraftTree.{name} has shape {tuple(value.shape)}, expected [{num_nodes}] like `parents` "
                    f"(shape {tuple(self.parents.shape)})"
                )
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != num_nodes):
            raise ValueError(
                f"DraftTree.draft_probs has shape {tuple(self.draft_probs.shape)}, expected [{num_nodes}, vocab_size]"
            )

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]


def _check_parents(parents: torch.Tensor) -> None:
    if not isinstance(parents, torch.Tensor) or parents.dim() != 1 or parents.shape[0] < 1:
        shape = tuple(parents.shape) if isinstance(parents, torch.Tensor) else type(parents).__name__
        raise ValueError(f"`parents` must be a non-empty 1-D tensor, got {shape}")
    if parents.dtype.is_floating_point or parents.dtype == torch.bool:
        raise ValueError(f"`parents` must be an integer tensor, got dtype {parents.dtype}")
    index = torch.arange(parents.shape[0], device=parents.device)
    ok = (parents[0] == -1) & ((parents[1:] >= 0) & (parents[1:] < index[1:])).all()
    if not bool(ok):
        raise ValueError(
            f"`parents` must satisfy parents[0] == -1 and 0 <= parents[i] < i (parents before children), "
            f"got {parents.tolist()}"
        )


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """``BoolTensor [T, T]``: row ``i`` is True at ``i`` itself and at each of its ancestors."""
    _check_parents(parents)
    num_nodes = parents.shape[0]
    device = parents.device
    index = torch.arange(num_nodes, device=device)
    # Pointer doubling keeps this vectorised (no per-node loop, no host sync): after step k, `mask[i]` holds the
    # ancestors of i at distance < 2**k and `jump[i]` is its 2**k-th ancestor (clamped at the root, which is its
    # own ancestor, so clamping adds nothing new).
    jump = parents.clone().long()
    jump[0] = 0
    mask = index[:, None] == index[None, :]
    for _ in range(math.ceil(math.log2(num_nodes)) if num_nodes > 1 else 0):
        mask = mask | mask[jump]
        jump = jump[jump]
    return mask


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """``LongTensor [T]``: depth of every node, root 0."""
    return tree_attention_mask(parents).sum(dim=-1) - 1


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """Children of every node, each list in index (== sibling) order."""
    _check_parents(parents)
    parent_list = parents.tolist()
    children: list[list[int]] = [[] for _ in parent_list]
    for node, parent in enumerate(parent_list[1:], start=1):
        children[parent].append(node)
    return children


def verification_mask(
    tree_mask: torch.Tensor,
    past_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive attention mask ``[1, 1, T, past_length + T]`` for verifying a tree on top of a cache.

    0 means attend, ``torch.finfo(dtype).min`` means masked. Every past column is visible and the tree block is
    ``tree_mask``. With ``sliding_window=W``, key ``j`` is also masked for query ``i`` when
    ``pos_i - pos_j >= W`` (HF's ``sliding_window_overlay``: a query sees the last W positions, itself included).
    Past key ``j`` has position ``j`` (a full, untruncated cache); tree node ``k`` has position
    ``positions[k]``, by default ``past_length + depth_k``.
    """
    if tree_mask.dim() != 2 or tree_mask.shape[0] != tree_mask.shape[1] or tree_mask.dtype != torch.bool:
        raise ValueError(
            f"`tree_mask` must be a square bool tensor [T, T], got shape {tuple(tree_mask.shape)} and dtype "
            f"{tree_mask.dtype}"
        )
    if past_length < 0:
        raise ValueError(f"`past_length` must be >= 0, got {past_length}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"`sliding_window` must be >= 1 or None, got {sliding_window}")
    if not dtype.is_floating_point:
        raise ValueError(f"`dtype` must be a floating dtype for an additive mask, got {dtype}")
    num_nodes = tree_mask.shape[0]
    device = tree_mask.device

    visible = torch.cat(
        [torch.ones(num_nodes, past_length, dtype=torch.bool, device=device), tree_mask], dim=-1
    )  # [T, past_length + T]
    if sliding_window is not None:
        if positions is None:
            positions = tree_mask.sum(dim=-1) - 1 + past_length
        elif positions.shape != (num_nodes,):
            raise ValueError(f"`positions` must have shape [{num_nodes}], got {tuple(positions.shape)}")
        positions = positions.to(device=device, dtype=torch.long)
        key_positions = torch.cat([torch.arange(past_length, device=device), positions])
        visible = visible & (positions[:, None] - key_positions[None, :] < sliding_window)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def rerank(
    candidate_scores: torch.Tensor, candidate_parents: torch.Tensor, total_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the ``total_tokens - 1`` best candidates and build the parent array of the final tree.

    Args:
        candidate_scores: ``[N]`` cumulative scores of all candidates.
        candidate_parents: ``[N]`` index of each candidate's parent in the candidate list (``-1``: child of the
            root); must be smaller than the candidate's own index.
        total_tokens: size of the final tree, root included.

    Returns:
        ``(kept [M], parents [1 + M])``: ``kept`` are candidate indices sorted ascending, with
        ``M = min(N, total_tokens - 1)``; final node ``m + 1`` is candidate ``kept[m]``, node 0 is the root.

    Ties are broken towards the lower index, so with scores that never increase from parent to child (true for
    sums of log-probs) a kept node's parent is always kept; a violation raises ``ValueError``.
    """
    if total_tokens < 1:
        raise ValueError(f"`total_tokens` must be >= 1 (it counts the root), got {total_tokens}")
    if candidate_scores.dim() != 1 or candidate_parents.shape != candidate_scores.shape:
        raise ValueError(
            f"expected candidate_scores [N] and candidate_parents [N], got {tuple(candidate_scores.shape)} and "
            f"{tuple(candidate_parents.shape)}"
        )
    device = candidate_scores.device
    num_candidates = candidate_scores.shape[0]
    candidate_parents = candidate_parents.to(device=device, dtype=torch.long)
    index = torch.arange(num_candidates, device=device)
    if not bool(((candidate_parents >= -1) & (candidate_parents < index)).all()):
        raise ValueError(
            f"`candidate_parents` must satisfy -1 <= candidate_parents[i] < i, got {candidate_parents.tolist()}"
        )

    num_kept = min(num_candidates, total_tokens - 1)
    # A stable descending sort keeps equal scores in index order: the lower index (a parent before its child) wins.
    order = torch.sort(candidate_scores, descending=True, stable=True).indices
    kept = torch.sort(order[:num_kept]).values

    # new_index[c] = final tree index of candidate c (0 = not kept).
    new_index = torch.zeros(num_candidates, dtype=torch.long, device=device)
    new_index[kept] = torch.arange(1, num_kept + 1, device=device)
    kept_parents = candidate_parents[kept]
    has_candidate_parent = kept_parents >= 0
    mapped = torch.where(has_candidate_parent, new_index[kept_parents.clamp(min=0)], 0)
    if bool((has_candidate_parent & (mapped == 0)).any()):
        bad = int(kept[has_candidate_parent & (mapped == 0)][0])
        raise ValueError(
            f"candidate {bad} is kept but its parent {int(candidate_parents[bad])} is not: scores must not increase "
            f"from parent to child, got candidate_scores {candidate_scores.tolist()}"
        )
    parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), mapped])
    return kept, parents


def sample_children(
    logits: torch.Tensor,
    num: int,
    generator: torch.Generator | None = None,
    *,
    is_probs: bool = False,
) -> torch.Tensor:
    """Draw ``num`` distinct tokens without replacement from one draft distribution, in draw order.

    Gumbel-top-k: sorting ``log q + Gumbel noise`` in decreasing order has the law of drawing tokens one after
    another without replacement, so the order of the result is the draw order.

    Args:
        logits: ``[Vd]`` draft logits (already temperature-scaled / processed), or probabilities with
            ``is_probs=True``.
        num: number of children to draw; fixed before drawing (see the module docstring).
        generator: RNG on the same device as ``logits``, for reproducibility.

    Returns:
        ``LongTensor [min(num, support)]`` draft ids, where ``support`` is the number of tokens with non-zero
        probability (the support is known before drawing, so truncating to it does not bias verification).
    """
    if logits.dim() != 1:
        raise ValueError(f"`logits` must be a 1-D distribution [Vd], got shape {tuple(logits.shape)}")
    if num < 1:
        raise ValueError(f"`num` must be >= 1, got {num}")
    work_dtype = torch.promote_types(logits.dtype, torch.float32)
    if is_probs:
        if bool((logits < 0).any()) or not bool(logits.sum() > 0):
            raise ValueError("`logits` given as probabilities (is_probs=True) must be >= 0 with a positive sum")
        log_q = logits.to(work_dtype).log()
    else:
        log_q = torch.log_softmax(logits.to(work_dtype), dim=-1)
    support = int(torch.isfinite(log_q).sum())
    if support == 0:
        raise ValueError("`logits` gives no token a non-zero probability (all -inf logits or all-zero probs)")
    num = min(num, support)
    uniform = torch.rand(log_q.shape, generator=generator, device=log_q.device, dtype=work_dtype)
    tiny = torch.finfo(work_dtype).tiny
    gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny)))
    keys = (log_q + gumbel).nan_to_num(nan=-math.inf)  # -inf + finite stays -inf; guards nan logits
    return keys.topk(num).indices


def target_tree_mask(config: Any, tree_mask: torch.Tensor, past: int, dtype: torch.dtype) -> Any:
    """4D additive tree mask for one row of the target behind `past` cached tokens (`verification_mask`); a
    per-layer-type dict when the target mixes sliding-window layers."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    full = verification_mask(tree_mask, past, dtype)
    if window and layer_types and "sliding_attention" in layer_types:
        sliding = verification_mask(tree_mask, past, dtype, sliding_window=window)
        return {"full_attention": full, "sliding_attention": sliding}
    if window and not layer_types and getattr(text, "use_sliding_window", True):
        return verification_mask(tree_mask, past, dtype, sliding_window=window)
    return full
