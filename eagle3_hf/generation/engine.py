"""The EAGLE-3 decoding loop, one for every batch size: a single prompt is a batch of one.

Each cycle: the proposer (proposers.py) builds a tree per active row; the cost model sizes greedy trees (one node
count for every row: the forward costs the widest row anyway); one target forward verifies every row's tree over the
shared cache (per-row 4D masks and positions, target_cache.py), each node's attention row-exact where that was
chosen for a single prompt (verify_choice.py, exact_attention.py); each row accepts its own path and bonus token
(verification.py), from scores cast and processed only where acceptance reads them (node_scores.py); the cache keeps
the accepted paths and the proposer hears what was accepted; each row emits its tokens, checking its stopping
criteria after each, and rows that need no more tokens leave the batch (emission.py).

Transfers: the loop keeps each row's tokens on the host (`Emission.tokens`) and moves data between host and device
only through transfers.py, a bounded number of times per cycle, whatever the rows, nodes and depth: reads of the
trees and greedy choices in one copy in `accept` and of the stopping flags in one in `emit`; uploads of the trees
built on the host in one copy in `propose` and of everything acceptance decided in one in `stage`. Its clocks are
CUDA events on CUDA, read after those reads (tests/test_sync_count.py counts it all), so that on an accelerator a
cycle waits for its kernels only a few times.

Per-call state lives in `DecodeRun` (cycle.py: the loop's own, what emission owns and the statistics) and in the
proposer, which sees a cycle only through a read-only `CycleView`; never on the modules. Invariant between cycles:
per row, the target cache holds every output token but the last (the tree's root). A batch of one never gets holes
in its cache, so its cache is the plain `DynamicCache` of its tokens (returned with the output).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_hf.generation.cycle import CycleRecord, DecodeRun, Proposal
from eagle3_hf.generation.emission import emit, emit_plan, retire_rows, stream
from eagle3_hf.generation.hybrid import DRAFT, RowTree, source_counts
from eagle3_hf.generation.node_scores import NodeScores, reads_are_free
from eagle3_hf.generation.proposers import root_only
from eagle3_hf.generation.target_cache import TargetColumns, keep_paths, pad_trees, verify_mask
from eagle3_hf.generation.transfers import read, upload
from eagle3_hf.generation.tree import DraftTree, children_lists, place_trees
from eagle3_hf.generation.verification import AcceptResult, greedy_accept, sample_accept
from eagle3_hf.modeling.modeling_eagle3 import select_target_features
from eagle3_hf.utils.compat import cache_kwargs

__all__ = ["decode"]


def decode(run: DecodeRun, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DecodeRun:
    """Prefill, then propose -> verify -> accept -> update -> emit -> record until every row has stopped."""
    prefill(run, input_ids, attention_mask)
    retire_rows(run)
    clock = run.clock
    while run.active:
        start = run.cache.get_seq_length()
        t0 = clock.mark()
        proposal, predicted = propose(run, t0)
        t1 = clock.mark()
        logits, features = verify(run, proposal.rows, start)
        results, scores = accept(run, proposal.rows, logits)
        new_tokens, staged = stage(run, proposal, results)
        update(run, proposal, results, features, start, staged)
        t2 = clock.mark()
        emitted = emit(run, new_tokens, scores, staged.out)
        # the clocks are read after emit's read, which the device has caught up with: timing adds no wait
        draft_s, verify_s = clock.seconds(t0, t1), clock.seconds(t1, t2)
        clock.settle()
        run.stats.draft_time += draft_s
        run.stats.verify_time += verify_s
        record_cycle(run, proposal, results, emitted, predicted, draft_s, verify_s)
        if run.observer is not None:
            run.observer(
                CycleRecord(
                    past=start,
                    rows=list(run.active),
                    tree_sizes=[r.tree.num_nodes for r in proposal.rows],
                    emitted=emitted,
                    parents=[r.tree.host.parents for r in proposal.rows],
                    draft_s=draft_s,
                    verify_s=verify_s,
                    consulted=proposal.consulted,
                )
            )
        retire_rows(run)
    stream(run, final=True)
    if run.emission.streamer is not None:
        run.emission.streamer.end()
    return run


def prefill(run: DecodeRun, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """The target over the prompts (left padding that every row has is dropped; the rest masked as generate() masks
    it), the first token per row, and each row's prompt handed to the proposer."""
    t0 = run.clock.mark()
    lead = min(run.emission.starts)
    ids, mask = input_ids[:, lead:], attention_mask[:, lead:]
    holes = min(run.emission.starts) != max(run.emission.starts)  # the host knows each row's padding (`starts`)
    positions = (mask.long().cumsum(dim=-1) - 1).masked_fill(mask == 0, 0) if holes else None
    logits, features = _target_forward(
        run, input_ids=ids, attention_mask=mask if holes else None, position_ids=positions, logits_to_keep=1
    )
    raw = logits[:, -1].float()  # [B, V]
    processed = run.logits_processor(input_ids, raw.clone())
    # one token per row, as plain generate() picks it
    first = torch.multinomial(torch.softmax(processed, dim=-1), 1)[:, 0] if run.do_sample else processed.argmax(dim=-1)
    # pair (feature at t, token at t + 1): real exactly where token t is
    run.proposer.prefill(run.view(), features, torch.cat([ids[:, 1:], first[:, None]], dim=1), mask.bool())
    run.columns = TargetColumns.from_prompt(mask)
    run.root_ids = first
    t1 = run.clock.mark()
    (tokens,) = read([first])
    emit(run, [[int(token)] for token in tokens], [(p[None], r[None]) for p, r in zip(processed, raw)])
    run.stats.prefill_time = run.clock.seconds(t0, t1)


