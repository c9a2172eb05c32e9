"""Draft trees as plain tensors, and pure functions over them.

A tree of ``T`` nodes is described by two 1-D ``LongTensor``s of length ``T``:

* ``tokens[i]``: the (target-vocabulary) token at node ``i``;
* ``parents[i]``: the index of ``i``'s parent, with ``parents[0] == -1`` and ``parents[i] < i`` (parents precede
  their children). Node 0 is the root: the last verified token, whose successor the target predicts.

Children of a node are ordered by index, and index order is sibling order (draw order for sampled trees).

Every function here is pure (no module state, no model) and follows the device of its inputs. Greedy trees are
built EAGLE-2 style by ``drafting.build_greedy_trees`` (cut to their best nodes by ``cut_host`` or its batched twin
there); sampled trees by sampled_trees.py, whose docstring gives the rule that keeps their verification lossless
(``sample_children`` draws a node's children).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from eagle3_hf.generation.transfers import read, upload

__all__ = [
    "DraftTree",
    "HostTree",
    "children_lists",
    "cut_host",
    "node_paths",
    "place_trees",
    "read_on_host",
    "subtree",
    "sample_children",
    "tree_attention_mask",
    "tree_depths",
]


class HostTree(NamedTuple):
    """A tree's tokens, parents and scores as Python lists: what the decoding loop reads on the host."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]


