"""The corpus as a lookup source in the tree (generation/corpus_source.py): decoding that stays exact.

The corpus holds the target's own greedy answers to other prompts (what `eagle3-hf corpus` indexes), so that its
continuations are often right. Greedy: with a corpus beside the draft and the context (the hybrid tree), with the
corpus and the context and no draft (`ContextLookup(corpus=...)`), and with the corpus alone beside the draft, output
equals plain greedy decoding token for token in fp32 across the families of test_generation.py, for one prompt and
for a left-padded batch -- and the corpus must have proposed accepted tokens, or the test proves nothing. The
accepted tokens by source add up. Sampling: corpus nodes are point-mass proposals beside the draft's samples; the
first cycle's tokens follow the target's law (chi-square, as test_sampling.py). Then loading: a draft's corpus file
beside it, online growth, and the bench's `corpus_tree`.
"""

import pytest
import torch
from helpers.batching import left_padded, unpadded
from helpers.generation import FAMILIES, NEW, V, cached_cases, eagle, make_prompts, plain
from helpers.sampling import REPEATING, SETTINGS, TREES, check_law, models  # noqa: F401 (models: the sampling fixture)
from helpers.sampling import V as SV

from eagle3_hf import ContextLookup, Eagle3DraftModel, bind_target
from eagle3_hf.generation.context_index import build_trie
from eagle3_hf.generation.corpus_index import CORPUS_FILE, CorpusIndex
from eagle3_hf.generation.corpus_source import CorpusSource, GrowingCorpus, open_corpus
from eagle3_hf.generation.hybrid import (
    CORPUS,
    LOOKUP,
    Candidates,
    LookupStats,
    graft,
    merge_candidates,
    source_counts,
)
from eagle3_hf.generation.tree import HostTree

CORPUS_PROMPTS = 8  # answers in each family's corpus
CORPUS_TOKENS = 48


def corpus_of(target, seed=100, vocab=V, new=CORPUS_TOKENS, count=CORPUS_PROMPTS):
    """The target's own greedy answers to `count` random prompts (none of the test prompts), indexed."""
    generator = torch.Generator().manual_seed(seed)
    answers = []
    for _ in range(count):
        prompt = torch.randint(0, vocab, (1, 5), generator=generator)
        answers.append(plain(target, prompt, max_new_tokens=new)[0, 5:].tolist())
    return CorpusIndex.build(answers, vocab_size=vocab)


@pytest.fixture(scope="module")
def cases():
    """family -> (target, draft, prompts, plain outputs, corpus)."""
    get = cached_cases(make_prompts)
    corpora = {}

    def with_corpus(family):
        target, draft, prompts, references = get(family)
        if family not in corpora:
            corpora[family] = corpus_of(target)
        return target, draft, prompts, references, corpora[family]

    return with_corpus


def corpus_accepted(out):
    """Accepted tokens the corpus proposed, alone or with another source."""
    return out.accepted_from_corpus + out.accepted_from_both


def check_sources_add_up(out):
    """Per cycle, (draft, context, corpus, several) are the accepted tree tokens: what it added minus its bonus (the
    last cycle may add fewer, cut by the stopping criteria)."""
    assert all(len(counts) == 4 for counts in out.accept_sources)
    for counts, added in zip(out.accept_sources[:-1], out.accept_lengths[:-1]):
        assert sum(counts) == added - 1
    assert sum(out.accept_sources[-1]) <= out.accept_lengths[-1]
    totals = [out.accepted_from_draft, out.accepted_from_lookup, out.accepted_from_corpus, out.accepted_from_both]
    assert totals == [sum(c[i] for c in out.accept_sources) for i in range(4)]


ASSISTANTS = {
    "hybrid": dict(context_lookup=True, tree_top_k=2, tree_depth=4, adaptive_tree=False),
    "hybrid-adaptive": dict(context_lookup=True),
    "draft+corpus": dict(context_lookup=False, tree_top_k=2, tree_depth=4, adaptive_tree=False),
    "corpus_tree": dict(adaptive_tree=False),  # ContextLookup(corpus=...): no draft
}


