"""Batched EAGLE-3 decoding: `target.generate(input_ids, attention_mask=mask, assistant_model=draft)` for a
left-padded batch of B > 1 prompts (decoding.py routes it here).

Each cycle every row still decoding drafts its own tree (one draft forward per level for all rows,
batched_draft.py), one target forward verifies all the trees over the shared cache (per-row 4D masks and positions,
batched_target.py), and each row accepts its own path and bonus token with the batch-1 acceptance functions. Rows
finish on their own stopping criteria; a finished row leaves the batch (it stops costing compute) and its output is
padded with `pad_token_id` afterwards, as plain generate() pads it -- which it does only when an EOS criterion is
present; without one plain generate() lets finished rows run on, and so does this loop, until the last row stops.

The steps are named functions over one explicit per-call state (`BatchRun`), as steps.py does for one row.
Limits (for now): no context lookup; no row-exact bf16 verification (`exact_verify` must not
be True); no `output_scores` / `output_logits` (plain generate() computes scores for finished rows that this loop
never computes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from eagle3_hf.generation.batched_cost import BatchCostModel
from eagle3_hf.generation.batched_draft import BatchDraftState, build_greedy_trees, flush_rows
from eagle3_hf.generation.batched_sampling import build_sampled_trees
from eagle3_hf.generation.batched_target import TargetColumns, keep_paths, pad_trees, processed_nodes, verify_mask
from eagle3_hf.generation.drafting import TreeBudget
from eagle3_hf.generation.steps import _prune
from eagle3_hf.generation.tree import DraftTree
from eagle3_hf.generation.verification import AcceptResult, greedy_accept, sample_accept
from eagle3_hf.modeling._compat import cache_kwargs
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, select_target_features

__all__ = ["BatchRun", "batched_decoding", "refuse_unsupported", "sequences"]

# Compact the caches when the columns compaction would drop number at least this many, and this fraction of the
# longest row's tokens (see `_worth_compacting`).
COMPACT_RATIO = 0.25
COMPACT_MIN_COLUMNS = 16


@dataclass
class BatchPlan:
    """What `draft_trees` decided this cycle: a tree per active row (root-only trees: a plain batched step)."""

    trees: list[DraftTree] | None = None
    predicted: float = 0.0  # accepted tokens the draft's probabilities predict, over the rows
    consulted: bool = False
    seconds: float = 0.0


@dataclass
class BatchRun:
    """Everything one batched decoding call reads and updates. "Rows" are the B prompts; "active" rows are those
    still decoding, in the order of the caches' rows."""

    model: PreTrainedModel
    draft: Eagle3DraftModel
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    budget: TreeBudget
    cache: DynamicCache
    layer_ids: list[int]
    out: torch.Tensor  # [B, capacity] every row's sequence so far (the padded prompt included)
    lengths: list[int]  # tokens of `out` per row
    pad_token_id: int | None
    pad_finished: bool  # plain generate() pads finished rows only when an EOS criterion is present
    max_length: int
    do_sample: bool = False
    temperature: float = 1.0
    adaptive_tree: bool = True
    streamer: Any = None
    cost: BatchCostModel = field(default_factory=BatchCostModel)
    stop_lengths: list[int | None] = field(default_factory=list)  # a row's length when a criterion fired
    active: list[int] = field(default_factory=list)
    columns: TargetColumns | None = None
    state: BatchDraftState = field(default_factory=BatchDraftState)
    streamed: int = 0  # columns of `out` handed to the streamer
    accept_lengths: list[list[int]] = field(default_factory=list)  # per row, per cycle: tokens it added
    tree_sizes: list[list[int]] = field(default_factory=list)  # per row, per cycle: nodes verified (root included)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.out.device

    @property
    def batch_size(self) -> int:
        return self.out.shape[0]