def read_on_host(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Every tensor's values as a flat list, read in one device-to-host copy (transfers.read)."""
    return read(tensors)


@dataclass(frozen=True)
class DraftTree:
    """A draft tree ready for verification.

    Attributes:
        tokens: ``LongTensor [T]``, target-vocabulary ids; ``tokens[0]`` is the root (last verified token).
        parents: ``LongTensor [T]``, ``parents[0] == -1`` and ``parents[i] < i``.
        scores: ``FloatTensor [T]``, cumulative draft log-prob of the path to each node (root 0.0).
        draft_probs: optional ``FloatTensor [T, V]``; row ``i`` is the draft distribution over the target
            vocabulary from which node ``i``'s children were drawn (sampled trees only; rows of unexpanded
            nodes are unused).
        host: the same tokens, parents and scores as lists, when the tree was built from lists or was read
            (``with_hosts``); None otherwise.
        placed: False for a tree built ``on_host`` whose tensors wait for ``place_trees``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    draft_probs: torch.Tensor | None = None
    host: HostTree | None = field(default=None, compare=False, repr=False)
    placed: bool = field(default=True, compare=False, repr=False)  # False: built `on_host`, not yet on the device

    @classmethod
    def from_lists(cls, host: HostTree, device: torch.device, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A tree built on the host: its lists are copied to `device` (one upload) and nothing is read back. The
        decoding loop builds its trees `on_host` instead and places every row's at once (`place_trees`)."""
        tokens, parents, scores = upload(device, host.tokens, host.parents, host.scores, floats=(2,))
        return cls(tokens=tokens, parents=parents, scores=scores, draft_probs=draft_probs, host=host)

    @classmethod
    def on_host(cls, host: HostTree, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A tree built on the host, its tensors in host memory until `place_trees` moves them with every other
        row's (no transfer here)."""
        return cls(
            tokens=torch.tensor(host.tokens, dtype=torch.long),
            parents=torch.tensor(host.parents, dtype=torch.long),
            scores=torch.tensor(host.scores, dtype=torch.float32),
            draft_probs=draft_probs,
            host=host,
            placed=False,
        )

    @staticmethod
    def with_hosts(trees: list[DraftTree], extra: list[torch.Tensor] = ()) -> tuple[list[DraftTree], list[list]]:
        """`trees`, each with its `host` lists, and the values of the `extra` tensors: what is not on the host yet is
        read in one copy for all of them."""
        missing = [tree for tree in trees if tree.host is None]
        values = read_on_host([t for tree in missing for t in (tree.tokens, tree.parents, tree.scores)] + list(extra))
        rest, hosted = iter(values[: 3 * len(missing)]), {}
        for tree in missing:
            host = HostTree([int(x) for x in next(rest)], [int(x) for x in next(rest)], next(rest))
            hosted[id(tree)] = dataclasses.replace(tree, host=host)
        return [hosted.get(id(tree), tree) for tree in trees], values[3 * len(missing) :]

    def __post_init__(self):
        num_nodes = self.parents.shape[0] if self.parents.dim() == 1 else -1
        for name in ("tokens", "scores"):
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


def place_trees(trees: list[DraftTree], device: torch.device) -> list[DraftTree]:
    """`trees` with every tree built `on_host` moved to `device`: all of them in one upload (none: no upload)."""
    waiting = [tree for tree in trees if not tree.placed]
    if not waiting:
        return trees
    lists = [values for tree in waiting for values in tree.host]
    moved = iter(upload(device, *lists, floats=range(2, len(lists), 3)))
    placed = {}
    for tree in waiting:
        tokens, parents, scores = next(moved), next(moved), next(moved)
        placed[id(tree)] = dataclasses.replace(tree, tokens=tokens, parents=parents, scores=scores, placed=True)
    return [placed.get(id(tree), tree) for tree in trees]


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


def tree_attention_mask(parents: torch.Tensor, check: bool = True) -> torch.Tensor:
    """``BoolTensor [T, T]``: row ``i`` is True at ``i`` itself and at each of its ancestors. `check=False` skips
    validating `parents` (which reads it on the host), for trees the decoding loop built itself."""
    if check:
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


def children_lists(parents: torch.Tensor | list[int]) -> list[list[int]]:
    """Children of every node, each list in index (== sibling) order (`parents` a tensor, checked, or a tree's host
    list)."""
    if isinstance(parents, torch.Tensor):
        _check_parents(parents)
    parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    children: list[list[int]] = [[] for _ in parent_list]
    for node, parent in enumerate(parent_list[1:], start=1):
        children[parent].append(node)
    return children


def node_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root, root first (`parents` as a list)."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append([node] if parent < 0 else paths[parent] + [node])
    return paths


def cut_host(host: HostTree, total_tokens: int) -> list[int]:
    """The root and the ``total_tokens - 1`` best other nodes of a tree (by score, ties towards the lower index),
    ascending. With scores that never increase from parent to child a kept node's parent is kept;
    a violation raises ``ValueError``."""
    if total_tokens < 1:
        raise ValueError(f"`total_tokens` must be >= 1 (it counts the root), got {total_tokens}")
    best = sorted(range(1, len(host.parents)), key=lambda node: (-host.scores[node], node))[: total_tokens - 1]
    kept = [0] + sorted(best)
    chosen = set(kept)
    bad = [node for node in kept[1:] if host.parents[node] not in chosen]
    if bad:
        raise ValueError(
            f"node {bad[0]} is kept but its parent {host.parents[bad[0]]} is not: scores must not increase from "
            f"parent to child, got scores {host.scores}"
        )
    return kept


def subtree(host: HostTree, kept: list[int]) -> HostTree:
    """The nodes `kept` (ascending, parents kept before their children) as a tree of their own."""
    new = {node: i for i, node in enumerate(kept)}
    parents = [-1] + [new[host.parents[node]] for node in kept[1:]]
    return HostTree([host.tokens[n] for n in kept], parents, [host.scores[n] for n in kept])


def sample_children(logits: torch.Tensor, num: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw ``num`` distinct tokens without replacement from one draft distribution, in draw order.

    Gumbel-top-k: sorting ``log q + Gumbel noise`` in decreasing order has the law of drawing tokens one after
    another without replacement, so the order of the result is the draw order.

    Args:
        logits: ``[Vd]`` draft logits (already temperature-scaled / processed) or log-probabilities.
        num: number of children to draw; fixed before drawing (see sampled_trees.py).
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
    log_q = torch.log_softmax(logits.to(work_dtype), dim=-1)
    support = int(torch.isfinite(log_q).sum())
    if support == 0:
        raise ValueError("`logits` gives no token a non-zero probability (all -inf logits)")
    num = min(num, support)
    uniform = torch.rand(log_q.shape, generator=generator, device=log_q.device, dtype=work_dtype)
    tiny = torch.finfo(work_dtype).tiny
    gumbel = -torch.log(-torch.log(uniform.clamp(min=tiny)))
    keys = (log_q + gumbel).nan_to_num(nan=-math.inf)  # -inf + finite stays -inf; guards nan logits
    return keys.topk(num).indices