@pytest.mark.grid
@pytest.mark.parametrize("assistant", list(ASSISTANTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_corpus_trees_greedy_match_plain_generate(cases, family, assistant):
    target, draft, prompts, references, corpus = cases(family)
    helper = ContextLookup(corpus=corpus).bind(target) if assistant == "corpus_tree" else draft
    extra = {} if assistant == "corpus_tree" else dict(corpus=corpus)
    accepted = 0
    for prompt, reference in zip(prompts, references):
        out = eagle(
            target, helper, prompt, max_new_tokens=NEW, return_dict_in_generate=True, **extra, **ASSISTANTS[assistant]
        )
        assert out.sequences.tolist() == reference.tolist(), f"{family}/{assistant}, prompt of {prompt.shape[1]}"
        check_sources_add_up(out)
        accepted += corpus_accepted(out)
        if assistant == "corpus_tree":
            assert out.accepted_from_draft == 0
        if assistant == "draft+corpus":
            assert out.accepted_from_lookup == 0  # no context lookup
    if assistant != "hybrid-adaptive":  # the cost model may rightly verify little on a random target
        assert accepted > 0, f"{family}/{assistant}: the corpus never proposed an accepted token"


@pytest.mark.grid
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("assistant", ["corpus_tree", "hybrid"])
def test_batched_corpus_trees_equal_each_rows_plain_greedy(cases, family, assistant):
    target, draft, prompts, _, corpus = cases(family)
    ids, mask = left_padded(prompts)
    helper = ContextLookup(corpus=corpus).bind(target) if assistant == "corpus_tree" else draft
    extra = {} if assistant == "corpus_tree" else dict(corpus=corpus, context_lookup=True)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=helper,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        adaptive_tree=False,
        **extra,
    )
    for row, prompt in enumerate(prompts):
        assert unpadded(out.sequences, mask, row) == plain(target, prompt, max_new_tokens=NEW)[0].tolist(), f"row {row}"
    assert len(out.accept_sources) == len(prompts)
    assert corpus_accepted(out) > 0


def test_corpus_off_and_refusals(cases):
    target, draft, prompts, references, _ = cases("llama")
    out = eagle(
        target, draft, prompts[1], max_new_tokens=NEW, return_dict_in_generate=True, corpus=False, adaptive_tree=False
    )
    assert out.sequences.tolist() == references[1].tolist() and out.accepted_from_corpus == 0
    wide = CorpusIndex.build([[1, 2, 3, 40]], vocab_size=V + 32)
    with pytest.raises(ValueError, match="vocabulary of 48 ids, larger than this target's 16"):
        eagle(target, draft, prompts[0], max_new_tokens=4, corpus=wide)
    with pytest.raises(ValueError, match="corpus must be a CorpusIndex"):
        eagle(target, draft, prompts[0], max_new_tokens=4, corpus=3)
    with pytest.raises(ValueError, match="No corpus index at"):
        eagle(target, draft, prompts[0], max_new_tokens=4, corpus="no/such/corpus.safetensors")


# ------------------------------------------------------------------------------------------------
# merging the sources (pure)


def test_merged_candidates_keep_each_sources_match_and_the_larger_estimate():
    context = build_trie([7, 1, 4, 5, 7], [(1, 3)], depth=3)  # r -> 1 -> 4 -> 5, on a 3-token match
    corpus = build_trie([7, 1, 6, 9, 7], [(1, 5)], depth=2)  # r -> 1 -> 6, on a 5-token match
    corpus.counts = [4, 4, 4]
    ctx = Candidates.of(context, LookupStats())
    cor = Candidates.of(corpus, LookupStats(prior=(0.9,) * 8), CORPUS)
    merged = merge_candidates(ctx, cor)
    assert merged.trie.tokens == [-1, 1, 4, 5, 6] and merged.trie.parents == [-1, 0, 1, 2, 1]
    assert merged.sources == [0, LOOKUP | CORPUS, LOOKUP, LOOKUP, CORPUS]
    assert merged.match == {LOOKUP: [0, 3, 4, 5, 0], CORPUS: [0, 5, 0, 0, 6]}
    assert merged.cond[1] == pytest.approx(0.9) and merged.cond[2] == ctx.cond[2]
    row = graft(HostTree([9], [-1], [0.0]), merged, total_tokens=3)
    assert row.tree.tokens.tolist() == [9, 1, 6] and row.sources == [0, LOOKUP | CORPUS, CORPUS]  # corpus's 0.81 wins
    assert row.match == {LOOKUP: [0, 3, 0], CORPUS: [0, 5, 6]}
    assert source_counts([0, 1, 2, 4, 3, 6], [0, 1, 2, 3, 4, 5], 5) == (1, 1, 1, 2)


def test_the_corpus_hit_rates_are_learnt_from_its_own_nodes(cases, monkeypatch):
    source = open_corpus(CorpusIndex.build([[1, 2, 3, 4]] * 2, vocab_size=V), V, depth=4)
    found = source.propose(torch.tensor([9, 1, 2]))
    row = graft(HostTree([2], [-1], [0.0]), found, total_tokens=8)
    tree, corpus_match = row.tree, row.match[CORPUS]
    assert tree.tokens.tolist() == [2, 3, 4] and row.match == {LOOKUP: [0, 0, 0], CORPUS: [0, 2, 3]}
    prior = source.stats.rate(2)
    for _ in range(20):  # the corpus's first token rejected every time: only it was a trial (its parent accepted)
        source.observe(tree.parents.tolist(), corpus_match, [0])
    assert source.stats.rate(2) < prior / 2 and sum(source.stats.trials) == 20
    # inside generate(), every cycle tells the corpus what became of its nodes
    seen = []
    monkeypatch.setattr(CorpusSource, "observe", lambda self, parents, corpus_match, path: seen.append(corpus_match))
    target, draft, prompts, _, corpus = cases("llama")
    eagle(target, draft, prompts[2], max_new_tokens=NEW, corpus=corpus, adaptive_tree=False)
    assert seen and any(any(m > 0 for m in corpus_match) for corpus_match in seen)


# ------------------------------------------------------------------------------------------------
# sampling with corpus point masses


@pytest.mark.slow  # point-mass proposals: the fast tier has the lookup's (test_sampling)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampling_with_corpus_proposals_follows_the_target_law(models, setting):  # noqa: F811
    target, draft = models
    torch.manual_seed(3000 + list(SETTINGS).index(setting))
    # the corpus: the target's own sampled answers to this prompt (its end kept, so that they match), which the
    # corpus continues with the most frequent of them -- its nodes are in every first cycle
    tail = REPEATING[0, -4:].tolist()
    mask = torch.ones_like(REPEATING)
    answers = [
        tail
        + target.generate(REPEATING, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=4)[
            0, REPEATING.shape[1] :
        ].tolist()
        for _ in range(200)
    ]
    corpus = CorpusIndex.build(answers, vocab_size=SV)
    mixed = dict(TREES["tree"], context_lookup=False, corpus=corpus, lookup_confidence=1.0)
    outputs = check_law(target, draft, REPEATING, SETTINGS[setting], mixed, f"corpus/{setting}")
    assert sum(out.accept_sources[0][2] > 0 for out in outputs) > 0.05 * len(outputs), "corpus never accepted"
    assert sum(out.accept_sources[0][0] > 0 for out in outputs) > 0.05 * len(outputs), "draft never accepted"


# ------------------------------------------------------------------------------------------------
# where a corpus comes from


def test_a_drafts_corpus_file_is_loaded_with_it(cases, tmp_path):
    target, draft, prompts, references, corpus = cases("qwen2")
    draft.save_pretrained(tmp_path)
    assert Eagle3DraftModel.from_pretrained(tmp_path, target=target).corpus is None
    corpus.save(tmp_path / CORPUS_FILE)
    loaded = bind_target(Eagle3DraftModel.from_pretrained(tmp_path, target=target), target)
    assert loaded.corpus == str(tmp_path / CORPUS_FILE)
    # no context lookup: a node of several sources is then the draft's and the corpus's
    options = dict(
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        tree_top_k=2,
        tree_depth=4,
        adaptive_tree=False,
        context_lookup=False,
    )
    used, off = 0, 0
    for prompt, reference in zip(prompts, references):
        out = eagle(target, loaded, prompt, **options)
        assert out.sequences.tolist() == reference.tolist()
        used += corpus_accepted(out)
        off += corpus_accepted(eagle(target, loaded, prompt, corpus=False, **options))
    assert used > 0 and off == 0


def test_online_growth_indexes_earlier_outputs():
    growth = GrowingCorpus(max_tokens=10, vocab_size=V, rebuild_every=4)
    growth.add([[1, 2, 3, 4, 5, 6]])
    assert growth.index is not None and growth.index.num_tokens == 6
    growth.add([[7, 8, 9], [10, 11, 12, 13]])  # the oldest answer leaves: at most 10 tokens kept
    assert [d.tolist() for d in growth.index.documents()] == [[7, 8, 9], [10, 11, 12, 13]]
    assert open_corpus(None, V, depth=4) is None
    source = open_corpus(None, V, depth=4, growth=64)
    source.finish([[3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6]])
    found = source.propose([7, 3, 1, 4])
    assert found.trie.tokens[1:3] == [1, 5] and set(found.sources[1:]) == {CORPUS}


def test_growth_inside_generate_stays_exact(cases):
    target, _, prompts, references, _ = cases("llama")
    lookup = ContextLookup().bind(target)
    for _ in range(2):  # the second round finds the first round's outputs in the online corpus
        outs = [
            target.generate(
                p,
                attention_mask=torch.ones_like(p),
                assistant_model=lookup,
                do_sample=False,
                max_new_tokens=NEW,
                return_dict_in_generate=True,
                adaptive_tree=False,
                corpus_growth=4096,
            )
            for p in prompts
        ]
        assert [o.sequences.tolist() for o in outs] == [r.tolist() for r in references]
    assert sum(corpus_accepted(o) for o in outs) > 0


# ------------------------------------------------------------------------------------------------
# bench


def test_bench_corpus_tree_and_sources_by_method(cases, tmp_path):
    from eagle3_hf.bench.runner import bench_configs, format_markdown, format_table, run_benchmark

    target, draft, prompts, _, corpus = cases("llama")
    corpus.save(tmp_path / "corpus.safetensors")
    methods = ("plain", "prompt_lookup", "eagle3_tree", "hybrid_tree", "lookup_tree", "corpus_tree")
    configs = bench_configs(torch.float32, methods, (torch.float32,))
    report = run_benchmark(
        {torch.float32: target},
        {torch.float32: draft},
        prompts[:2],
        configs,
        max_new_tokens=NEW,
        tree_kwargs={"adaptive_tree": False},
        corpus=str(tmp_path / "corpus.safetensors"),
    )
    trees = ["eagle3_tree_fp32", "hybrid_tree_fp32", "lookup_tree_fp32", "corpus_tree_fp32"]
    assert all(report[f"identical_{m}"] == 1.0 for m in ("hybrid_tree", "lookup_tree", "corpus_tree"))
    assert report["identical"] == 1.0
    sources = report["accepted_by_source"]
    assert set(sources) == set(trees)
    assert all(list(sources[n]) == ["draft", "context", "corpus", "several"] for n in trees)
    assert sources["eagle3_tree_fp32"]["context"] == sources["eagle3_tree_fp32"]["corpus"] == 0  # the draft alone
    assert sources["lookup_tree_fp32"]["corpus"] == 0 and sources["lookup_tree_fp32"]["draft"] == 0
    assert sources["corpus_tree_fp32"]["draft"] == 0 and sources["corpus_tree_fp32"]["corpus"] > 0
    assert sources["hybrid_tree_fp32"]["corpus"] + sources["hybrid_tree_fp32"]["several"] > 0
    # the field's tau: accepted draft tokens + 1 per cycle, over every cycle; each cycle adds at most that (its
    # accepted tokens and a bonus; the last one may be cut) after the prefill's one token per prompt
    for name in trees:
        cycles = round(report["tokens"][name] / report["time_per_cycle_ms"][name]["tokens_per_cycle"])
        tau = report["tau_field_by_method"][name]
        assert tau == pytest.approx((sum(sources[name].values()) + cycles) / cycles)
        assert 1 <= tau and (report["tokens"][name] - 2) / cycles <= tau + 1e-9
    assert "corpus_tree_vs_best_prompt_lookup" in report and "corpus tree" in format_table(report)
    table, markdown = format_table(report), format_markdown(report)
    assert "hybrid_tree_fp32: accepted tokens from the draft" in table and "the field's way" in table
    (row,) = [line for line in markdown.splitlines() if line.startswith("| `corpus_tree_fp32` |")]
    assert row.endswith(f" {report['tau_field_by_method']['corpus_tree_fp32']:.2f} |")  # the table's tau column
    with pytest.raises(ValueError, match="corpus_tree needs a corpus"):
        run_benchmark({torch.float32: target}, {}, prompts[:1], bench_configs(torch.float32, ("corpus_tree",)))
