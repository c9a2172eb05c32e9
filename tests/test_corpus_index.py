"""The corpus index (generation/corpus_index.py) against brute-force search on random small corpora (small
vocabularies, so that matches are long and frequent): the occurrences of every suffix of a context, the longest
match, the continuation tries; answers never run into each other; files round-trip; bad input is refused."""

from collections import Counter

import numpy as np
import pytest
import torch

from eagle3_hf.generation import corpus_index
from eagle3_hf.generation.context_index import LookupTrie
from eagle3_hf.generation.corpus_index import SEPARATOR, CorpusIndex, CorpusOptions, sort_backward
from eagle3_hf.generation.hybrid import (
    BOTH,
    LOOKUP,
    Candidates,
    LookupStats,
    graft,
)
from eagle3_hf.generation.tree import HostTree

SEEDS = range(6)


def random_corpus(seed):
    """(documents, vocab size, contexts): documents over a small vocabulary, some built from repeated phrases (as
    answers repeat themselves), and contexts that end inside them, outside them, or on an unknown token."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 7))
    phrases = [rng.integers(0, vocab, size=int(rng.integers(2, 6))).tolist() for _ in range(3)]
    documents = []
    for _ in range(int(rng.integers(4, 16))):
        doc = []
        while len(doc) < int(rng.integers(0, 30)):
            doc += phrases[int(rng.integers(3))] if rng.random() < 0.5 else [int(rng.integers(vocab))]
        documents.append(doc)
    if not any(documents):
        documents.append([0, 1 % vocab])
    contexts = [rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist() for _ in range(20)]
    for doc in documents:
        if len(doc) > 2:
            cut = int(rng.integers(1, len(doc)))
            contexts.append(rng.integers(0, vocab, size=2).tolist() + doc[:cut])
    contexts += [[0, vocab], [vocab - 1, 0, 1 % vocab, vocab + 3, 0]]  # vocab and beyond: no token
    return documents, vocab, contexts


def flat(documents):
    out = [SEPARATOR]
    for doc in documents:
        if doc:
            out += list(doc) + [SEPARATOR]
    return out


def brute_ends(tokens, pattern):
    """End positions e with tokens[e - k + 1 : e + 1] == pattern (k = len(pattern))."""
    k = len(pattern)
    return {e for e in range(k - 1, len(tokens)) if tokens[e - k + 1 : e + 1] == list(pattern)}


def brute_ranges(tokens, context, vocab, max_len):
    """Per k: the set of end positions of the context's last k tokens, while there are any."""
    out = []
    for k in range(1, min(max_len, len(context)) + 1):
        pattern = context[-k:]
        if not 0 <= pattern[0] < vocab:
            break
        ends = brute_ends(tokens, pattern)
        if not ends:
            break
        out.append(ends)
    return out


def brute_prefix_counts(tokens, ends, depth):
    """How many of the continuations after `ends` (cut at the answer's end) start with each prefix."""
    counts = Counter()
    for e in ends:
        continuation = []
        for t in tokens[e + 1 : e + 1 + depth]:
            if t == SEPARATOR:
                break
            continuation.append(t)
            counts[tuple(continuation)] += 1
    return counts


def brute_trie(counts, branches, min_count, max_nodes=None):
    """The expected (path, count) list: level by level, each kept node's children by count (then token), at most
    `branches` of those seen `min_count` times; then the `max_nodes` most frequent, in that order."""
    nodes, level = [], [()]
    while level:
        below = []
        for parent in level:
            children = [(p, c) for p, c in counts.items() if len(p) == len(parent) + 1 and p[:-1] == parent]
            children = sorted((c for c in children if c[1] >= min_count), key=lambda pc: (-pc[1], pc[0][-1]))
            below += [p for p, _ in children[:branches]]
            nodes += children[:branches]
        level = below
    if max_nodes is not None and len(nodes) > max_nodes:
        keep = set(sorted(range(len(nodes)), key=lambda i: (-nodes[i][1], i))[:max_nodes])
        nodes = [n for i, n in enumerate(nodes) if i in keep]
    return nodes


def trie_paths(trie):
    paths = [()]
    for i in range(1, trie.num_nodes):
        assert trie.parents[i] < i
        paths.append(paths[trie.parents[i]] + (trie.tokens[i],))
    return [(paths[i], trie.counts[i]) for i in range(1, trie.num_nodes)]


