"""Batched EAGLE-3 in `target.generate(input_ids, attention_mask=mask, assistant_model=draft)` (fp32).

A left-padded batch of prompts of different lengths decodes, row by row, to each prompt's own plain greedy output,
for tiny random targets of every family (Mistral and Gemma3 decode past their 5-token sliding window); rows stop at
different steps (EOS, stop strings) and are padded as plain batched generate() pads them; the left padding's token
values and amount change nothing (it never reaches the target's attention or the draft).
"""

import pytest
import torch
from helpers.batching import left_padded, unpadded
from helpers.generation import (
    FAMILIES,
    NEW,
    TREES,
    V,
    eagle,
    first_new_token_at,
    letter_tokenizer,
    make_pair,
    plain,
    smollm2,  # noqa: F401 (the SmolLM2 fixture)
)
from helpers.sampling import (
    CHI2_CRITICAL_0001,
    REPEATING,
    N,
    chi_square,
    exact_law_of_tokens_2_and_3,
    models,  # noqa: F401 (the sampling fixture)
)
from helpers.sampling import TREES as SAMPLED_TREES
from helpers.sampling import V as SV
from transformers import TextStreamer

from eagle3_hf.generation import drafting, target_cache

LENGTHS = (3, 7, 12, 20)


@pytest.fixture(scope="module")
def cases():
    built = {}

    def get(family):
        if family not in built:
            target, draft = make_pair(family)
            generator = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, V, (1, n), generator=generator) for n in LENGTHS]
            built[family] = target, draft, prompts, [plain(target, p, max_new_tokens=NEW) for p in prompts]
        return built[family]

    return get


@pytest.mark.grid
@pytest.mark.parametrize("tree", ["wide", "deep", "chain", "adaptive"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_batched_greedy_equals_each_rows_plain_greedy(cases, family, tree):
    target, draft, prompts, references = cases(family)
    ids, mask = left_padded(prompts)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        **TREES[tree],
    )
    assert out.sequences.shape == (len(prompts), ids.shape[1] + NEW)
    for row, reference in enumerate(references):
        assert unpadded(out.sequences, mask, row) == reference[0].tolist(), f"row {row} ({LENGTHS[row]} tokens)"
    # per-row statistics: every row's cycles add up to its generated tokens (the prefill's token is not a cycle)
    assert len(out.accept_lengths) == len(prompts)
    assert all(sum(lengths) == NEW - 1 for lengths in out.accept_lengths)
    assert all(len(sizes) == len(lengths) for sizes, lengths in zip(out.tree_sizes, out.accept_lengths))
    if tree not in ("chain", "adaptive"):  # (the cost model may rightly decline a random draft's trees)
        assert any(length > 1 for lengths in out.accept_lengths for length in lengths)  # real trees were accepted


def test_batched_greedy_matches_batch_one_eagle(cases):
    """A batch drafts each row's tree as the row alone (a batch of one) does: the same accepted lengths per cycle."""
    target, draft, prompts, _ = cases("llama")
    ids, mask = left_padded(prompts)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        context_lookup=False,
        **TREES["wide"],
    )
    for row, prompt in enumerate(prompts):
        one = eagle(
            target,
            draft,
            prompt,
            max_new_tokens=NEW,
            return_dict_in_generate=True,
            exact_verify=False,
            context_lookup=False,
            **TREES["wide"],
        )
        assert one.accept_lengths == out.accept_lengths[row]


@pytest.mark.parametrize(
    "processor",
    [
        dict(repetition_penalty=1.5),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=10, eos_token_id=3, pad_token_id=V - 1),
    ],
)
def test_input_dependent_processors_see_each_rows_own_paths(cases, processor):
    target, draft, prompts, _ = cases("llama")
    ids, mask = left_padded(prompts)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, **processor)
    for tree in ("wide", "deep"):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=NEW,
            **processor,
            **TREES[tree],
        )
        assert out.tolist() == expected.tolist(), tree


