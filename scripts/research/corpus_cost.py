"""What the corpus index costs and what it predicts, on the SmolLM2 answers in examples/data/.

Builds the index (`eagle3_hf.generation.corpus_index`) from the target's regenerated answers
(`examples/data/smollm2_*_regen*.tar.gz`: greedy answers; the sampled ones are left out), leaving out the conversations
that ask an MT-bench question as `eagle3-hf corpus` does, and prints:

* tokens, answers, seconds to tokenise and to build, bytes per token in memory, the file's size, seconds to load;
* per query, on every answer position of the target's own greedy answers to the 80 MT-bench first turns
  (`smollm2_mtbench_turn1_regen.tar.gz`, which the corpus leaves out): microseconds of `longest_match` and of
  `lookup` (the whole per-cycle query), mean, median and 99th percentile;
* first-token hit rates at those positions, over all of them: the context lookup alone (`ContextIndex` over the
  current prompt and answer, as decoding keeps it), the corpus alone, and the context falling back to the corpus
  where it has no continuation; "proposes" is the share of positions with a guess; and how often the corpus's guess
  is right by the length of the match it rests on.

Wall-clock timings in one thread: run it on an otherwise idle machine.

Usage: python scripts/research/corpus_cost.py [--max-len 6 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import tarfile
import tempfile
import time

from eagle3_hf.generation.context_index import ContextIndex, LookupTrie
from eagle3_hf.generation.corpus_index import CorpusIndex, CorpusOptions
from eagle3_hf.modeling.shipped import default_prompts_path
from eagle3_hf.targets import load_tokenizer
from eagle3_hf.training.corpus import corpus_documents
from eagle3_hf.training.data import build_dataset, read_conversations
from eagle3_hf.training.prompt_selection import read_evaluation_prompts

DATA = "examples/data"
EVALUATION = "regen_mtbench"  # the folder smollm2_mtbench_turn1_regen.tar.gz holds


def first_guess(trie: LookupTrie) -> int | None:
    """The most frequent first token of a trie (ties: the first), or None."""
    best = None
    for i in range(1, trie.num_nodes):
        if trie.parents[i] == 0 and (best is None or trie.counts[i] > trie.counts[best]):
            best = i
    return None if best is None else trie.tokens[best]


def percentiles(seconds: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in seconds)
    return {"mean_us": statistics.fmean(us), "median_us": us[len(us) // 2], "p99_us": us[int(0.99 * len(us))]}


def evaluation_rows(folder: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(input ids, answer positions) of each evaluation conversation, tokenised as training does."""
    dataset, _ = build_dataset(read_conversations(folder), tokenizer, max_length=1 << 30)
    return [
        (ids, [t for t, m in enumerate(mask) if m]) for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"])
    ]


def measure(index: CorpusIndex, rows, options: CorpusOptions) -> dict:
    """Query costs and first-token hit rates over every answer position of `rows`."""
    match_s, lookup_s = [], []
    hits = {"context": 0, "corpus": 0, "context_then_corpus": 0}
    proposes = dict.fromkeys(hits, 0)
    by_match: dict[int, list[int]] = {}  # the corpus's match length (8: 8 or more) -> [guesses, right]
    positions = 0
    for ids, answer in rows:
        context = ContextIndex(max_ngram=4)
        context.extend(ids[: answer[0]])
        for t in answer:
            recent = ids[max(0, t - options.max_len) : t]
            start = time.perf_counter()
            index.longest_match(recent, options.min_len, options.max_len)
            match_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            trie = index.lookup(recent, options)
            lookup_s.append(time.perf_counter() - start)
            from_context = first_guess(context.lookup(depth=1, branches=4))
            from_corpus = first_guess(trie)
            guesses = {
                "context": from_context,
                "corpus": from_corpus,
                "context_then_corpus": from_context if from_context is not None else from_corpus,
            }
            for name, guess in guesses.items():
                proposes[name] += guess is not None
                hits[name] += guess == ids[t]
            if from_corpus is not None:
                counts = by_match.setdefault(min(trie.match[0], 8), [0, 0])
                counts[0] += 1
                counts[1] += from_corpus == ids[t]
            positions += 1
            context.extend(ids[len(context) : t + 1])
    return {
        "positions": positions,
        "longest_match": percentiles(match_s),
        "lookup": percentiles(lookup_s),
        "hit_rate": {name: hits[name] / positions for name in hits},
        "proposes": {name: proposes[name] / positions for name in proposes},
        "corpus_by_match": {k: {"guesses": g, "right": r / g} for k, (g, r) in sorted(by_match.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-len", type=int, nargs="+", default=[6, 16], help="longest corpus match, per run")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    tokenizer = load_tokenizer("smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted(glob.glob(os.path.join(DATA, "smollm2_*_regen*.tar.gz"))):
            with tarfile.open(path) as tar:
                tar.extractall(tmp, filter="data")
        folders = sorted(os.path.join(tmp, name) for name in os.listdir(tmp))
        prompts = read_evaluation_prompts([default_prompts_path()])
        start = time.perf_counter()
        documents, stats = corpus_documents(tokenizer, folders, exclude=prompts)
        tokenised = time.perf_counter() - start
        start = time.perf_counter()
        index = CorpusIndex.build(documents, vocab_size=len(tokenizer))
        built = time.perf_counter() - start
        path = os.path.join(tmp, "corpus.safetensors")
        index.save(path)
        start = time.perf_counter()
        index = CorpusIndex.load(path)
        loaded = time.perf_counter() - start
        results = {
            "data": [os.path.basename(f) for f in folders],
            **stats.to_dict(),
            "tokens": index.num_tokens,
            "answers": index.num_documents,
            "tokenise_s": tokenised,
            "build_s": built,
            "load_s": loaded,
            "bytes": index.nbytes,
            "bytes_per_token": index.nbytes / index.num_tokens,
            "file_bytes": os.path.getsize(path),
            "runs": {},
        }
        rows = evaluation_rows(os.path.join(tmp, EVALUATION), tokenizer)
    print(
        f"{results['tokens']} tokens in {results['answers']} answers ({stats.conversations_excluded} of "
        f"{stats.conversations_read} conversations left out as MT-bench prompts); tokenised in {tokenised:.1f} s, "
        f"built in {built:.2f} s, loaded in {loaded:.3f} s; {results['bytes_per_token']:.2f} bytes per token "
        f"({results['bytes'] / 2**20:.1f} MiB), file {results['file_bytes'] / 2**20:.1f} MiB"
    )
    for max_len in args.max_len:
        run = measure(index, rows, CorpusOptions(max_len=max_len))
        results["runs"][str(max_len)] = run
        times = "; ".join(
            f"{name} {run[name]['mean_us']:.0f} us mean, {run[name]['median_us']:.0f} median, "
            f"{run[name]['p99_us']:.0f} p99"
            for name in ("longest_match", "lookup")
        )
        rates = ", ".join(
            f"{name} {run['hit_rate'][name]:.3f} (proposes {run['proposes'][name]:.2f})" for name in run["hit_rate"]
        )
        by_match = ", ".join(
            f"{k}{'+' if k == 8 else ''}: {v['right']:.2f} of {v['guesses']}" for k, v in run["corpus_by_match"].items()
        )
        print(
            f"max_len {max_len}, {run['positions']} MT-bench answer positions: {times}\n  first-token hit rate: "
            f"{rates}\n  corpus guesses right, by match length: {by_match}"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