def refuse_unsupported(rows: int, draft: Eagle3DraftModel | None, context_lookup: bool, exact_verify: bool | str,
                       generation_config: GenerationConfig) -> None:  # fmt: skip
    """A clear ValueError for what the batched loop does not do (yet)."""
    if draft is None or context_lookup:
        raise ValueError(
            f"The context lookup (ContextLookup, context_lookup=True) decodes one prompt at a time; got a batch of "
            f"{rows}. Generate the prompts one at a time, or use an Eagle3DraftModel without context_lookup."
        )
    if exact_verify is True:
        raise ValueError(
            f"Row-exact verification (exact_verify=True) supports batch size 1; got a batch of {rows}. Batches verify "
            "in one tree-masked call (exact_verify='auto' or False): greedy bf16 output then equals plain "
            "decoding up to near-ties."
        )
    if generation_config.output_scores or generation_config.output_logits:
        raise ValueError(
            f"output_scores / output_logits with EAGLE-3 need batch size 1; got a batch of {rows} (plain generate() "
            "scores finished rows' padding steps, which batched tree decoding never runs)."
        )


def batched_decoding(
    model: PreTrainedModel,
    draft: Eagle3DraftModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    budget: TreeBudget,
    cache: DynamicCache,
    attention_mask: torch.Tensor | None,
    streamer: Any = None,
    adaptive_tree: bool = True,
) -> BatchRun:
    """Decode a left-padded batch; returns the finished `BatchRun` (`sequences(run)` gives the output ids)."""
    rows, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    attention_mask = attention_mask.to(input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}.")
    valid = attention_mask.bool()
    if not bool(valid[:, -1].all()) or bool((valid[:, 1:].long() - valid[:, :-1].long() < 0).any()):
        raise ValueError(
            "Batched EAGLE-3 decoding accepts left padding only (each row's mask: zeros, then ones, ending in a one); "
            "tokenise with padding_side='left'."
        )
    has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    pad = generation_config._pad_token_tensor
    if has_eos and pad is None:
        raise ValueError("With eos_token_id set, batched generation needs a pad_token_id to pad finished rows.")
    max_length = stopping_criteria.max_length or generation_config.max_length
    do_sample = bool(generation_config.do_sample)
    out = torch.zeros(rows, max(max_length, length + 1), dtype=input_ids.dtype, device=input_ids.device)
    out[:, :length] = input_ids
    layers = model.config.get_text_config().num_hidden_layers
    run = BatchRun(
        model=model, draft=draft, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        budget=budget, cache=cache, layer_ids=draft.config.resolved_target_layer_ids(layers), out=out,
        lengths=[length] * rows, pad_token_id=None if pad is None else int(pad), pad_finished=has_eos,
        max_length=max_length, do_sample=do_sample,
        temperature=float(generation_config.temperature or 1.0) if do_sample else 1.0, streamer=streamer,
        adaptive_tree=adaptive_tree, cost=BatchCostModel.for_batch(model.device.type, model.dtype),
        stop_lengths=[None] * rows, active=list(range(rows)), streamed=length,
        accept_lengths=[[] for _ in range(rows)], tree_sizes=[[] for _ in range(rows)],
    )  # fmt: skip
    prefill(run, input_ids, attention_mask)
    retire_rows(run)
    while run.active:
        start = run.cache.get_seq_length()
        plan = draft_trees(run)
        t0 = time.perf_counter()
        raw, features = verify(run, plan.trees)
        results = accept(run, plan.trees, raw)
        new_tokens = update_caches_and_features(run, plan.trees, results, features, start)
        verify_s = time.perf_counter() - t0
        run.verify_time += verify_s
        record_cycle(run, plan, results, verify_s)
        emit(run, new_tokens, plan.trees)
        retire_rows(run)
    stream(run, final=True)
    if run.streamer is not None:
        run.streamer.end()
    return run


# ------------------------------------------------------------------------------------------------
# the steps