def test_left_padding_never_reaches_the_models(cases):
    """Other padding ids and more padding columns change nothing."""
    target, draft, prompts, _ = cases("mistral")
    ids, mask = left_padded(prompts)
    expected = target.generate(
        ids, attention_mask=mask, assistant_model=draft, do_sample=False, max_new_tokens=NEW, **TREES["wide"]
    )
    for pad, extra in [(7, 0), (3, 5)]:
        other_ids, other_mask = left_padded(prompts, pad=pad, extra=extra)
        out = target.generate(
            other_ids,
            attention_mask=other_mask,
            assistant_model=draft,
            do_sample=False,
            max_new_tokens=NEW,
            **TREES["wide"],
        )
        assert out[:, other_ids.shape[1] :].tolist() == expected[:, ids.shape[1] :].tolist()


@pytest.mark.grid
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("tree", ["wide", "deep"])
def test_rows_stop_at_their_own_eos_and_are_padded(cases, family, tree):
    target, draft, prompts, references = cases(family)
    # an EOS that the first row emits early and the others later or never
    k, eos = first_new_token_at(references[0], prompts[0].shape[1], start=3)
    ids, mask = left_padded(prompts)
    options = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=V - 1, do_sample=False)
    expected = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(
        ids, attention_mask=mask, assistant_model=draft, return_dict_in_generate=True, **options, **TREES[tree]
    )
    assert out.sequences.tolist() == expected.tolist()
    lengths = {len(sizes) for sizes in out.tree_sizes}
    assert len(lengths) > 1 or expected.shape[1] < ids.shape[1] + NEW  # rows left the batch at different cycles
    for row, prompt in enumerate(prompts):  # and each row is its own plain output up to its EOS
        alone = plain(target, prompt, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=V - 1)
        mine = unpadded(out.sequences, mask, row)
        assert mine[: alone.shape[1]] == alone[0].tolist() and set(mine[alone.shape[1] :]) <= {V - 1}


@pytest.mark.grid
@pytest.mark.parametrize("tree", ["wide", "deep"])
def test_stop_strings_without_eos_let_finished_rows_run_on(cases, tree):
    """Without an EOS criterion plain generate() does not pad finished rows: they keep their real tokens until the
    last row stops."""
    target, draft, prompts, references = cases("llama")
    tokenizer = letter_tokenizer()
    n = prompts[1].shape[1]
    k, _ = first_new_token_at(references[1], n, start=5)
    stops = [tokenizer.decode(references[1][0, n + k - 1 : n + k + 1])]
    ids, mask = left_padded(prompts)
    options = dict(max_new_tokens=NEW, stop_strings=stops, tokenizer=tokenizer, do_sample=False)
    expected = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, **options, **TREES[tree])
    assert out.tolist() == expected.tolist()
    # with a pad token and an EOS that never occurs, finished rows are padded instead
    options.update(eos_token_id=V + 5, pad_token_id=V - 1)
    expected = target.generate(ids, attention_mask=mask, **options)
    assert (expected == V - 1).any()
    assert (
        target.generate(ids, attention_mask=mask, assistant_model=draft, **options, **TREES[tree]).tolist()
        == expected.tolist()
    )


