"""One tree from several sources: the draft's tree, the context lookup's continuations (context_index.py) and the
corpus's (corpus_index.py: the target's earlier answers).

The lookup sources are merged first (`merge_candidates`, context first): a corpus node equal to a context node (same
token under the same parent) becomes one node of both sources, estimated at the larger of the two estimates; every
node keeps its sources (bit flags) and its effective match length per source, so that acceptance is counted per
source (`source_counts`) and each source's hit rates are learnt from its own nodes (`LookupStats`, one per source).

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
draw sequence (`RowTree.draws`), where recursive rejection treats it as an ordinary proposal that cannot be
accepted. Why this stays lossless: see `eagle3_hf.generation.verification.sample_accept`.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import torch

from eagle3_hf.generation.context_index import ContextIndex, LookupTrie
from eagle3_hf.generation.transfers import upload
from eagle3_hf.generation.tree import DraftTree, HostTree, cut_host, subtree

__all__ = [
    "BOTH",
    "CORPUS",
    "CORPUS_PRIOR_RATES",
    "DRAFT",
    "LOOKUP",
    "SOURCE_NAMES",
    "Candidates",
    "LookupOptions",
    "LookupState",
    "LookupStats",
    "RowTree",
    "best_lookup_nodes",
    "graft",
    "graft_sampled",
    "merge_candidates",
    "observe_nodes",
    "source_counts",
    "source_totals",
]

# node sources, as bit flags: BOTH == DRAFT | LOOKUP (the context lookup); a node may hold several
DRAFT, LOOKUP, BOTH, CORPUS = 1, 2, 3, 4
SOURCE_NAMES = ("draft", "context", "corpus", "several")  # what `source_counts` counts, in its order

# Prior hit rate of a lookup node by effective match length 1, 2, ..., 8+ (before the call has measured any): the
# next token after an earlier occurrence of the last token is right about a quarter of the time in chat answers,
# after a repeated bigram 0.45-0.8 (examples/copy_analysis.py measured 0.78-0.83 on MT-bench with SmolLM2).
PRIOR_RATES = (0.25, 0.45, 0.55, 0.62, 0.68, 0.72, 0.75, 0.78)
# The corpus's first-token hit rates by match length, measured on SmolLM2's answers to MT-bench (docs/corpus.md:
# 0.25 on 2 tokens, 0.33 on 3, 0.38 on 4, 0.46 on 5, 0.48 on 6 and 7, 0.75 on 8 or more), lower than the context's:
# an answer repeats itself more than other answers repeat it. A 1-token match is never used (CorpusOptions.min_len).
CORPUS_PRIOR_RATES = (0.2, 0.25, 0.33, 0.38, 0.46, 0.48, 0.48, 0.6)


@dataclass
class LookupStats:
    """Hit rates of one lookup source's nodes by effective match length, measured during one call from its prior
    (`PRIOR_RATES` for the context, `CORPUS_PRIOR_RATES` for the corpus)."""

    prior: tuple[float, ...] = PRIOR_RATES
    prior_weight: float = 4.0  # pseudo-trials at the prior rate
    hits: list[float] = field(default_factory=lambda: [0.0] * len(PRIOR_RATES))
    trials: list[float] = field(default_factory=lambda: [0.0] * len(PRIOR_RATES))

    @staticmethod
    def bucket(match: int) -> int:
        return min(max(match, 1), len(PRIOR_RATES)) - 1

    def rate(self, match: int) -> float:
        b = self.bucket(match)
        return (self.hits[b] + self.prior_weight * self.prior[b]) / (self.trials[b] + self.prior_weight)

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

    def propose(self, tokens: list[int]) -> Candidates:
        """This cycle's candidates after `tokens` (the whole sequence so far; the index reads only what it has not
        indexed yet, so that a cycle costs no more on a long sequence), with their conditional estimates."""
        if self.index is None:
            self.index = ContextIndex(max_ngram=self.options.max_ngram)
        self.index.extend(tokens[len(self.index) :])
        trie = self.index.lookup(self.options.depth, self.options.branches)
        return Candidates.of(trie, self.stats)


def observe_nodes(stats: LookupStats, parents: list[int], match: list[int], path: list[int]) -> None:
    """Count every node of a source (`match[node] > 0`: its effective match there) whose parent was accepted."""
    on_path = set(path)
    for node in range(1, len(parents)):
        if match[node] > 0 and parents[node] in on_path:
            stats.observe(match[node], node in on_path)


@dataclass
class Candidates:
    """One row's lookup continuations this cycle, from one source or several merged: the trie, each node's
    conditional estimate, its sources (LOOKUP, CORPUS or both) and its effective match per source (0: not from it)."""

    trie: LookupTrie
    cond: list[float]
    sources: list[int]
    match: dict[int, list[int]]  # per lookup source (LOOKUP, CORPUS): each node's effective match there

    @classmethod
    def of(cls, trie: LookupTrie, stats: LookupStats, source: int = LOOKUP) -> Candidates:
        """One source's trie (`source`: LOOKUP or CORPUS), each node estimated P(accepted | parent accepted) = the
        source's hit rate (`stats`) at its effective match length (match + depth - 1) times its share of the
        parent's continuations (the root's is 1)."""
        depths = trie.depths()
        effective = [0] + [trie.match[i] + depths[i] - 1 for i in range(1, trie.num_nodes)]
        cond = [1.0] + [
            stats.rate(effective[i]) * trie.counts[i] / max(trie.counts[trie.parents[i]], 1)
            for i in range(1, trie.num_nodes)
        ]
        match = {s: effective if s == source else [0] * trie.num_nodes for s in (LOOKUP, CORPUS)}
        return cls(trie, cond, [0] + [source] * (trie.num_nodes - 1), match)


def merge_candidates(first: Candidates, second: Candidates) -> Candidates:
    """`second`'s nodes merged into `first`'s (a node with the same token under the same parent becomes one node of
    both sources, with the larger estimate); `first`'s nodes keep their indices, so parents still come first."""
    tokens, parents = list(first.trie.tokens), list(first.trie.parents)
    mapped = _map_nodes(tokens, parents, second.trie)
    added = [0] * (len(tokens) - first.trie.num_nodes)
    trie = LookupTrie(tokens, parents, first.trie.counts + added, first.trie.match + added)
    match = {source: values + added for source, values in first.match.items()}
    out = Candidates(trie, first.cond + [0.0] * len(added), first.sources + added, match)
    for i in range(1, second.trie.num_nodes):
        node = mapped[i]
        out.cond[node] = max(out.cond[node], second.cond[i])
        out.sources[node] |= second.sources[i]
        for source, values in out.match.items():
            values[node] = max(values[node], second.match[source][i])
        trie.match[node] = max(trie.match[node], second.trie.match[i])
    return out


