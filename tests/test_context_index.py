"""The context index (generation/context_index.py) against a brute-force search, after every appended token, on
random sequences over small and large alphabets and on repetitive ones (periodic text, one token repeated)."""

import random

import pytest

from eagle3_hf.generation.context_index import MATCH_CAP, ContextIndex, build_trie, common_suffix_length


def brute_longest(tokens):
    """(length, first end) of the longest suffix also ending before len(tokens); (0, -1) if none."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        for end in range(length, n):
            if tokens[end - length : end] == suffix:
                return length, end
    return 0, -1


def brute_occurrences(tokens, k, limit):
    n = len(tokens)
    if k > n:
        return []
    suffix = tokens[n - k :]
    ends = [e for e in range(k, n) if tokens[e - k : e] == suffix]
    return ends[::-1][:limit]


def brute_candidates(tokens, branches, max_ngram):
    longest, end = brute_longest(tokens)
    if longest == 0:
        return []
    found, seen = [(end, min(longest, MATCH_CAP))], {end}
    for k in range(min(longest, max_ngram), 0, -1):
        for e in brute_occurrences(tokens, k, len(tokens)):
            if len(found) >= branches:
                return found
            if e not in seen:
                seen.add(e)
                n = len(tokens)
                match = 0
                while match < MATCH_CAP and match < e and tokens[e - 1 - match] == tokens[n - 1 - match]:
                    match += 1
                found.append((e, match))
    return found[:branches]


def sequences():
    rng = random.Random(0)
    yield "random-2", [rng.randrange(2) for _ in range(120)]
    yield "random-5", [rng.randrange(5) for _ in range(150)]
    yield "random-1000", [rng.randrange(1000) for _ in range(80)]
    yield "periodic", ([3, 1, 4, 1, 5, 9, 2, 6] * 12)[:90]
    yield "constant", [7] * 70
    # a list with repeated structure and changing items, like "January 31\nFebruary 28\n"
    text = []
    for item in range(12):
        text += [100, item, 101, rng.randrange(3), 102]
    yield "list", text


@pytest.mark.parametrize("name,tokens", list(sequences()), ids=[n for n, _ in sequences()])
def test_index_matches_brute_force_after_every_token(name, tokens):
    index = ContextIndex(max_ngram=3)
    for n in range(1, len(tokens) + 1):
        index.extend(tokens[n - 1 : n])
        prefix = tokens[:n]
        assert index.longest_match() == brute_longest(prefix), f"{name}, after {n} tokens"
        for k in (1, 2, 3):
            assert index.occurrences(k, 4) == brute_occurrences(prefix, k, 4), f"{name}, k={k}, after {n} tokens"
        assert index.candidates(4) == brute_candidates(prefix, 4, 3), f"{name}, after {n} tokens"
        assert index.candidates(2) == brute_candidates(prefix, 2, 3), f"{name}, after {n} tokens"


def test_longest_match_is_unbounded_and_continues_the_earlier_occurrence():
    tokens = list(range(20)) + [50] + list(range(20))  # the whole 0..19 run repeats
    index = ContextIndex(max_ngram=2)
    index.extend(tokens)
    assert index.longest_match() == (20, 20)
    trie = index.lookup(depth=3, branches=1)
    assert trie.tokens == [-1, 50, 0, 1] and trie.parents == [-1, 0, 1, 2] and trie.match == [20] * 4


def test_trie_merges_equal_continuations_and_counts_them():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]
    # ends 2, 5 and 8 follow "1 2": continuations "3 1", "4 1", "3 1"
    trie = build_trie(tokens, [(2, 2), (5, 2), (8, 2)], depth=2)
    assert trie.tokens == [-1, 3, 1, 4, 1]
    assert trie.parents == [-1, 0, 1, 0, 3]
    assert trie.counts == [3, 2, 2, 1, 1]
    assert trie.depths() == [0, 1, 2, 1, 2]
    # a continuation running into the end of the sequence is cut short, not padded
    assert build_trie(tokens, [(10, 1)], depth=4).tokens == [-1, 2]


def test_several_continuations_where_the_match_occurred_several_times():
    index = ContextIndex(max_ngram=4)
    index.extend([9, 5, 1, 8, 5, 2, 8, 5, 3, 8, 5])  # "8 5" was followed by 2 and 3, "5" also by 1
    trie = index.lookup(depth=1, branches=3)
    assert sorted(trie.tokens[1:]) == [1, 2, 3]
    best = trie.tokens.index(2)  # the longest match ("8 5", first at end 5) comes first
    assert best == 1 and trie.match[best] == 2


def test_common_suffix_length_and_errors():
    assert common_suffix_length([1, 2, 3, 1, 2, 3], 3) == 3
    assert common_suffix_length([5] * 100, 99) == MATCH_CAP
    with pytest.raises(ValueError, match="max_ngram"):
        ContextIndex(max_ngram=0)
    with pytest.raises(ValueError, match="depth"):
        build_trie([1, 2], [(1, 1)], depth=0)
    with pytest.raises(ValueError, match="earlier position"):
        build_trie([1, 2], [(2, 1)], depth=1)
    with pytest.raises(ValueError, match="k must be"):
        ContextIndex(max_ngram=2).occurrences(3, 1)