def propose(run: DecodeRun, t0: Any) -> tuple[Proposal, float | None]:
    """The proposer's trees (root-only ones where it proposed none), greedy ones sized by the cost model, placed on
    the device (what was built on the host, in one upload). Returns (proposal, accepted tokens predicted over the
    rows -- None: from the trees' scores, once read)."""
    run.cost.rows = len(run.active)
    # a batch's plain step measured now and then (cost_model.py): the proposer is not asked (it hears the tokens)
    plain = run.adaptive_tree and not run.do_sample and run.cost.plain_due()
    proposal = Proposal() if plain else run.proposer.propose(run.view(), run.root_ids)
    predicted = None  # the trees' estimate, read with them in `accept`
    if proposal.rows is not None and run.adaptive_tree and not run.do_sample:
        drafted = run.clock.mark()
        trees = DraftTree.with_hosts([row.tree for row in proposal.rows])[0]  # one read: sizing and pruning use it
        ordered = []
        for row, tree in zip(proposal.rows, trees):
            row.tree = tree
            ordered.append(sorted((math.exp(score) for score in tree.host.scores[1:]), reverse=True))
        n, predicted = run.cost.choose_size(ordered, run.clock.seconds(t0, drafted))
        proposal.rows = None if n == 0 else [row.prune(n) for row in proposal.rows]
    if proposal.rows is None:
        roots = run.emission.roots()
        proposal.rows, predicted = [root_only(root, run.root_ids[i : i + 1]) for i, root in enumerate(roots)], 0.0
    for row, tree in zip(proposal.rows, place_trees([row.tree for row in proposal.rows], run.device)):
        row.tree = tree
    return proposal, predicted


