"""The corpus (corpus_index.py: the target's earlier answers) as a lookup source beside the context lookup.

Per call, `CorpusSource` asks the index for each row's continuations every cycle and estimates each node from the
corpus's own hit rates by match length, measured during the call (`hybrid.LookupStats` from `CORPUS_PRIOR_RATES`,
kept apart from the context's, which are higher). Its `Candidates` are merged with the context's (context first,
`hybrid.merge_candidates`) and compete with them and with the draft's nodes for the same node budget, by estimate.

Where the corpus comes from (`open_corpus`): `generate(..., corpus=...)` (a `CorpusIndex`, or a file written by
`eagle3-hf corpus`; False: none), else the assistant's own `corpus` -- `ContextLookup(corpus=...)`, or the
`corpus.safetensors` that `Eagle3DraftModel.from_pretrained` found beside the draft (its path). A file is read once
per process (`load_corpus`, cached by path, size and modification time).

Online growth (`generate(..., corpus_growth=N)`, off by default): the outputs of earlier calls in this process are
indexed too, in a second, bounded `GrowingCorpus` (a suffix array is rebuilt from at most N tokens, the newest kept,
when a call ends), queried after the file's index. Answers the target gave in this process predict its next ones,
but a growth that rebuilt after every call would cost more than it gives: it rebuilds once per `rebuild_every` new
tokens.
"""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from typing import Any

from eagle3_hf.generation.context_index import LookupTrie
from eagle3_hf.generation.corpus_index import CorpusIndex, CorpusOptions
from eagle3_hf.generation.hybrid import (
    CORPUS,
    CORPUS_PRIOR_RATES,
    Candidates,
    LookupStats,
    merge_candidates,
    observe_nodes,
)

__all__ = ["CorpusSource", "GrowingCorpus", "load_corpus", "open_corpus"]


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> CorpusIndex:
    return CorpusIndex.load(path)


def load_corpus(path: str | os.PathLike) -> CorpusIndex:
    """`CorpusIndex.load(path)`, read once per process while the file stays the same."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise ValueError(f"No corpus index at {path!r}: expected a file written by `eagle3-hf corpus`.")
    stat = os.stat(path)
    return _load(path, stat.st_size, stat.st_mtime_ns)


class GrowingCorpus:
    """The outputs of earlier generate() calls of this process, indexed (bounded; see the module docstring)."""

    def __init__(self, max_tokens: int, vocab_size: int, rebuild_every: int = 2048) -> None:
        if max_tokens < 1 or rebuild_every < 1:
            raise ValueError(
                f"corpus growth needs max_tokens and rebuild_every >= 1, got {max_tokens} and {rebuild_every}."
            )
        self.max_tokens, self.vocab_size, self.rebuild_every = max_tokens, vocab_size, rebuild_every
        self.documents: list[list[int]] = []
        self.index: CorpusIndex | None = None
        self._pending = 0  # tokens added since the last rebuild

    def add(self, outputs: list[list[int]]) -> None:
        """Keep `outputs` (each a call's new tokens), the newest `max_tokens` in all; rebuild when due."""
        for output in outputs:
            ids = [int(t) for t in output if 0 <= int(t) < self.vocab_size][-self.max_tokens :]
            if ids:
                self.documents.append(ids)
                self._pending += len(ids)
        total = sum(map(len, self.documents))
        while total > self.max_tokens:
            total -= len(self.documents.pop(0))
        if self.documents and (self.index is None or self._pending >= self.rebuild_every):
            self.index = CorpusIndex.build(self.documents, self.vocab_size, depth=16)
            self._pending = 0


_GROWING: dict[tuple[int, int], GrowingCorpus] = {}  # (max_tokens, vocab_size) -> this process's growth


def growing_corpus(max_tokens: int, vocab_size: int) -> GrowingCorpus:
    """This process's online corpus for that bound and vocabulary."""
    key = (max_tokens, vocab_size)
    if key not in _GROWING:
        _GROWING[key] = GrowingCorpus(max_tokens, vocab_size)
    return _GROWING[key]


class CorpusSource:
    """One call's corpus lookups: the indexes, the query options and the corpus nodes' measured hit rates."""

    def __init__(self, indexes: list[CorpusIndex], options: CorpusOptions, growth: GrowingCorpus | None = None) -> None:
        self.indexes, self.options, self.growth = indexes, options, growth
        self.stats = LookupStats(prior=CORPUS_PRIOR_RATES)

    def propose(self, sequence: list[int]) -> Candidates:
        """The continuations of the row whose tokens so far are `sequence` (the loop's host copy), over every index
        (merged)."""
        recent = list(sequence[-self.options.max_len :])
        queries = [(index, self.options) for index in self.indexes]
        if self.growth is not None and self.growth.index is not None:
            # a continuation seen once is kept: this process's outputs are few, and each is the target's own
            queries.append((self.growth.index, replace(self.options, min_count=1)))
        merged = Candidates.of(LookupTrie(), self.stats, CORPUS)  # the root alone (an online corpus not built yet)
        for index, options in queries:
            trie = index.lookup(recent, options)
            found = Candidates.of(trie, self.stats, CORPUS)
            merged = found if merged.trie.num_nodes == 1 else merge_candidates(merged, found)
        return merged

    def observe(self, parents: list[int], corpus_match: list[int], path: list[int]) -> None:
        observe_nodes(self.stats, parents, corpus_match, path)

    def finish(self, outputs: list[list[int]]) -> None:
        """The call's outputs (per row, its new tokens) join the online corpus, if it grows."""
        if self.growth is not None:
            self.growth.add(outputs)


def open_corpus(corpus: Any, vocab_size: int, depth: int, growth: int | None = None) -> CorpusSource | None:
    """The call's `CorpusSource`, or None without a corpus. `corpus`: a `CorpusIndex`, a file's path, or None /
    False for none; `vocab_size`: the target's (a corpus of a larger vocabulary is another model's); `depth`: tokens
    per continuation; `growth`: the online corpus's bound in tokens (None or 0: no growth)."""
    if corpus is None or corpus is False:
        indexes = []
    elif isinstance(corpus, CorpusIndex):
        indexes = [corpus]
    elif isinstance(corpus, (str, os.PathLike)):
        indexes = [load_corpus(corpus)]
    else:
        raise ValueError(
            f"corpus must be a CorpusIndex, the path of a file written by `eagle3-hf corpus`, or "
            f"None/False; got {type(corpus).__name__}."
        )
    for index in indexes:
        if index.vocab_size > vocab_size:
            raise ValueError(
                f"The corpus was built over a vocabulary of {index.vocab_size} ids, larger than this "
                f"target's {vocab_size}: it holds another model's answers."
            )
    if growth is not None and growth < 0:
        raise ValueError(f"corpus_growth must be >= 0 (tokens kept; 0: no growth), got {growth}.")
    grower = growing_corpus(growth, vocab_size) if growth else None
    if not indexes and grower is None:
        return None
    return CorpusSource(indexes, CorpusOptions(depth=depth), grower)