def test_compacting_the_caches_changes_nothing(cases, monkeypatch):
    """With compaction as eager as it gets (whenever a column no row needs exists), rows leaving the batch included."""
    target, draft, prompts, references = cases("gemma3")
    monkeypatch.setattr(target_cache, "COMPACT_RATIO", 0.0)
    monkeypatch.setattr(target_cache, "COMPACT_MIN_COLUMNS", 1)
    compactions = []
    original = target_cache.TargetColumns.compact
    draft_original = drafting.DraftState.compact

    def counted(name, method):
        def compact(self, *args):
            # the columns to keep come from the host's bookkeeping: they must be the longest row's exactly
            assert args[-1] == int(self.valid.sum(dim=1).max()), name
            compactions.append(name)
            return method(self, *args)

        return compact

    monkeypatch.setattr(target_cache.TargetColumns, "compact", counted("target", original))
    monkeypatch.setattr(drafting.DraftState, "compact", counted("draft", draft_original))
    ids, mask = left_padded(prompts)
    k, eos = first_new_token_at(references[3], prompts[3].shape[1], start=3)  # the longest row stops early
    options = dict(max_new_tokens=NEW, eos_token_id=eos, pad_token_id=V - 1, do_sample=False)
    expected = target.generate(ids, attention_mask=mask, **options)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, **options, **TREES["deep"])
    assert {"target", "draft"} <= set(compactions)
    assert out.tolist() == expected.tolist()


class Collector:
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ends += 1


@pytest.mark.parametrize("padded", [True, False])
def test_a_streamer_sees_what_plain_batched_generate_streams(cases, padded):
    """Column by column, finished rows padded (EOS) or running on (stop strings without EOS)."""
    target, draft, prompts, references = cases("llama")
    ids, mask = left_padded(prompts)
    if padded:
        k, eos = first_new_token_at(references[0], prompts[0].shape[1], start=3)
        options = dict(eos_token_id=eos, pad_token_id=V - 1)
    else:
        tokenizer, n = letter_tokenizer(), prompts[1].shape[1]
        k, _ = first_new_token_at(references[1], n, start=5)
        options = dict(stop_strings=[tokenizer.decode(references[1][0, n + k - 1 : n + k + 1])], tokenizer=tokenizer)
    ours, theirs = Collector(), Collector()
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        streamer=ours,
        max_new_tokens=NEW,
        do_sample=False,
        **options,
        **TREES["wide"],
    )
    expected = target.generate(
        ids, attention_mask=mask, streamer=theirs, max_new_tokens=NEW, do_sample=False, **options
    )
    assert out.tolist() == expected.tolist()
    assert ours.puts == theirs.puts and ours.ends == theirs.ends == 1


def test_a_text_streamer_is_refused_as_plain_generate_refuses_it(cases, tokenizer):
    target, draft, prompts, _ = cases("llama")
    ids, mask = left_padded(prompts[:2])
    with pytest.raises(ValueError, match="batch size 1") as plain_error:
        target.generate(ids, attention_mask=mask, streamer=TextStreamer(tokenizer), max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1") as our_error:
        target.generate(
            ids, attention_mask=mask, assistant_model=draft, streamer=TextStreamer(tokenizer), max_new_tokens=4
        )
    assert str(our_error.value) == str(plain_error.value)


def test_refuses_row_exact_verification(cases):
    target, draft, prompts, _ = cases("llama")
    ids, mask = left_padded(prompts[:2])
    with pytest.raises(ValueError, match="batch"):
        target.generate(ids, attention_mask=mask, assistant_model=draft, max_new_tokens=4, exact_verify=True)


def staggered_eos(sequences, prompt_length):
    """A token that the rows of `sequences` first emit at the most different steps (one row early, one never)."""

    def firsts(token):
        new = sequences[:, prompt_length:].tolist()
        return [row.index(token) if token in row else None for row in new]

    return max(
        range(V - 1),
        key=lambda t: (
            None in firsts(t) and min(f for f in firsts(t) + [NEW] if f is not None) < NEW // 2,
            len(set(firsts(t))),
        ),
    )


@pytest.mark.grid
@pytest.mark.parametrize("tree", ["wide", "deep"])
def test_batched_output_scores_and_logits_equal_plain_batched_generate(cases, tree):
    """Per step a `[B, V]` tensor as plain batched generate() gives it, rows finishing at different steps: a running
    row's entries are its accepted nodes' scores; a finished row's, the scores plain generate() computes by feeding it
    `pad_token_id` (here one forward over its padded output)."""
    target, draft, prompts, _ = cases("llama")
    ids, mask = left_padded(prompts)
    options = dict(
        max_new_tokens=NEW,
        pad_token_id=V - 1,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        repetition_penalty=1.3,
    )
    eos = staggered_eos(target.generate(ids, attention_mask=mask, **options).sequences, ids.shape[1])
    expected = target.generate(ids, attention_mask=mask, eos_token_id=eos, **options)
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, eos_token_id=eos, **options, **TREES[tree])
    assert out.sequences.tolist() == expected.sequences.tolist()
    stops = [len(sizes) for sizes in out.tree_sizes]
    assert len(set(stops)) > 2 and min(stops) < NEW // 2  # rows left the batch at different cycles, one early
    assert any(length > 1 for lengths in out.accept_lengths for length in lengths)  # real trees were accepted
    for ours, theirs in [(out.scores, expected.scores), (out.logits, expected.logits)]:
        assert len(ours) == len(theirs) == expected.sequences.shape[1] - ids.shape[1]
        assert all(o.shape == (len(prompts), V) for o in ours)
        torch.testing.assert_close(torch.stack(ours), torch.stack(theirs), rtol=1e-4, atol=1e-4)