def verify(run: DecodeRun, rows: list[RowTree], start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over every row's (padded) tree. Returns the logits `[A, T, V]` in the target's dtype and
    the tapped features `[A, T, 3Ht]` (None when the proposer reads none)."""
    trees = [row.tree for row in rows]
    if run.exact is not None:
        run.exact.set_tree(trees[0].parents, start)
    padded = pad_trees(trees, run.columns.next_position)
    mask = None
    # the host knows whether the cache has holes: a row holds every output token but the last, one per column
    holes = any(run.emission.lengths[r] - run.emission.starts[r] - 1 != run.columns.valid.shape[1] for r in run.active)
    if padded.tokens.shape[1] > 1 or holes:  # a plain step of rows without holes: none
        mask = verify_mask(run.columns, padded, run.model.dtype, run.model.config)
    try:
        return _target_forward(run, input_ids=padded.tokens, attention_mask=mask, position_ids=padded.positions)
    finally:
        if run.exact is not None:
            run.exact.clear_tree()


def _target_forward(run: DecodeRun, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's forward over its cache, handed the call's row-exact state (exact_attention.py). Returns its
    logits and the tapped features (None when the proposer reads none)."""
    exact = {} if run.exact is None else {"eagle3_exact": run.exact}
    with torch.no_grad():
        out = run.model(
            **inputs,
            use_cache=True,
            output_hidden_states=run.proposer.needs_hidden_states,
            **cache_kwargs(run.cache),
            **exact,
        )
    return out.logits, select_target_features(out.hidden_states, run.layer_ids) if out.hidden_states else None


def accept(
    run: DecodeRun, rows: list[RowTree], logits: torch.Tensor
) -> tuple[list[AcceptResult], list[tuple[torch.Tensor | None, torch.Tensor | None]]]:
    """Each row's longest valid path (greedy match, or lossless stochastic acceptance) and bonus token, and the
    path's scores the output keeps (`NodeScores.path_rows`), processed along each visited node's own path.

    Every row's tree is read on the host at once (`DraftTree.with_hosts`; trees built from lists need no read).
    Greedy where reads cost a synchronisation (node_scores.reads_are_free), the target's choice at every node of
    every row is computed on the device and read in that same copy, instead of one read per visited node."""
    scores = []
    for i, (r, row) in enumerate(zip(run.active, rows)):
        prefix = run.emission.out[r : r + 1, : run.emission.lengths[r]]
        scores.append(
            NodeScores(
                logits[i, : row.tree.num_nodes], row.tree, prefix, run.logits_processor, r, run.emission.batch_size
            )
        )
    eager = not run.do_sample and not reads_are_free(run.device)
    unprocessed = eager and len(run.logits_processor) == 0  # the choices need no tree: read them with it
    choices = [node_scores.all_choices() for node_scores in scores] if unprocessed else []
    trees, choices = DraftTree.with_hosts([row.tree for row in rows], choices)
    for tree, proposal, node_scores in zip(trees, rows, scores):
        proposal.tree = node_scores.tree = tree
    if eager and not unprocessed:  # processors read each node's path: the trees first, then one read of the choices
        choices = read([node_scores.all_choices() for node_scores in scores])
    results, kept = [], []
    for i, (tree, proposal, node_scores) in enumerate(zip(trees, rows, scores)):
        if eager:
            node_scores.choices = [int(c) for c in choices[i]]
        if run.do_sample:
            result = sample_accept(
                tree.tokens,
                tree.parents,
                node_scores.probs,
                tree.draft_probs,  # None for a tree without drafted children (a lookup's alone, or the root)
                point_mass=proposal.point_mass,
                draws=proposal.draws,
            )
        else:
            result = greedy_accept(tree.host.tokens, children_lists(tree.host.parents), node_scores.greedy_choice)
        results.append(result)
        kept.append(node_scores.path_rows(result.path, run.emission.output_scores, run.emission.output_logits))
    return results, kept


@dataclass
class CycleUpload:
    """What a cycle sends to the device after acceptance, in one upload (`stage`): per row its accepted path as the
    cache's gather index `[A, W]` and its length `[A]`, its new tokens `[A, W]`, where they go in the output
    (`out`: rows, columns, tokens, for `emit`), and each row's next root `[A]`."""

    index: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    roots: torch.Tensor


def stage(run: DecodeRun, proposal: Proposal, results: list[AcceptResult]) -> tuple[list[list[int]], CycleUpload]:
    """Each row's new tokens (accepted nodes + bonus), and everything the cycle's updates need on the device."""
    new_tokens = [
        [row.tree.host.tokens[node] for node in result.path[1:]] + [result.bonus_token]
        for row, result in zip(proposal.rows, results)
    ]
    paths = [result.path for result in results]
    width = max(len(path) for path in paths)
    rows, columns, values = emit_plan(run, new_tokens)
    index, lengths, tokens, *out, roots = upload(
        run.device,
        [path + [0] * (width - len(path)) for path in paths],
        [len(path) for path in paths],
        [row + [0] * (width - len(row)) for row in new_tokens],
        rows,
        columns,
        values,
        [row[-1] for row in new_tokens],
    )
    return new_tokens, CycleUpload(index, lengths, tokens, tuple(out), roots)


def update(
    run: DecodeRun,
    proposal: Proposal,
    results: list[AcceptResult],
    features: torch.Tensor | None,
    start: int,
    staged: CycleUpload,
) -> None:
    """Keep each row's accepted path in the target cache; tell the proposer."""
    paths = [result.path for result in results]
    index, keep = keep_paths(run.cache, run.columns, start, paths, staged.index, staged.lengths)
    picked = None
    if features is not None:
        picked = features.gather(1, index[:, :, None].expand(-1, -1, features.shape[2]))  # [A, W, 3Ht]
    run.proposer.observe(run.view(), proposal, results, picked, staged.tokens, keep)
    run.root_ids = staged.roots


def record_cycle(
    run: DecodeRun,
    proposal: Proposal,
    results: list[AcceptResult],
    emitted: list[int],
    predicted: float | None,
    draft_s: float,
    verify_s: float,
) -> None:
    """Bookkeeping: tree sizes, where the accepted tokens came from, and what the cost model learns -- the verify
    cost of the cycle's width, the proposals' calibration, and whether consulting the draft gained tokens over plain
    steps in the same time (only the tokens the draft proposed count: the lookup's came without consulting it), and
    for a batch whether the cycle's trees gained tokens over plain steps at all (plain steps for a while if not)."""
    cost, rows = run.cost, len(results)
    width = max(row.tree.num_nodes for row in proposal.rows)
    cost.observe(rows, width, verify_s)  # cost.rows: set by `propose` for this cycle's rows
    from_draft = 0
    for row, tree, result, count in zip(run.active, proposal.rows, results, emitted):
        sources = tree.node_sources()
        run.stats.tree_sizes[row].append(tree.tree.num_nodes)
        run.stats.accept_lengths[row].append(count)
        run.stats.accept_sources[row].append(source_counts(sources, result.path, count))
        from_draft += sum(1 for node in result.path[1:] if sources[node] & DRAFT)
    if width > 1:
        if predicted is None:
            predicted = sum(math.exp(score) for row in proposal.rows for score in row.tree.host.scores[1:])
        cost.record_cycle(predicted, sum(len(result.path) - 1 for result in results))
    if proposal.consulted and run.adaptive_tree:
        spent = draft_s + (verify_s if width > 1 else 0.0)
        cost.after_consultation((from_draft + rows if width > 1 else 0) - spent * cost.plain_rate())
    if rows > 1 and (proposal.consulted or width > 1) and run.adaptive_tree:
        cost.after_tree_cycle(sum(emitted) - (draft_s + verify_s) * cost.plain_rate())