def _map_nodes(tokens: list[int], parents: list[int], trie: LookupTrie) -> list[int]:
    """Per node of `trie`, the node of the tree (`tokens`, `parents`) it merges into: the one with its token under
    the node its parent maps to, appended to the tree's lists when there is none yet."""
    child_of = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    mapped = [0] * trie.num_nodes
    for i in range(1, trie.num_nodes):
        key = (mapped[trie.parents[i]], trie.tokens[i])
        if key not in child_of:
            child_of[key] = len(tokens)
            tokens.append(trie.tokens[i])
            parents.append(key[0])
        mapped[i] = child_of[key]
    return mapped


@dataclass
class RowTree:
    """One row's proposal: its tree (the root is the row's last token) and, for trees of several sources, per node
    where it came from."""

    tree: DraftTree
    sources: list[int] | None = None  # per node its source bits, DRAFT | LOOKUP | CORPUS; None: the draft alone
    match: dict[int, list[int]] | None = None  # per lookup source, per node: effective match (0: not from it)
    point_mass: torch.Tensor | None = None  # sampled trees: nodes that are lookup proposals (a point mass)
    draws: dict[int, list[int]] | None = None  # sampled trees: draw sequences where duplicates were removed

    def node_sources(self) -> list[int]:
        """Per node its source bits (a tree of the draft alone: DRAFT below the root)."""
        return self.sources if self.sources is not None else [0] + [DRAFT] * (self.tree.num_nodes - 1)

    def prune(self, n: int) -> RowTree:
        """The root and the row's `n` best nodes (by score; a parent always kept before its child), from the tree's
        host lists (the loop reads them before sizing): the cost model's choice of size for a greedy tree."""
        if n >= self.tree.num_nodes - 1:
            return self
        return _cut(self.tree.host, n + 1, self.sources, self.match)


def graft(host: HostTree, cands: Candidates, total_tokens: int) -> RowTree:
    """Merge the candidates' trie into a greedy draft tree read on the host (see the module docstring; a lookup-only
    tree grafts into its root alone); keep the best `total_tokens` nodes."""
    trie, drafted = cands.trie, len(host.tokens)
    tokens, parents = list(host.tokens), list(host.parents)
    mapped = _map_nodes(tokens, parents, trie)
    scores = list(host.scores) + [-math.inf] * (len(tokens) - drafted)
    sources = [0] + [DRAFT] * (drafted - 1) + [0] * (len(tokens) - drafted)
    match = {source: [0] * len(tokens) for source in cands.match}
    for i in range(1, trie.num_nodes):
        node = mapped[i]
        scores[node] = max(scores[node], scores[mapped[trie.parents[i]]] + math.log(max(cands.cond[i], 1e-12)))
        sources[node] |= cands.sources[i]
        for source, values in match.items():
            values[node] = cands.match[source][i]
    return _cut(HostTree(tokens, parents, scores), total_tokens, sources, match)


