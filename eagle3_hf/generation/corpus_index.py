"""A corpus index over the target's earlier answers: where the current suffix occurred in them, and what followed.

The context lookup (context_index.py) sees the current prompt and answer only; a target's answers to other prompts
repeat themselves too (the same phrasings, lists, code idioms), so its earlier answers are a second source of
continuations. `CorpusIndex` holds them in about 8 bytes per token:

* `tokens` (int32 `[N]`): the answers one after another, each preceded and followed by `SEPARATOR` (-1):
  ``[-1, a0, a1, ..., -1, b0, ..., -1]``. A context's tokens are >= 0, so a match never spans two answers, and a
  continuation read forward stops at the answer's end;
* `suffix_array` (int32 `[R]`, R = the real tokens): their positions sorted by the string read *backwards* from
  each, ``tokens[e], tokens[e - 1], ...``, compared on its first `depth` tokens. This is the suffix array of the
  reversed sequence. The context's last k tokens read backwards are a prefix of that string, so their occurrences
  (end positions e, the match being ``tokens[e - k + 1 : e + 1]``) are one contiguous range of the array, and the
  range for k + 1 lies inside the range for k: `match_ranges` narrows it one token at a time by binary search
  (O(k log N)), so the longest match and the ranges of every shorter one come from one pass.

`continuations` reads what follows a range's occurrences (a sample of at most `max_samples` of them, evenly spread
over the range, so that a query costs the same on a frequent suffix) and merges them into the `LookupTrie` that the
context lookup builds (counts of the continuations through each node, their match length), so that
`hybrid.Candidates.of` and `hybrid.graft` take it unchanged. Only continuations seen
at least `min_count` times are kept: one occurrence says little about what the target writes next.

The array is built by prefix doubling (Manber & Myers 1993) with numpy sorts over int64 keys, stopped once the
strings are ordered on their first `depth` tokens (`MATCH_CAP`): a query never needs a longer match.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from eagle3_hf.generation.context_index import MATCH_CAP, LookupTrie
from eagle3_hf.modeling.checkpoint_files import CORPUS_FILE, open_safetensors  # CORPUS_FILE: its name beside a draft

__all__ = ["CORPUS_FILE", "SEPARATOR", "CorpusIndex", "CorpusOptions", "sort_backward"]

SEPARATOR = -1  # between answers: never equal to a context's token
FORMAT = "eagle3_hf.corpus/1"
_SCAN = 256  # a range this small is read at once (one numpy gather) rather than bisected token by token


@dataclass
class CorpusOptions:
    """What one corpus query reads and returns (`CorpusIndex.lookup`)."""

    depth: int = 8  # tokens per continuation
    branches: int = 4  # children kept per trie node, the most frequent first
    min_len: int = 2  # shortest match used: one token of context says too little about the next
    max_len: int = 16  # longest match looked for (at most the index's depth)
    min_count: int = 2  # a continuation node is kept when at least this many sampled occurrences go through it
    max_samples: int = 256  # occurrences read per query, evenly spread over the range (bounds a query's cost)
    max_nodes: int = 64  # trie nodes kept, the most frequent first (what a tree can use)

    def __post_init__(self) -> None:
        for name in ("depth", "branches", "min_len", "max_len", "min_count", "max_samples", "max_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"corpus {name} must be >= 1, got {getattr(self, name)}.")
        if self.min_len > self.max_len:
            raise ValueError(f"corpus min_len ({self.min_len}) must be <= max_len ({self.max_len}).")


def sort_backward(tokens: np.ndarray, depth: int = MATCH_CAP) -> np.ndarray:
    """The positions of `tokens` that are not `SEPARATOR`, sorted by the string read backwards from each
    (``tokens[e], tokens[e - 1], ...``, the separator smaller than any token), compared on its first `depth` tokens
    at least. Returns int32 `[R]`."""
    n = len(tokens)
    rank = tokens[::-1].astype(np.int64) + 1  # rank[j]: what the string from reversed position j starts with
    order = np.argsort(rank, kind="stable")
    length = 1  # rank orders the strings on their first `length` tokens
    while length < depth:
        second = np.zeros(n, dtype=np.int64)  # past the sequence's start reads as a separator
        second[: n - length] = rank[length:]
        key = rank * (int(rank.max()) + 1) + second  # < n**2: fits int64 for any corpus under 3e9 tokens
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.concatenate(([0], np.cumsum(ordered[1:] != ordered[:-1])))
        length *= 2
        if rank[order[-1]] == n - 1:  # every string distinct already: longer comparisons change nothing
            break
    order = order[tokens[::-1][order] != SEPARATOR]
    return (n - 1 - order).astype(np.int32)  # reversed position j is forward position n - 1 - j


class CorpusIndex:
    """The target's earlier answers and the suffix array of their reversal (see the module docstring).

    Build one with `CorpusIndex.build(answers, vocab_size)` (or `eagle3-hf corpus`), query it per cycle with
    `lookup(context)`, save it with `save` and read it back with `CorpusIndex.load`."""

    def __init__(
        self,
        tokens: np.ndarray,
        suffix_array: np.ndarray,
        vocab_size: int,
        depth: int = MATCH_CAP,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        _check_arrays(tokens, suffix_array, vocab_size, depth)
        self.tokens = tokens
        self.suffix_array = suffix_array
        self.vocab_size = int(vocab_size)
        self.depth = int(depth)
        self.metadata = dict(metadata or {})
        # The array is sorted by each position's own token first: token t's positions are
        # suffix_array[starts[t] : starts[t + 1]], the first step of every query without a search.
        counts = np.bincount(tokens[tokens != SEPARATOR], minlength=self.vocab_size)
        self._starts = np.concatenate(([0], np.cumsum(counts)))  # int64 [vocab_size + 1]

    @classmethod
    def build(
        cls,
        documents: Iterable[Sequence[int] | np.ndarray | torch.Tensor],
        vocab_size: int,
        depth: int = MATCH_CAP,
        metadata: dict[str, Any] | None = None,
    ) -> CorpusIndex:
        """Index `documents` (each one answer's token ids; empty ones are skipped) over a vocabulary of
        `vocab_size` ids; `depth`: the longest match a query can find. `metadata` (JSON-serialisable) is saved with
        it: where the answers came from, the target and tokenizer they belong to."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (tokens a match may span), got {depth}.")
        separator = np.full(1, SEPARATOR, dtype=np.int32)
        parts = [separator]
        for i, document in enumerate(documents):
            ids = np.asarray(document.cpu() if isinstance(document, torch.Tensor) else document)
            if ids.size == 0:
                continue
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise ValueError(
                    f"document {i} must be a 1-D sequence of integer token ids, got an array of dtype "
                    f"{ids.dtype} and shape {tuple(ids.shape)}."
                )
            bad = ids[(ids < 0) | (ids >= vocab_size)]
            if bad.size:
                raise ValueError(
                    f"document {i} holds token id {int(bad[0])}, outside the vocabulary [0, {vocab_size})."
                )
            parts += [ids.astype(np.int32), separator]
        if len(parts) == 1:
            raise ValueError("The corpus is empty: expected at least one non-empty document (answer) of token ids.")
        tokens = np.concatenate(parts)
        return cls(tokens, sort_backward(tokens, depth), vocab_size, depth, metadata)

    # ------------------------------------------------------------------------------------------------------------
    # size

    @property
    def num_tokens(self) -> int:
        return len(self.suffix_array)

    @property
    def num_documents(self) -> int:
        return len(self.tokens) - len(self.suffix_array) - 1

    @property
    def nbytes(self) -> int:
        """Memory held: the two arrays and the first-token table."""
        return self.tokens.nbytes + self.suffix_array.nbytes + self._starts.nbytes

    def documents(self) -> list[np.ndarray]:
        """The answers, as views of `tokens`."""
        bounds = np.flatnonzero(self.tokens == SEPARATOR)
        return [self.tokens[a + 1 : b] for a, b in zip(bounds[:-1], bounds[1:])]

    # ------------------------------------------------------------------------------------------------------------
    # queries

    def match_ranges(
        self,
        context: Sequence[int] | np.ndarray | torch.Tensor,
        max_len: int = MATCH_CAP,
    ) -> list[tuple[int, int]]:
        """Per k = 1, 2, ...: the range ``[lo, hi)`` of `suffix_array` holding the end positions of the occurrences
        of the context's last k tokens, for every k up to the longest that occurs (at most `max_len` and `depth`).
        Empty when the last token never occurs (or is no token of the vocabulary)."""
        limit = min(max_len, self.depth)
        tail = context[-limit:] if limit > 0 else context[:0]
        recent = tail.tolist() if isinstance(tail, (torch.Tensor, np.ndarray)) else list(tail)
        ranges: list[tuple[int, int]] = []
        for k, token in enumerate(reversed(recent)):  # k: tokens matched so far
            token = int(token)
            if not 0 <= token < self.vocab_size:
                break
            if k == 0:
                lo, hi = int(self._starts[token]), int(self._starts[token + 1])
            else:
                lo, hi = self._narrow(lo, hi, k, token)
            if lo >= hi:
                break
            ranges.append((lo, hi))
        return ranges

    def _narrow(self, lo: int, hi: int, k: int, token: int) -> tuple[int, int]:
        """The part of ``[lo, hi)`` whose (k+1)-th token backwards is `token`. Within the range the first k tokens
        backwards are equal, so the (k+1)-th are sorted: two binary searches find it."""
        tokens, sa = self.tokens, self.suffix_array
        if hi - lo == 1:
            return (lo, hi) if tokens[sa[lo] - k] == token else (lo, lo)
        if hi - lo <= _SCAN:
            keys = tokens[sa[lo:hi] - k]
            return lo + int(np.searchsorted(keys, token, "left")), lo + int(np.searchsorted(keys, token, "right"))
        a, b = lo, hi
        while a < b:
            mid = (a + b) // 2
            if tokens[sa[mid] - k] < token:
                a = mid + 1
            else:
                b = mid
        first, b = a, hi
        while a < b:
            mid = (a + b) // 2
            if tokens[sa[mid] - k] <= token:
                a = mid + 1
            else:
                b = mid
        return first, a

    def longest_match(
        self, context: Sequence[int] | np.ndarray | torch.Tensor, min_len: int = 2, max_len: int = MATCH_CAP
    ) -> tuple[int, int, int]:
        """`(length, lo, hi)`: the longest suffix of `context` (at most `max_len` tokens) that occurs in the
        corpus, and the range of `suffix_array` holding its occurrences' end positions; `(0, 0, 0)` when it is
        shorter than `min_len`."""
        ranges = self.match_ranges(context, max_len)
        if len(ranges) < max(min_len, 1):
            return 0, 0, 0
        return len(ranges), *ranges[-1]

    def continuations(
        self,
        lo: int,
        hi: int,
        depth: int,
        branches: int,
        min_count: int = 2,
        *,
        match: int,
        max_samples: int = 256,
        max_nodes: int | None = None,
    ) -> LookupTrie:
        """The trie of what follows the occurrences in ``suffix_array[lo:hi]`` (`depth` tokens at most, up to the
        answer's end), `match` being their match length. A node is kept when at least `min_count` of the sampled
        occurrences go through it and it is among its parent's `branches` most frequent children (ties: the smaller
        token); then the `max_nodes` most frequent nodes (default: all). Nodes come level by level, children of a
        node the most frequent first. At most `max_samples` occurrences are read, evenly spread over the range."""
        for name, value in (
            ("depth", depth),
            ("branches", branches),
            ("min_count", min_count),
            ("max_samples", max_samples),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if not 0 <= lo <= hi <= len(self.suffix_array):
            raise ValueError(f"[{lo}, {hi}) is not a range of the suffix array of {len(self.suffix_array)} entries.")
        trie = LookupTrie()
        size = hi - lo
        if size == 0:
            return trie
        picks = np.arange(lo, hi) if size <= max_samples else lo + (np.arange(max_samples) * size) // max_samples
        ends = self.suffix_array[picks].astype(np.int64)
        positions = np.minimum(ends[:, None] + np.arange(1, depth + 1), len(self.tokens) - 1)
        # [S, depth]: what follows each sampled occurrence; a separator's node is never kept, so neither is what
        # lies past it (the next answer)
        rows = self.tokens[positions]
        rows = rows[np.lexsort(rows.T[::-1])]  # sorted: rows sharing a prefix are adjacent
        trie.counts[0] = int((rows[:, 0] != SEPARATOR).sum())
        trie.match[0] = match
        if trie.counts[0] == 0:
            return trie
        same = rows[1:] == rows[:-1]
        # each row's common prefix with the row before it: a node of level d starts where that is <= d
        common = np.where(same.all(axis=1), depth, same.argmin(axis=1))
        nodes = _select_nodes(rows, common, branches, min_count, max_nodes)
        index = list(range(len(nodes)))
        if max_nodes is not None and len(nodes) > max_nodes:  # the most frequent (a parent is at least as frequent)
            index = sorted(sorted(index, key=lambda i: (-nodes[i][2], i))[:max_nodes])
        new_of = {0: 0}
        for i in index:
            parent, token, count = nodes[i]
            new_of[i + 1] = trie.num_nodes
            trie.tokens.append(token)
            trie.parents.append(new_of[parent])
            trie.counts.append(count)
            trie.match.append(match)
        return trie

    def lookup(
        self,
        context: Sequence[int] | np.ndarray | torch.Tensor,
        options: CorpusOptions | None = None,
    ) -> LookupTrie:
        """This cycle's trie for a row whose sequence ends with `context` (its last `options.max_len` tokens are
        read): the continuations of the longest match with a continuation seen `min_count` times, trying ever
        shorter matches down to `min_len`; an empty trie (the root alone) when none has one."""
        options = options or CorpusOptions()
        ranges = self.match_ranges(context, options.max_len)
        tried = 0  # occurrences of the last match tried: a shorter match with as many has the same ones
        for k in range(len(ranges), options.min_len - 1, -1):
            lo, hi = ranges[k - 1]
            if hi - lo < options.min_count or hi - lo == tried:
                continue
            tried = hi - lo
            trie = self.continuations(
                lo,
                hi,
                options.depth,
                options.branches,
                options.min_count,
                match=min(k, MATCH_CAP),
                max_samples=options.max_samples,
                max_nodes=options.max_nodes,
            )
            if trie.num_nodes > 1:
                return trie
        return LookupTrie()

    # ------------------------------------------------------------------------------------------------------------
    # files

    def save(self, path: str | os.PathLike) -> None:
        """Write one safetensors file: ``tokens`` and ``suffix_array`` (int32), the rest as its metadata."""
        metadata = {
            "format": FORMAT,
            "vocab_size": str(self.vocab_size),
            "depth": str(self.depth),
            "documents": str(self.num_documents),
            "info": json.dumps(self.metadata, sort_keys=True),
        }
        tensors = {"tokens": torch.from_numpy(self.tokens), "suffix_array": torch.from_numpy(self.suffix_array)}
        save_file(tensors, os.fspath(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CorpusIndex:
        """Read a file written by `save` (`eagle3-hf corpus`); a missing file, another file or a damaged index is
        refused with a `ValueError` naming it."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"No corpus index at {path!r}: expected a file written by `eagle3-hf corpus`.")
        with open_safetensors(path) as f:
            metadata, keys = f.metadata() or {}, set(f.keys())
            if metadata.get("format") != FORMAT or keys != {"tokens", "suffix_array"}:
                raise ValueError(
                    f"{path!r} is not a corpus index written by `eagle3-hf corpus`: its format is "
                    f"{metadata.get('format')!r} with tensors {sorted(keys)}, expected {FORMAT!r} with "
                    "['suffix_array', 'tokens']."
                )
            tokens, suffix_array = f.get_tensor("tokens").numpy(), f.get_tensor("suffix_array").numpy()
        try:
            vocab_size, depth = int(metadata["vocab_size"]), int(metadata["depth"])
            info = json.loads(metadata.get("info", "{}"))
        except (KeyError, ValueError) as err:
            raise ValueError(f"{path!r}: the corpus index's metadata is damaged ({err}).") from err
        try:
            return cls(tokens, suffix_array, vocab_size, depth, info)
        except ValueError as err:
            raise ValueError(f"{path!r}: {err}") from err


def _select_nodes(
    rows: np.ndarray,
    common: np.ndarray,
    branches: int,
    min_count: int,
    max_nodes: int | None,
) -> list[tuple[int, int, int]]:
    """The kept trie nodes of sorted continuation `rows` `[S, depth]` (`common` `[S - 1]`: each row's common prefix
    with the row before it), level by level: `(parent, token, count)`, the parent being a trie index (0: the root,
    node i of the list: i + 1). A node of level d is a run of rows sharing their first d + 1 tokens.

    Every node of every level is found at once with array operations; only the candidates (seen `min_count` times,
    not a separator) are walked in Python. Once `max_nodes` are kept, a deeper node as frequent as the
    `max_nodes`-th can no longer make the cut (ties go to the earlier node), so only more frequent ones are read."""
    num_rows, depth = rows.shape
    starts = np.ones((depth, num_rows), dtype=bool)  # [depth, S]: a node of level d starts at row r
    starts[:, 1:] = common[None, :] <= np.arange(depth)[:, None]
    level, row = np.nonzero(starts)  # every node, level by level, in row order
    last = np.append(level[1:] != level[:-1], True)  # the last node of its level
    counts = np.where(last, num_rows, np.append(row[1:], 0)) - row  # [G]: rows in the node's run
    tokens = rows[row, level]
    # parent: the node of the level above whose run holds the same first row (-1: the root)
    within = np.cumsum(starts, axis=1) - 1  # [depth, S]: index within its level of the node holding each row
    offsets = np.concatenate(([0], np.cumsum(starts.sum(axis=1))[:-1]))  # first node of each level
    parents = np.where(level > 0, offsets[level - 1] + within[level - 1, row], -1)
    chosen = np.flatnonzero((counts >= min_count) & (tokens != SEPARATOR))
    chosen = chosen[np.lexsort((tokens[chosen], -counts[chosen], parents[chosen], level[chosen]))]
    nodes: list[tuple[int, int, int]] = []
    index_of = {-1: 0}  # node -> its trie index (the root: 0)
    siblings: dict[int, int] = {}  # parent node -> children kept so far
    children: dict[int, list[tuple[int, int, int]]] = {}  # this level's candidates by parent node
    floor, current = 0, 0  # counts must exceed `floor`
    for node, lvl, parent, token, count in zip(
        chosen.tolist(),
        level[chosen].tolist(),
        parents[chosen].tolist(),
        tokens[chosen].tolist(),
        counts[chosen].tolist(),
    ):
        if lvl != current:
            floor = _emit(children, index_of, nodes, floor, max_nodes)
            current, children = lvl, {}
        if parent in index_of and count > floor and siblings.get(parent, 0) < branches:
            siblings[parent] = siblings.get(parent, 0) + 1
            children.setdefault(parent, []).append((node, token, count))
    _emit(children, index_of, nodes, floor, max_nodes)
    return nodes


def _emit(
    children: dict[int, list[tuple[int, int, int]]],
    index_of: dict[int, int],
    nodes: list,
    floor: int,
    max_nodes: int | None,
) -> int:
    """Append one level's kept nodes to `nodes`, their parents' trie order first; return the new count floor."""
    for parent in sorted(children, key=index_of.__getitem__):
        for node, token, count in children[parent]:
            nodes.append((index_of[parent], token, count))
            index_of[node] = len(nodes)
    if max_nodes is not None and len(nodes) >= max_nodes:
        floor = max(floor, sorted((n[2] for n in nodes), reverse=True)[max_nodes - 1])
    return floor


def _check_arrays(tokens: np.ndarray, suffix_array: np.ndarray, vocab_size: int, depth: int) -> None:
    """Refuse arrays that are no corpus index (what `load` reads could be anything). O(N): no sort is redone, but a
    suffix array that is not grouped by each position's own token is caught."""
    if vocab_size < 1 or depth < 1:
        raise ValueError(f"vocab_size and depth must be >= 1, got {vocab_size} and {depth}.")
    for name, array in (("tokens", tokens), ("suffix_array", suffix_array)):
        if not isinstance(array, np.ndarray) or array.dtype != np.int32 or array.ndim != 1:
            raise ValueError(
                f"{name} must be a 1-D int32 numpy array, got {getattr(array, 'dtype', type(array))} "
                f"of shape {getattr(array, 'shape', None)}."
            )
    real = int((tokens != SEPARATOR).sum())
    if real == 0 or tokens[0] != SEPARATOR or tokens[-1] != SEPARATOR:
        raise ValueError(
            f"tokens must hold at least one token and start and end with the separator {SEPARATOR}; "
            f"got {len(tokens)} entries, {real} of them tokens."
        )
    bad = tokens[(tokens < SEPARATOR) | (tokens >= vocab_size)]
    if bad.size:
        raise ValueError(f"token id {int(bad[0])} is outside the vocabulary [0, {vocab_size}).")
    if len(suffix_array) != real:
        raise ValueError(f"the suffix array has {len(suffix_array)} entries for {real} tokens.")
    if suffix_array.min() < 0 or suffix_array.max() >= len(tokens) or (tokens[suffix_array] == SEPARATOR).any():
        raise ValueError("the suffix array points outside the tokens or at a separator.")
    if (np.diff(tokens[suffix_array]) < 0).any():
        raise ValueError("the suffix array is not sorted by each position's token.")
