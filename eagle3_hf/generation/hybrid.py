"""One tree from two sources: the draft's tree and the context lookup's continuations (context_index.py).

Each lookup node gets an estimated acceptance from hit rates measured during the call (`LookupStats`): a lookup node
whose parent was accepted is a trial, a hit when it is accepted too, counted by its effective match length (the
match its continuation rests on plus the tokens of it already accepted above it), from a prior that rises with the
match length. A node's estimate is its parent's times that rate times the share of the continuations through the
parent that go through it.

Greedy trees (`graft`): the lookup's trie is walked from the root; a lookup node whose token equals a child of the
tree node its parent maps to is merged into that child (source "both", estimate the larger of the two), otherwise it
is appended. Estimates never increase from parent to child, so the merged tree is sized like the draft's: keep the
best nodes by estimate (`tree.cut_host`), which always keeps a node's parent.

Sampled trees (`graft_sampled`): lookup nodes are proposals with a point-mass distribution. They hang from the root
and from each other; at the root they come before the draft's children, which stay draws without replacement from
the draft distribution; a draft child equal to a lookup sibling is removed with its subtree but stays in the root's
draw sequence (`SampledGraft.draws`), where recursive rejection treats it as an ordinary proposal that cannot be
accepted. Why this stays lossless: see `eagle3_hf.generation.verification.sample_accept`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import torch

from eagle3_hf.generation.context_index import ContextIndex, LookupTrie
from eagle3_hf.generation.tree import DraftTree, HostTree, cut_host, subtree

__all__ = [
    "BOTH", "DRAFT", "LOOKUP", "LookupOptions", "LookupState", "LookupStats", "SampledGraft", "best_lookup_nodes",
    "graft", "graft_sampled", "lookup_conditionals", "lookup_only_tree", "prune_nodes", "source_counts",
]  # fmt: skip

DRAFT, LOOKUP, BOTH = 1, 2, 3  # node sources, as bit flags: BOTH == DRAFT | LOOKUP

# Prior hit rate of a lookup node by effective match length 1, 2, ..., 8+ (before the call has measured any): the
# next token after an earlier occurrence of the last token is right about a quarter of the time in chat answers,
# after a repeated bigram 0.45-0.8 (examples/copy_analysis.py measured 0.78-0.83 on MT-bench with SmolLM2).
PRIOR_RATES = (0.25, 0.45, 0.55, 0.62, 0.68, 0.72, 0.75, 0.78)


@dataclass
class LookupStats:
    """Hit rates of lookup nodes by effective match length, measured during one call from `PRIOR_RATES`."""

    prior_weight: float = 4.0  # pseudo-trials at the prior rate
    hits: list[float] = field(default_factory=lambda: [0.0] * len(PRIOR_RATES))
    trials: list[float] = field(default_factory=lambda: [0.0] * len(PRIOR_RATES))

    @staticmethod
    def bucket(match: int) -> int:
        return min(max(match, 1), len(PRIOR_RATES)) - 1

    def rate(self, match: int) -> float:
        b = self.bucket(match)
        return (self.hits[b] + self.prior_weight * PRIOR_RATES[b]) / (self.trials[b] + self.prior_weight)

    def observe(self, match: int, hit: bool) -> None:
        b = self.bucket(match)
        self.trials[b] += 1.0
        self.hits[b] += float(hit)


@dataclass
class LookupOptions:
    depth: int = 8  # tokens per continuation
    branches: int = 4  # continuations (earlier occurrences) per cycle
    max_ngram: int = 4  # longest n-gram whose occurrences are listed (the longest match itself is unbounded)
    # skip the draft's forward when the best depth-1 lookup node's estimate reaches this (1.0 or more: never)
    confidence: float = 0.8

    def __post_init__(self) -> None:
        for name in ("depth", "branches", "max_ngram"):
            if getattr(self, name) < 1:
                raise ValueError(f"lookup {name} must be >= 1, got {getattr(self, name)}.")
        if not self.confidence > 0:
            raise ValueError(
                f"lookup confidence must be > 0 (1.0 or more never skips the draft), got {self.confidence}."
            )


@dataclass
class LookupState:
    """Per-call lookup state: the index over the sequence (kept in step with the output) and the measured rates."""

    options: LookupOptions = field(default_factory=LookupOptions)
    stats: LookupStats = field(default_factory=LookupStats)
    index: ContextIndex | None = None

    def sync(self, tokens: torch.Tensor | list[int]) -> None:
        """Append what `tokens` (the whole sequence the index covers) holds beyond what was indexed: only the new
        tokens are read, so that a cycle costs no more on a long sequence."""
        if self.index is None:
            self.index = ContextIndex(max_ngram=self.options.max_ngram)
        new = tokens[len(self.index) :]
        self.index.extend(new.tolist() if isinstance(new, torch.Tensor) else new)

    def propose(self) -> tuple[LookupTrie, list[float]]:
        """This cycle's trie and each node's conditional estimate (`lookup_conditionals`)."""
        trie = self.index.lookup(self.options.depth, self.options.branches)
        return trie, lookup_conditionals(trie, self.stats)

    def observe(self, parents: list[int], lookup_match: list[int], path: list[int]) -> None:
        """Count every lookup node whose parent was accepted: a hit if it was accepted too."""
        on_path = set(path)
        for node in range(1, len(parents)):
            if lookup_match[node] > 0 and parents[node] in on_path:
                self.stats.observe(lookup_match[node], node in on_path)


def lookup_conditionals(trie: LookupTrie, stats: LookupStats) -> list[float]:
    """Per trie node: P(accepted | parent accepted) = the hit rate at its effective match length (match + depth - 1)
    times its share of the parent's continuations. The root's is 1."""
    depths = trie.depths()
    out = [1.0]
    for i in range(1, trie.num_nodes):
        share = trie.counts[i] / max(trie.counts[trie.parents[i]], 1)
        out.append(stats.rate(trie.match[i] + depths[i] - 1) * share)
    return out


def _effective_match(trie: LookupTrie, depths: list[int], i: int) -> int:
    return trie.match[i] + depths[i] - 1


def lookup_only_tree(root: int, trie: LookupTrie, cond: list[float], device: torch.device, total_tokens: int,
                     ) -> tuple[DraftTree, list[int], list[int]]:  # fmt: skip
    """The trie as a tree (scores: log estimates), cut to its best `total_tokens` nodes (root included).
    Returns (tree, sources, effective match per node: 0 for the root)."""
    depths = trie.depths()
    scores = [0.0]
    for i in range(1, trie.num_nodes):
        scores.append(scores[trie.parents[i]] + math.log(max(cond[i], 1e-12)))
    host = HostTree([root] + trie.tokens[1:], list(trie.parents), scores)
    match = [0] + [_effective_match(trie, depths, i) for i in range(1, trie.num_nodes)]
    return _cut(host, [0] + [LOOKUP] * (trie.num_nodes - 1), match, total_tokens, device)


def graft(tree: DraftTree, trie: LookupTrie, cond: list[float], total_tokens: int,
          ) -> tuple[DraftTree, list[int], list[int]]:  # fmt: skip
    """Merge the trie into a greedy draft tree (see the module docstring); keep the best `total_tokens` nodes.
    Returns (tree, sources, effective match per node: 0 for pure draft nodes)."""
    host = tree.host if tree.host is not None else DraftTree.with_hosts([tree])[0][0].host
    tokens, parents, scores = list(host.tokens), list(host.parents), list(host.scores)
    sources = [0] + [DRAFT] * (len(tokens) - 1)
    match = [0] * len(tokens)
    child_of = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    depths = trie.depths()
    mapped = [0] * trie.num_nodes  # trie node -> tree node
    for i in range(1, trie.num_nodes):
        parent = mapped[trie.parents[i]]
        score = scores[parent] + math.log(max(cond[i], 1e-12))
        node = child_of.get((parent, trie.tokens[i]))
        if node is None:
            node = len(tokens)
            tokens.append(trie.tokens[i])
            parents.append(parent)
            scores.append(score)
            sources.append(LOOKUP)
            match.append(0)
            child_of[(parent, trie.tokens[i])] = node
        else:
            scores[node] = max(scores[node], score)
            sources[node] |= LOOKUP
        match[node] = _effective_match(trie, depths, i)
        mapped[i] = node
    return _cut(HostTree(tokens, parents, scores), sources, match, total_tokens, tree.tokens.device)


def _cut(host: HostTree, sources: list[int], match: list[int], total_tokens: int, device: torch.device,
         ) -> tuple[DraftTree, list[int], list[int]]:  # fmt: skip
    """The root and the best `total_tokens - 1` nodes by score (a parent always kept before its child), on the host.
    The scores are rounded to the tree's fp32 first, so that ties are those of the tensor it becomes."""
    host = HostTree(host.tokens, host.parents, array("f", host.scores).tolist())
    if len(host.parents) > total_tokens:
        kept = cut_host(host, total_tokens)
        host, sources, match = subtree(host, kept), [sources[r] for r in kept], [match[r] for r in kept]
    return DraftTree.from_lists(host, device), sources, match