# ---------------------------------------------------------------------------------------------------------------
# against brute force


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("depth", [3, 64])
@pytest.mark.parametrize("scan", [1, 256])  # ranges narrowed by bisection, or read at once
def test_match_ranges_hold_exactly_the_occurrences(seed, depth, scan, monkeypatch):
    monkeypatch.setattr(corpus_index, "_SCAN", scan)
    documents, vocab, contexts = random_corpus(seed)
    index = CorpusIndex.build(documents, vocab, depth=depth)
    tokens = flat(documents)
    assert index.tokens.tolist() == tokens and index.num_documents == sum(1 for d in documents if d)
    for context in contexts:
        for max_len in (1, 4, 12):
            expected = brute_ranges(tokens, context, vocab, min(max_len, depth))
            ranges = index.match_ranges(context, max_len)
            assert len(ranges) == len(expected), (context, max_len)
            for (lo, hi), ends in zip(ranges, expected):
                assert set(index.suffix_array[lo:hi].tolist()) == ends and hi - lo == len(ends)
            for min_len in (1, 2, 3):
                length, lo, hi = index.longest_match(context, min_len=min_len, max_len=max_len)
                if len(expected) >= min_len:
                    assert length == len(expected) and set(index.suffix_array[lo:hi].tolist()) == expected[-1]
                else:
                    assert (length, lo, hi) == (0, 0, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_array_is_sorted_backwards_on_its_depth(seed):
    documents, vocab, _ = random_corpus(seed)
    tokens = np.array(flat(documents), dtype=np.int32)
    for depth in (1, 2, 5, 64):
        order = sort_backward(tokens, depth).tolist()
        assert sorted(order) == [i for i, t in enumerate(tokens.tolist()) if t != SEPARATOR]
        keys = [[int(tokens[e - j]) if e - j >= 0 else SEPARATOR for j in range(depth)] for e in order]
        assert keys == sorted(keys)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("branches", "min_count", "max_nodes"), [(99, 1, None), (2, 2, None), (1, 1, None), (3, 2, 4)])
def test_continuations_count_what_follows(seed, branches, min_count, max_nodes):
    documents, vocab, contexts = random_corpus(seed)
    index = CorpusIndex.build(documents, vocab)
    tokens = flat(documents)
    checked = 0
    for context in contexts:
        for k, (lo, hi) in enumerate(index.match_ranges(context, 8), start=1):
            counts = brute_prefix_counts(tokens, index.suffix_array[lo:hi].tolist(), depth=4)
            trie = index.continuations(
                lo,
                hi,
                depth=4,
                branches=branches,
                min_count=min_count,
                match=k,
                max_samples=10_000,
                max_nodes=max_nodes,
            )
            assert trie_paths(trie) == brute_trie(counts, branches, min_count, max_nodes), (context, k)
            assert trie.counts[0] == sum(c for p, c in counts.items() if len(p) == 1)
            assert set(trie.match) == {k}
            checked += trie.num_nodes > 1
    assert checked > 5  # the corpora are repetitive enough to make real tries


@pytest.mark.parametrize("seed", SEEDS)
def test_lookup_takes_the_longest_match_with_a_repeated_continuation(seed):
    documents, vocab, contexts = random_corpus(seed)
    index = CorpusIndex.build(documents, vocab)
    tokens = flat(documents)
    options = CorpusOptions(depth=3, branches=2, min_len=2, max_len=6, min_count=2)
    for context in contexts:
        expected = None  # (match length, nodes) of the longest match with a continuation seen twice
        for k in range(len(brute_ranges(tokens, context, vocab, 6)), 1, -1):
            counts = brute_prefix_counts(tokens, brute_ends(tokens, context[-k:]), 3)
            if brute_trie(counts, 2, 2):
                expected = (k, brute_trie(counts, 2, 2))
                break
        trie = index.lookup(context, options)
        if expected is None:
            assert trie == LookupTrie()
        else:
            assert (trie.match[0], trie_paths(trie)) == expected
        assert index.lookup(torch.tensor(context), options) == trie == index.lookup(np.array(context), options)


# ---------------------------------------------------------------------------------------------------------------
# answers are separate; samples; files


def test_a_match_never_spans_two_answers_and_a_continuation_stops_at_the_end():
    index = CorpusIndex.build([[1, 2], [3, 4], [5, 6], [7, 8], [1, 2, 9]], vocab_size=10)
    assert index.longest_match([2, 3], min_len=1)[0] == 1  # "2 3" only across the boundary
    assert index.longest_match([9, 1, 2], min_len=1)[0] == 2  # not "9 | 1 2" across the boundary before it
    length, lo, hi = index.longest_match([5, 6])
    assert length == 2 and index.continuations(lo, hi, 4, 4, 1, match=2).num_nodes == 1  # 6 ends its answer
    trie = index.continuations(*index.longest_match([1, 2])[1:], depth=4, branches=4, min_count=1, match=2)
    assert trie_paths(trie) == [((9,), 1)] and trie.counts[0] == 1
    assert [d.tolist() for d in index.documents()] == [[1, 2], [3, 4], [5, 6], [7, 8], [1, 2, 9]]