def test_refuses_right_padding(cases):
    target, draft, prompts, _ = cases("llama")
    ids, mask = left_padded(prompts[:2])
    with pytest.raises(ValueError, match="left padding"):
        target.generate(ids, attention_mask=mask.flip(1), assistant_model=draft, max_new_tokens=4)


# ------------------------------------------------------------------------------------------------
# every proposer for every batch: the context lookup alone and the hybrid tree


def repeating_prompts():
    """Prompts whose rows repeat themselves (other periods, other lengths): the lookup finds continuations."""
    generator = torch.Generator().manual_seed(5)
    prompts = []
    for period, length in ((3, 8), (5, 17), (4, 11), (6, 23)):
        unit = torch.randint(0, V, (period,), generator=generator)
        prompts.append(unit.repeat(length // period + 1)[:length][None])
    return prompts


@pytest.mark.grid
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
@pytest.mark.parametrize("assistant", ["lookup", "hybrid"])
def test_batched_lookup_and_hybrid_greedy_equal_each_rows_plain_greedy(cases, family, assistant):
    """`ContextLookup()` and the hybrid tree (the draft's tree with each row's lookup grafted in) over a batch whose
    rows repeat themselves: each row's output is its plain greedy output, and lookup tokens were accepted (every tree
    verified whole: a batch's cost model may take plain steps where its tiny models' trees lose by timing noise)."""
    from eagle3_hf import ContextLookup

    target, draft, _, _ = cases(family)
    prompts = repeating_prompts()
    ids, mask = left_padded(prompts)
    helper = ContextLookup().bind(target) if assistant == "lookup" else draft
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=helper,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        adaptive_tree=False,
        **({} if assistant == "lookup" else dict(context_lookup=True)),
    )
    for row, prompt in enumerate(prompts):
        assert unpadded(out.sequences, mask, row) == plain(target, prompt, max_new_tokens=NEW)[0].tolist(), f"row {row}"
    assert len(out.accept_sources) == len(prompts)  # per row, per cycle
    assert out.accepted_from_lookup + out.accepted_from_both > 0
    if assistant == "lookup":
        assert out.accepted_from_draft == 0


def test_batched_hybrid_rows_are_the_rows_alone(cases):
    """A row of a hybrid batch accepts what it accepts alone, where the draft is consulted every cycle (the lookup
    never confident: the skip decision is the batch's)."""
    target, draft, _, _ = cases("llama")
    prompts = repeating_prompts()
    ids, mask = left_padded(prompts)
    options = dict(
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        context_lookup=True,
        lookup_confidence=1.0,
        exact_verify=False,
        **TREES["wide"],
    )
    out = target.generate(ids, attention_mask=mask, assistant_model=draft, **options)
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=draft, **options)
        assert alone.accept_lengths == out.accept_lengths[row], f"row {row}"
        assert alone.accept_sources == out.accept_sources[row], f"row {row}"