def prune_nodes(tree: DraftTree, sources: list[int], match: list[int], n: int,
                ) -> tuple[DraftTree, list[int], list[int]]:  # fmt: skip
    """The root and the tree's `n` best nodes (the cost model's choice of size)."""
    host = tree.host if tree.host is not None else DraftTree.with_hosts([tree])[0][0].host
    return _cut(host, sources, match, n + 1, tree.tokens.device)


@dataclass
class SampledGraft:
    """A sampled draft tree with lookup point masses: what `sample_accept` needs besides the target's rows."""

    tree: DraftTree  # draft_probs rows of lookup nodes are unused (their children are lookup nodes only)
    point_mass: torch.Tensor  # [T] bool: the node is a lookup proposal
    draws: dict[int, list[int]]  # node -> the draft's draw sequence there, removed duplicates included
    sources: list[int]
    match: list[int]


def graft_sampled(tree: DraftTree, trie: LookupTrie, cond: list[float], lookup_nodes: list[int]) -> SampledGraft:
    """Put the trie nodes `lookup_nodes` (a prefix-closed set, in trie order) first, then the sampled draft tree's
    nodes minus the root's children equal to a lookup depth-1 token (and their subtrees)."""
    device = tree.tokens.device
    t_tokens, t_parents, t_scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
    depths = trie.depths()
    new_of_trie = {0: 0}
    tokens, parents, scores, sources, match = [t_tokens[0]], [-1], [0.0], [0], [0]
    for i in lookup_nodes:
        new_of_trie[i] = len(tokens)
        parent = new_of_trie[trie.parents[i]]
        tokens.append(trie.tokens[i])
        parents.append(parent)
        scores.append(scores[parent] + math.log(max(cond[i], 1e-12)))
        sources.append(LOOKUP)
        match.append(_effective_match(trie, depths, i))
    n_lookup = len(tokens) - 1
    first_level = {trie.tokens[i] for i in lookup_nodes if trie.parents[i] == 0}
    draws = {0: [t_tokens[c] for c in range(1, len(t_tokens)) if t_parents[c] == 0]} if first_level else {}
    new_of_draft = {0: 0}
    rows = [0] * (n_lookup + 1)  # the draft_probs row of each new node (lookup nodes' rows are never read)
    for c in range(1, len(t_tokens)):
        p = t_parents[c]
        if p not in new_of_draft or (p == 0 and t_tokens[c] in first_level):
            continue  # a duplicate of a lookup sibling, or under one: removed
        new_of_draft[c] = len(tokens)
        tokens.append(t_tokens[c])
        parents.append(new_of_draft[p])
        scores.append(t_scores[c])
        sources.append(DRAFT)
        match.append(0)
        rows.append(c)
    probs = tree.draft_probs[torch.tensor(rows, device=device)] if tree.draft_probs is not None else None
    merged = DraftTree.from_parents(
        tokens=torch.tensor(tokens, device=device, dtype=tree.tokens.dtype),
        parents=torch.tensor(parents, device=device),
        scores=torch.tensor(scores, device=device),
        draft_probs=probs,
    )
    point_mass = torch.zeros(len(tokens), dtype=torch.bool)
    point_mass[1 : n_lookup + 1] = True
    return SampledGraft(tree=merged, point_mass=point_mass, draws=draws, sources=sources, match=match)