def test_a_frequent_suffix_is_sampled():
    # "0 1" followed by 2 three times in four, by 3 otherwise: 4000 occurrences, 64 read
    documents = [[0, 1, 2 if i % 4 else 3] for i in range(4000)]
    index = CorpusIndex.build(documents, vocab_size=4)
    length, lo, hi = index.longest_match([0, 1])
    assert (length, hi - lo) == (2, 4000)
    trie = index.continuations(lo, hi, depth=2, branches=4, min_count=2, match=2, max_samples=64)
    assert trie.counts[0] == 64 and trie.tokens[1] == 2 and 40 <= trie.counts[1] <= 56 and trie.num_nodes == 3


def test_the_trie_feeds_the_hybrid_trees():
    index = CorpusIndex.build([[4, 5, 6, 7], [4, 5, 6, 8], [4, 5, 6, 7], [1, 5, 9]], vocab_size=10)
    trie = index.lookup([0, 4, 5], CorpusOptions(depth=3))
    assert trie_paths(trie) == [((6,), 3), ((6, 7), 2)] and trie.match == [2, 2, 2]
    cands = Candidates.of(trie, LookupStats())
    row = graft(HostTree([5], [-1], [0.0]), cands, total_tokens=8)
    tree, sources = row.tree, row.sources
    assert tree.tokens.tolist() == [5, 6, 7] and tree.parents.tolist() == [-1, 0, 1] and sources == [0, LOOKUP, LOOKUP]
    assert row.match[LOOKUP] == [0, 2, 3]  # effective match: the 2 tokens matched, then the continuation's tokens above
    merged = graft(tree.host, cands, total_tokens=8)  # a second source: equal nodes merge
    assert merged.tree.tokens.tolist() == [5, 6, 7] and merged.sources == [0, BOTH, BOTH]


def test_save_and_load_round_trip(tmp_path):
    documents, vocab, contexts = random_corpus(3)
    index = CorpusIndex.build(documents, vocab, depth=8, metadata={"target": "org/name", "answers": 7})
    index.save(tmp_path / "corpus.safetensors")
    loaded = CorpusIndex.load(tmp_path / "corpus.safetensors")
    assert np.array_equal(loaded.tokens, index.tokens) and np.array_equal(loaded.suffix_array, index.suffix_array)
    assert (loaded.vocab_size, loaded.depth, loaded.metadata) == (vocab, 8, {"target": "org/name", "answers": 7})
    assert loaded.nbytes == index.nbytes <= 8 * index.num_tokens + 4 * index.num_documents + 8 * (vocab + 1) + 4
    for context in contexts:
        assert loaded.lookup(context) == index.lookup(context)


# ---------------------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    ("documents", "vocab", "fragment"),
    [
        ([], 10, "The corpus is empty"),
        ([[], []], 10, "The corpus is empty"),
        ([[1, 2], [3, 10]], 10, "document 1 holds token id 10, outside the vocabulary [0, 10)"),
        ([[1, -1]], 10, "document 0 holds token id -1"),
        ([[0.5, 1.0]], 10, "integer token ids, got an array of dtype float64"),
        ([[[1, 2]]], 10, "shape (1, 2)"),
        ([[1]], 0, "vocab_size must be >= 1, got 0"),
    ],
)
def test_bad_corpora_are_refused(documents, vocab, fragment):
    with pytest.raises(ValueError) as info:
        CorpusIndex.build(documents, vocab)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"min_len": 0}, "corpus min_len must be >= 1, got 0"),
        ({"min_len": 5, "max_len": 4}, "min_len (5) must be <= max_len (4)"),
        ({"max_samples": 0}, "corpus max_samples must be >= 1, got 0"),
    ],
)
def test_bad_options_are_refused(options, fragment):
    with pytest.raises(ValueError) as info:
        CorpusOptions(**options)
    assert fragment in str(info.value)


def test_wrong_files_are_refused(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match="No corpus index at .*nothing.safetensors"):
        CorpusIndex.load(tmp_path / "nothing.safetensors")
    (tmp_path / "text.safetensors").write_text("not a tensor file")
    with pytest.raises(ValueError, match="text.safetensors.*not a safetensors file"):
        CorpusIndex.load(tmp_path / "text.safetensors")
    save_file({"d2t": torch.zeros(3, dtype=torch.long)}, tmp_path / "vocab.safetensors")
    with pytest.raises(ValueError, match="vocab.safetensors' is not a corpus index .* tensors \\['d2t'\\]"):
        CorpusIndex.load(tmp_path / "vocab.safetensors")
    index = CorpusIndex.build([[1, 2, 3]], vocab_size=4)
    index.vocab_size = 3  # a file whose tokens do not fit its vocabulary
    index.save(tmp_path / "damaged.safetensors")
    with pytest.raises(ValueError, match="damaged.safetensors.*token id 3 is outside the vocabulary \\[0, 3\\)"):
        CorpusIndex.load(tmp_path / "damaged.safetensors")
    with pytest.raises(ValueError, match="not a range of the suffix array of 3 entries"):
        index.continuations(2, 9, depth=2, branches=2, match=1)