def _cut(
    host: HostTree,
    total_tokens: int,
    sources: list[int] | None = None,
    match: dict[int, list[int]] | None = None,
) -> RowTree:
    """The root and the best `total_tokens - 1` nodes by score (a parent always kept before its child), on the host
    (the loop places every row's tree on the device at once), with their sources and matches (both None for the
    draft's tree alone). The scores are rounded to the tree's fp32
    first, so that ties are those of the tensor it becomes."""
    host = HostTree(host.tokens, host.parents, array("f", host.scores).tolist())
    if len(host.parents) > total_tokens:
        kept = cut_host(host, total_tokens)
        host = subtree(host, kept)
        if sources is not None:
            sources = [sources[r] for r in kept]
            match = {source: [values[r] for r in kept] for source, values in match.items()}
    return RowTree(DraftTree.on_host(host), sources, match)


def graft_sampled(tree: DraftTree, cands: Candidates, lookup_nodes: list[int]) -> RowTree:
    """Put the candidates' trie nodes `lookup_nodes` (a prefix-closed set, in trie order) first, as point-mass
    proposals, then the sampled draft tree's nodes minus the root's children equal to a lookup depth-1 token (and
    their subtrees). The draft_probs rows of lookup nodes are unused (their children are lookup nodes only)."""
    trie = cands.trie
    t_tokens, t_parents, t_scores = tree.host if tree.host is not None else DraftTree.with_hosts([tree])[0][0].host
    new_of_trie = {i: new for new, i in enumerate([0, *lookup_nodes])}
    parents = [-1] + [new_of_trie[trie.parents[i]] for i in lookup_nodes]
    scores = [0.0]
    for parent, i in zip(parents[1:], lookup_nodes):  # a parent comes first: its score is known
        scores.append(scores[parent] + math.log(max(cands.cond[i], 1e-12)))
    n_lookup = len(lookup_nodes)
    first_level = {trie.tokens[i] for i in lookup_nodes if trie.parents[i] == 0}
    draws = {0: [t_tokens[c] for c in range(1, len(t_tokens)) if t_parents[c] == 0]} if first_level else {}
    new_of_draft = {0: 0}
    rows = [0] * (n_lookup + 1)  # the draft_probs row of each new node (lookup nodes' rows are never read)
    for c in range(1, len(t_tokens)):
        p = t_parents[c]
        if p not in new_of_draft or (p == 0 and t_tokens[c] in first_level):
            continue  # a duplicate of a lookup sibling, or under one: removed
        new_of_draft[c] = len(rows)
        rows.append(c)
    kept = rows[n_lookup + 1 :]  # the draft's nodes that stay, after the lookup's
    tokens = [t_tokens[0]] + [trie.tokens[i] for i in lookup_nodes] + [t_tokens[c] for c in kept]
    parents += [new_of_draft[t_parents[c]] for c in kept]
    scores += [t_scores[c] for c in kept]
    sources = [0] + [cands.sources[i] for i in lookup_nodes] + [DRAFT] * len(kept)
    match = {source: [0] + [m[i] for i in lookup_nodes] + [0] * len(kept) for source, m in cands.match.items()}
    probs = tree.draft_probs[upload(tree.draft_probs.device, rows)[0]] if tree.draft_probs is not None else None
    point_mass = torch.zeros(len(tokens), dtype=torch.bool)
    point_mass[1 : n_lookup + 1] = True
    merged = DraftTree.on_host(HostTree(tokens, parents, array("f", scores).tolist()), probs)
    return RowTree(merged, sources, match, point_mass, draws)


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


def source_counts(sources: list[int], path: list[int], emitted: int) -> tuple[int, int, int, int]:
    """(draft, context, corpus, several): where the accepted nodes of `path` (root excluded) among the `emitted`
    tokens came from -- one source alone, or several (a node that two or three sources proposed)."""
    counts = [0, 0, 0, 0]
    for node in path[1 : 1 + emitted]:
        counts[{DRAFT: 0, LOOKUP: 1, CORPUS: 2}.get(sources[node], 3)] += 1
    return counts[0], counts[1], counts[2], counts[3]


def source_totals(per_cycle: list[tuple[int, ...]]) -> dict[str, int]:
    """The call's totals of `source_counts` tuples, as the generate output's `accepted_from_*` fields
    (`accepted_from_lookup`: the context alone; `accepted_from_both`: several sources)."""
    totals = [sum(counts[i] for counts in per_cycle) for i in range(len(SOURCE_NAMES))]
    return dict(
        zip(("accepted_from_draft", "accepted_from_lookup", "accepted_from_corpus", "accepted_from_both"), totals)
    )