# ------------------------------------------------------------------------------------------------
# sampling: each row follows its own target law


def chi_square_critical_0001(dof):
    """Upper 0.001 quantile of the chi-square law (Wilson-Hilferty; within 1% for dof >= 10)."""
    z = 3.090232  # the standard normal's upper 0.001 quantile
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_chi_square_critical_values():
    for dof, exact in CHI2_CRITICAL_0001.items():
        assert chi_square_critical_0001(dof) == pytest.approx(exact, rel=0.005)


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_batched_sampling_follows_each_rows_target_law(models, tree):
    """Tokens 2 and 3 (the first cycle) of each row of a left-padded batch of three prompts against that prompt's
    exact law, at T=0.7 with top_p=0.9 (chi-square per row, alpha 0.001; top-p's forbidden pairs never occur)."""
    target, draft = models
    prompts = [torch.tensor([[1, 5, 2, 7]]), torch.tensor([[3, 3, 6]]), torch.tensor([[0, 4, 1, 5, 2, 6]])]
    ids, mask = left_padded(prompts)
    laws = [exact_law_of_tokens_2_and_3(target, 0.7, 0.9, prompt=p) for p in prompts]
    counts = torch.zeros(len(prompts), SV, SV, dtype=torch.float64)
    torch.manual_seed(2000 + list(SAMPLED_TREES).index(tree))
    cycles = []
    for _ in range(N):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            do_sample=True,
            top_k=0,
            temperature=0.7,
            top_p=0.9,
            max_new_tokens=3,
            adaptive_tree=False,
            return_dict_in_generate=True,
            **SAMPLED_TREES[tree],
        )
        for row in range(len(prompts)):
            _, x2, x3 = out.sequences[row, ids.shape[1] :].tolist()
            counts[row, x2, x3] += 1
        cycles.append([len(lengths) for lengths in out.accept_lengths])
    for row, law in enumerate(laws):
        impossible = law == 0
        assert bool(impossible.any()) and float(counts[row][impossible].sum()) == 0
        stat, dof = chi_square(counts[row][~impossible], N * law[~impossible])
        assert stat < chi_square_critical_0001(dof), f"row {row}: chi2 {stat:.1f} at {dof} dof"
        one_cycle = sum(c[row] == 1 for c in cycles)  # a drafted token accepted in the first cycle, or not
        assert 0.05 * N < one_cycle < 0.95 * N


@pytest.mark.grid
@pytest.mark.parametrize("setting", ["T1", "T0.7-top_p0.9"])
def test_batched_sampling_with_lookup_proposals_follows_each_rows_target_law(models, setting):
    """The hybrid tree in a batch: each row's lookup continuations are point-mass proposals beside the draft's
    samples. Rows whose every next token occurred before (one row shifted, one without repeats) against each
    prompt's exact law (chi-square per row, alpha 0.001); the lookup's and the draft's proposals are both accepted."""
    target, draft = models
    options = dict(temperature=1.0, top_p=1.0) if setting == "T1" else dict(temperature=0.7, top_p=0.9)
    prompts = [REPEATING, REPEATING[:, 3:], torch.tensor([[1, 5, 2, 7]])]
    ids, mask = left_padded(prompts)
    laws = [exact_law_of_tokens_2_and_3(target, **options, prompt=p) for p in prompts]
    counts = torch.zeros(len(prompts), SV, SV, dtype=torch.float64)
    torch.manual_seed(3000 + ["T1", "T0.7-top_p0.9"].index(setting))
    lookup_accepted = draft_accepted = 0
    for _ in range(N):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            do_sample=True,
            top_k=0,
            max_new_tokens=3,
            adaptive_tree=False,
            return_dict_in_generate=True,
            context_lookup=True,
            lookup_confidence=1.0,
            **options,
            **SAMPLED_TREES["tree"],
        )
        for row in range(len(prompts)):
            _, x2, x3 = out.sequences[row, ids.shape[1] :].tolist()
            counts[row, x2, x3] += 1
        lookup_accepted += out.accept_sources[0][0][1] > 0
        draft_accepted += out.accept_sources[0][0][0] > 0
    for row, law in enumerate(laws):
        impossible = law == 0
        assert float(counts[row][impossible].sum()) == 0, f"row {row} sampled a continuation that top-p forbids"
        stat, dof = chi_square(counts[row][~impossible], N * law[~impossible])
        assert stat < chi_square_critical_0001(dof), f"row {row}: chi2 {stat:.1f} at {dof} dof"
    assert lookup_accepted > 0.05 * N and draft_accepted > 0.05 * N