def select_tokens(run: BatchRun, processed: torch.Tensor) -> torch.Tensor:
    """One token per row of `processed` `[A, V]`, as plain generate() picks it."""
    if run.do_sample:
        return torch.multinomial(torch.softmax(processed, dim=-1), 1)[:, 0]
    return processed.argmax(dim=-1)


def prefill(run: BatchRun, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """The target over the padded prompts (generate()'s own prefill: 2D mask, positions from it), the first token
    per row, and each row's prompt features queued for the draft (left padding marked invalid)."""
    t0 = time.perf_counter()
    positions = (attention_mask.long().cumsum(dim=-1) - 1).masked_fill(attention_mask == 0, 0)
    with torch.no_grad():
        out = run.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
            output_hidden_states=True, logits_to_keep=1, **cache_kwargs(run.cache),
        )  # fmt: skip
    raw = out.logits[:, -1].float()
    processed = run.logits_processor(input_ids, raw.clone())
    first = select_tokens(run, processed)  # [B]
    features = select_target_features(out.hidden_states, run.layer_ids)  # [B, N, 3Ht]
    # pair (feature at t, token at t + 1): real exactly where token t is
    run.state.add_verified(features, torch.cat([input_ids[:, 1:], first[:, None]], dim=1), attention_mask.bool())
    run.columns = TargetColumns.from_prompt(attention_mask)
    del out
    run.prefill_time = time.perf_counter() - t0
    emit(run, [[int(token)] for token in first.tolist()], None)


def draft_trees(run: BatchRun) -> BatchPlan:
    """Every active row's tree, drafted together (one draft forward per level) -- or root-only trees (a plain
    batched step) when the cost model says speculation does not pay this cycle."""
    cost, state, rows = run.cost, run.state, len(run.active)
    cost.rows = rows
    t0 = time.perf_counter()
    roots = torch.tensor([run.out[row, run.lengths[row] - 1] for row in run.active], device=run.device)
    plan = BatchPlan(consulted=not run.adaptive_tree or cost.consult_draft())
    if plan.consulted:
        flush_rows(run.draft, state)  # the verified pairs since the last consultation; not a draft step
        t_tree, calls_before = time.perf_counter(), state.forward_calls
        probs = torch.softmax(state.last_logits.float() / run.temperature, dim=-1)
        top = probs.topk(min(run.budget.top_k, probs.shape[-1]), dim=-1).values  # [A, k]
        if not run.adaptive_tree or cost.worth_drafting(top):
            if run.do_sample:
                grow = (lambda best, nodes: cost.worth_deeper(best * rows, nodes)) if run.adaptive_tree else None
                plan.trees = build_sampled_trees(run.draft, state, roots, replace(run.budget, grow=grow),
                                                 run.temperature)  # fmt: skip
            else:
                grow = cost.worth_deeper if run.adaptive_tree else None
                plan.trees = build_greedy_trees(run.draft, state, roots, replace(run.budget, grow=grow))
                _size_greedy(run, plan, t0)
        if state.forward_calls > calls_before:
            cost.draft_step.observe(rows, (time.perf_counter() - t_tree) / (state.forward_calls - calls_before))
    if plan.trees is not None and plan.predicted == 0.0:
        plan.predicted = sum(float(tree.scores[1:].exp().sum()) for tree in plan.trees)
    if plan.trees is None:
        root_only = dict(parents=torch.tensor([-1], device=run.device), scores=torch.zeros(1, device=run.device))
        plan.trees = [DraftTree.from_parents(tokens=roots[i : i + 1], **root_only) for i in range(rows)]
    plan.seconds = time.perf_counter() - t0
    run.draft_time += plan.seconds
    return plan


def _size_greedy(run: BatchRun, plan: BatchPlan, t0: float) -> None:
    """Let the cost model choose how many of each row's best nodes to verify (the same count for every row)."""
    if not run.adaptive_tree:
        return
    ordered = []
    for tree in plan.trees:
        scores = tree.scores[1:]
        ordered.append(scores[torch.argsort(-scores, stable=True)].exp())
    n, plan.predicted = run.cost.choose_size(torch.stack(ordered), time.perf_counter() - t0)
    plan.trees = None if n == 0 else [_prune(tree, n) for tree in plan.trees]