def best_lookup_nodes(trie: LookupTrie, cond: list[float], limit: int, min_estimate: float = 0.05) -> list[int]:
    """Up to `limit` trie nodes with the highest estimates (at least `min_estimate`), prefix-closed, in trie order.
    Decided from the context alone (never from a draft's sample), as exact sampling requires."""
    est = [1.0]
    for i in range(1, trie.num_nodes):
        est.append(est[trie.parents[i]] * cond[i])
    order = sorted(range(1, trie.num_nodes), key=lambda i: (-est[i], i))
    chosen = {i for i in order[: max(limit, 0)] if est[i] >= min_estimate}
    # estimates never increase from parent to child, ties go to the lower index: the set is prefix-closed
    return sorted(i for i in chosen if trie.parents[i] == 0 or trie.parents[i] in chosen)


def source_counts(sources: list[int], path: list[int], emitted_drafts: int) -> tuple[int, int, int]:
    """(draft, lookup, both): where the first `emitted_drafts` accepted nodes of `path` (root excluded) came from."""
    counts = [0, 0, 0]
    for node in path[1 : 1 + emitted_drafts]:
        counts[{DRAFT: 0, LOOKUP: 1, BOTH: 2}[sources[node]]] += 1
    return counts[0], counts[1], counts[2]
