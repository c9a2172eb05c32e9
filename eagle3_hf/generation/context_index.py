"""A context index over the prompt and the output so far: where the current suffix occurred before, and what followed.

`ContextIndex` is updated one token at a time in amortised O(1) (for a fixed `max_ngram`):

* a suffix automaton (Blumer et al. 1985) gives the longest suffix of the sequence that also ends at an earlier
  position, and that earlier position: the automaton's state for the whole sequence links to the state of its longest
  suffix occurring at least twice, whose first end position is kept per state (a clone inherits its original's);
* per n-gram length k <= `max_ngram`, the end positions of every k-gram (newest last) give the several places a
  shorter suffix occurred, newest first, so that the index can offer several continuations where the longest match
  alone offers one.

`candidates` lists earlier end positions to continue from (the longest match's first, then the most recent
occurrences of ever shorter suffixes); `build_trie` merges their continuations into a small weighted trie
(`LookupTrie`): each node counts the continuations through it and keeps the longest match supporting it.

Positions are end indices: an occurrence "ending at e" is `tokens[e - l : e]`, and its continuation starts at
`tokens[e]`. Only e < len(tokens) counts as earlier (so a continuation is never empty).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["ContextIndex", "LookupTrie", "build_trie", "common_suffix_length"]

MATCH_CAP = 64  # match lengths are measured up to this many tokens: beyond it they predict no better


@dataclass
class LookupTrie:
    """Continuations merged into a trie. Node 0 is the root (the current last token, `tokens[0] == -1`);
    `parents[i] < i`. `counts[i]`: continuations through node i (`counts[0]`: all of them); `match[i]`: the longest
    match length among them (the context they continue agreed with the current suffix on that many tokens)."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    counts: list[int] = field(default_factory=lambda: [0])
    match: list[int] = field(default_factory=lambda: [0])

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        depth = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depth[i] = depth[self.parents[i]] + 1
        return depth


def common_suffix_length(tokens: list[int], end: int, cap: int = MATCH_CAP) -> int:
    """How many tokens `tokens[:end]` and the whole of `tokens` agree on, counted backwards (at most `cap`)."""
    n, length = len(tokens), 0
    while length < cap and length < end and tokens[end - 1 - length] == tokens[n - 1 - length]:
        length += 1
    return length


def build_trie(tokens: list[int], candidates: Iterable[tuple[int, int]], depth: int) -> LookupTrie:
    """Merge the continuations `tokens[e : e + depth]` of `candidates` `(end e, match length)` into a trie, in order
    (so node order, and so tie-breaking later, follows the candidates' order)."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1 (tokens per continuation), got {depth}.")
    trie = LookupTrie()
    children: dict[tuple[int, int], int] = {}
    for end, match in candidates:
        if not 0 <= end < len(tokens):
            raise ValueError(f"candidate end {end} is not an earlier position of a sequence of {len(tokens)} tokens.")
        node = 0
        trie.counts[0] += 1
        trie.match[0] = max(trie.match[0], match)
        for tok in tokens[end : end + depth]:
            child = children.get((node, tok))
            if child is None:
                child = len(trie.tokens)
                children[(node, tok)] = child
                trie.tokens.append(tok)
                trie.parents.append(node)
                trie.counts.append(0)
                trie.match.append(0)
            trie.counts[child] += 1
            trie.match[child] = max(trie.match[child], match)
            node = child
    return trie


class ContextIndex:
    """The suffix automaton and n-gram occurrence lists of one growing token sequence (see the module docstring)."""

    def __init__(self, max_ngram: int = 4) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}.")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # suffix automaton, one entry per state; state 0 is the empty string
        self._length: list[int] = [0]
        self._link: list[int] = [-1]
        self._next: list[dict[int, int]] = [{}]
        self._first_end: list[int] = [-1]  # end position of the state's first occurrence
        self._last = 0  # the state of the whole sequence
        self._ngrams: dict[tuple[int, ...], list[int]] = {}  # k-gram -> its end positions, ascending

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in map(int, tokens):
            self.tokens.append(token)
            n = len(self.tokens)
            for k in range(1, min(self.max_ngram, n) + 1):
                self._ngrams.setdefault(tuple(self.tokens[n - k :]), []).append(n)
            self._extend_automaton(token, n)

    def _extend_automaton(self, token: int, n: int) -> None:
        length, link, nxt, first = self._length, self._link, self._next, self._first_end
        cur = len(length)
        length.append(length[self._last] + 1)
        link.append(0)
        nxt.append({})
        first.append(n)
        p = self._last
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone holds the shorter strings, which now also end at n
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                nxt.append(dict(nxt[q]))
                first.append(first[q])
                while p != -1 and nxt[p].get(token) == q:
                    nxt[p][token] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self._last = cur

    def longest_match(self) -> tuple[int, int]:
        """`(length, end)`: the longest suffix that also ends at an earlier position, and the first such position;
        `(0, -1)` when not even the last token occurred before."""
        state = self._link[self._last] if self.tokens else 0
        if state <= 0:
            return 0, -1
        return self._length[state], self._first_end[state]

    def occurrences(self, k: int, limit: int) -> list[int]:
        """The most recent `limit` earlier end positions of the last `k` tokens (k <= max_ngram), newest first."""
        if not 1 <= k <= self.max_ngram:
            raise ValueError(f"k must be in [1, max_ngram={self.max_ngram}], got {k}.")
        n = len(self.tokens)
        if k > n or limit < 1:
            return []
        ends = self._ngrams.get(tuple(self.tokens[n - k :]), [])
        found: list[int] = []
        for end in reversed(ends):  # the last entry is n itself
            if end < n:
                found.append(end)
                if len(found) == limit:
                    break
        return found

    def candidates(self, branches: int) -> list[tuple[int, int]]:
        """Up to `branches` distinct earlier end positions to continue from, `(end, match length)`: the longest
        match first, then the most recent occurrences of the last k tokens, k from min(longest, max_ngram) down to 1.
        A match length is measured (up to `MATCH_CAP`), not just the k it was found with."""
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}.")
        longest, end = self.longest_match()
        if longest == 0:
            return []
        found = [(end, min(longest, MATCH_CAP))]
        seen = {end}
        for k in range(min(longest, self.max_ngram), 0, -1):
            if len(found) >= branches:
                break
            for e in self.occurrences(k, branches + len(seen)):
                if e not in seen:
                    seen.add(e)
                    found.append((e, common_suffix_length(self.tokens, e)))
                    if len(found) >= branches:
                        break
        return found

    def lookup(self, depth: int, branches: int) -> LookupTrie:
        """The weighted trie of the continuations (`depth` tokens at most) of `candidates(branches)`."""
        return build_trie(self.tokens, self.candidates(branches), depth)