def record_cycle(run: BatchRun, plan: BatchPlan, results: list[AcceptResult], verify_s: float) -> None:
    """What the cost model learns from the cycle: the verify cost of its width, the draft's calibration, and
    whether consulting the draft gained tokens over plain batched steps in the same time."""
    cost, rows = run.cost, len(plan.trees)
    width = max(tree.num_nodes for tree in plan.trees)
    cost.rows = rows
    cost.verify.observe(rows * width, verify_s)
    accepted = sum(len(result.path) - 1 for result in results)
    if width > 1:
        cost.record_cycle(plan.predicted, accepted)
    if plan.consulted and run.adaptive_tree:
        spent = plan.seconds + (verify_s if width > 1 else 0.0)
        cost.after_consultation((accepted + rows if width > 1 else 0) - spent * cost.plain_rate())


def verify(run: BatchRun, trees: list[DraftTree]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over every row's (padded) tree. Returns raw logits `[A, T, V]` and features
    `[A, T, 3Ht]`."""
    padded = pad_trees(trees, run.columns.next_position)
    mask = verify_mask(run.columns, padded, run.model.dtype, run.model.config)
    with torch.no_grad():
        out = run.model(
            input_ids=padded.tokens, attention_mask=mask, position_ids=padded.positions, use_cache=True,
            output_hidden_states=True, **cache_kwargs(run.cache),
        )  # fmt: skip
    return out.logits.float(), select_target_features(out.hidden_states, run.layer_ids)


def accept(run: BatchRun, trees: list[DraftTree], raw: torch.Tensor) -> list[AcceptResult]:
    """Each row's longest valid path and bonus token, its logits processed along each node's own path."""
    results = []
    for i, (row, tree) in enumerate(zip(run.active, trees)):
        prefix = run.out[row : row + 1, : run.lengths[row]]
        scores = processed_nodes(run.logits_processor, prefix, tree, raw[i, : tree.num_nodes], row, run.batch_size)
        if run.do_sample:
            draft_probs = tree.draft_probs if tree.draft_probs is not None else torch.zeros_like(scores)
            results.append(sample_accept(tree.tokens, tree.parents, torch.softmax(scores, dim=-1), draft_probs))
        else:
            results.append(greedy_accept(tree.tokens, tree.parents, scores.argmax(dim=-1)))
    return results


def update_caches_and_features(
    run: BatchRun, trees: list[DraftTree], results: list[AcceptResult], features: torch.Tensor, start: int
) -> list[list[int]]:
    """Keep each row's accepted path in the target cache; queue its features for the draft. Returns each row's new
    tokens (accepted drafts + bonus)."""
    index, keep = keep_paths(run.cache, run.columns, start, [result.path for result in results])
    new_tokens = [tree.tokens[result.path[1:]].tolist() + [result.bonus_token] for tree, result in zip(trees, results)]
    tokens = torch.zeros(index.shape, dtype=torch.long, device=run.device)
    for i, row_tokens in enumerate(new_tokens):
        tokens[i, : len(row_tokens)] = torch.tensor(row_tokens, device=run.device)
    picked = features.gather(1, index[:, :, None].expand(-1, -1, features.shape[2]))  # [A, W, 3Ht]
    run.state.add_verified(picked, tokens, keep)
    return new_tokens


def emit(run: BatchRun, new_tokens: list[list[int]], trees: list[DraftTree] | None) -> None:
    """Append each active row's tokens one by one, checking its stopping criteria after each (as plain generate()
    checks every row after every token). A row whose criteria fire keeps no later token when finished rows are
    padded; otherwise it runs on (plain generate() keeps its real tokens) without further checks."""
    for i, (row, tokens) in enumerate(zip(run.active, new_tokens)):
        emitted = 0
        for token in tokens:
            if run.lengths[row] >= run.out.shape[1]:
                break  # a finished row running on past the longest possible output
            run.out[row, run.lengths[row]] = token
            run.lengths[row] += 1
            emitted += 1
            if run.stop_lengths[row] is None:
                ids = run.out[row : row + 1, : run.lengths[row]]
                if bool(run.stopping_criteria(ids, None).any()):
                    run.stop_lengths[row] = run.lengths[row]
                    if run.pad_finished:
                        break
        if trees is not None:
            run.accept_lengths[row].append(emitted)
            run.tree_sizes[row].append(trees[i].num_nodes)
    stream(run)


def retire_rows(run: BatchRun) -> None:
    """Drop the rows that need no more tokens from the batch (caches and draft state included); compact the caches
    when the columns no row needs pile up."""
    stopped = [length for length in run.stop_lengths if length is not None]
    limit = max(stopped) if len(stopped) == run.batch_size else run.max_length

    def needed(row: int) -> bool:
        if run.stop_lengths[row] is None and run.lengths[row] >= run.out.shape[1]:
            run.stop_lengths[row] = run.lengths[row]  # no length criterion: stop at generate()'s max_length
        if run.stop_lengths[row] is None:
            return True
        return not run.pad_finished and run.lengths[row] < limit

    keep = [i for i, row in enumerate(run.active) if needed(row)]
    if keep and len(keep) < len(run.active):
        index = torch.tensor(keep, device=run.device)
        run.columns.select_rows(run.cache, index)
        run.state.select_rows(index)
    run.active = [run.active[i] for i in keep]
    if not run.active:
        return
    if _worth_compacting(run.columns.valid):
        run.columns.compact(run.cache)
    if run.state.kv is not None and _worth_compacting(run.state.valid):
        run.state.compact()


def _worth_compacting(valid: torch.Tensor) -> bool:
    """Compaction can drop only the columns beyond the longest row (the rest are some row's tokens); it pays when
    there are many of them, next to what each forward attends to anyway."""
    longest = int(valid.sum(dim=1).max())
    removable = valid.shape[1] - longest
    return removable >= COMPACT_MIN_COLUMNS and removable > COMPACT_RATIO * longest


def stream(run: BatchRun, final: bool = False) -> None:
    """Hand the streamer every column all rows have reached, as plain generate() puts one token per row per step."""
    if run.streamer is None:
        return
    # a padded row can give any column, the others only those they have reached; none past the output's end
    reached = [run.lengths[row] for row, stop in enumerate(run.stop_lengths) if stop is None or not run.pad_finished]
    end = run.max_length if final or not reached else min(reached)
    if all(stop is not None for stop in run.stop_lengths):
        end = min(end, sequence_length(run))
    for column in range(run.streamed, end):
        run.streamer.put(_column(run, column).cpu())
    run.streamed = max(run.streamed, end)


# ------------------------------------------------------------------------------------------------
# the output


def sequence_length(run: BatchRun) -> int:
    """Plain generate() stops when every row has stopped: the longest row's stop length."""
    return max(length if length is not None else run.lengths[row] for row, length in enumerate(run.stop_lengths))


def _column(run: BatchRun, column: int) -> torch.Tensor:
    values = run.out[:, column].clone()
    if run.pad_finished:
        for row, stop in enumerate(run.stop_lengths):
            if stop is not None and column >= stop:
                values[row] = run.pad_token_id
    return values


def sequences(run: BatchRun) -> torch.Tensor:
    """`[B, L]` output ids: each row's tokens, finished rows padded with `pad_token_id` as plain generate() pads."""
    length = sequence_length(run)
    out = run.out[:, :length].clone()
    if run.pad_finished:
        for row, stop in enumerate(run.stop_lengths):
            out[row, stop:] = run.pad_token_id
    return out