# ------------------------------------------------------------------------------------------------
# the real target


@pytest.mark.slow
def test_smollm2_batch_greedy_matches_each_rows_plain_greedy(smollm2):
    """SmolLM2-135M-Instruct (fp32) with its shipped draft, three chat prompts of different lengths, one batch."""
    from eagle3_hf.draft_names import load_draft_for
    from eagle3_hf.modeling.shipped import SMOLLM2

    target, _, tokenizer = smollm2
    draft = load_draft_for(SMOLLM2, target)
    questions = [
        "Name three colours.",
        "Write a short poem about the sea and the wind, in four lines.",
        "What is 12 times 7? Explain the steps.",
    ]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for q in questions
    ]
    ids, mask = left_padded(prompts, pad=tokenizer.pad_token_id or 0)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=32,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
        adaptive_tree=False,
        tree_depth=4,
        tree_top_k=4,
        tree_total_tokens=12,
    )
    for row, prompt in enumerate(prompts):
        alone = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32)
        mine = unpadded(out.sequences, mask, row)
        assert mine[: alone.shape[1]] == alone[0].tolist(), f"row {row}"
        assert set(mine[alone.shape[1] :]) <= {tokenizer.pad_token_id}
    assert sum(length - 1 for lengths in out.accept_lengths for length in lengths) > 0


def test_where_trees_do_not_pay_the_batch_runs_plain_batched_steps(cases, monkeypatch):
    """A cost model that finds every verified token dear declines every tree: plain batched steps, same output."""
    from eagle3_hf.generation.cost_model import CycleCostModel, LinearCost

    def dear(device_type, dtype):
        return CycleCostModel(verify=LinearCost(prior_a=1.0, prior_b=100.0))

    monkeypatch.setattr(CycleCostModel, "for_device", staticmethod(dear))
    target, draft, prompts, references = cases("qwen2")
    ids, mask = left_padded(prompts)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
    )
    assert all(size == 1 for sizes in out.tree_sizes for size in sizes)
    for row, reference in enumerate(references):
        assert unpadded(out.sequences, mask, row) == reference[0].tolist()


def test_a_batch_starts_with_a_measured_plain_step(cases):
    """The batch's first cycle is a plain step (the cost model measures one before weighing trees against it, without
    asking the proposer), the next one asks the draft, and every row is still its plain greedy output."""
    target, draft, prompts, references = cases("qwen2")
    ids, mask = left_padded(prompts)
    records = []
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        do_sample=False,
        max_new_tokens=NEW,
        return_dict_in_generate=True,
        eagle3_observer=records.append,
        context_lookup=False,  # the draft alone: nothing but the cost model decides whether it is consulted
    )
    assert records[0].tree_sizes == [1] * len(prompts) and not records[0].consulted
    assert records[1].consulted
    for row, reference in enumerate(references):
        assert unpadded(out.sequences, mask, row) == reference[0].tolist()
