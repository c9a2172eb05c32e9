"""What a cycle verifies: each row's tree, from one source or several, behind one interface.

A proposer (the interface is cycle.py's `Proposer`) is shaped like transformers' candidate generators: where
`get_candidates` returns candidate tokens and `update_candidate_strategy` hears how many were accepted, `propose`
returns a tree per active row (`Proposal`) and `observe` hears each row's accepted path, with the target's features of
the accepted tokens. It is handed a read-only `CycleView` of the cycle, never the loop's run. The decoding loop
(engine.py) verifies whatever trees come back, sizes greedy ones with the cost model, and never asks where a node came
from except to report it. A proposer is per-call state: decoding builds a new one for every `generate()` call.

Three ship:
- `DraftProposer`: the EAGLE-3 draft's tree (greedy: EAGLE-2's dynamic tree; sampled: children drawn without
  replacement), its draft consulted when the cost model says a tree may pay;
- `LookupProposer`: the continuations of each row's current suffix from the context lookup, the corpus of the
  target's earlier answers (corpus_source.py), or both merged (model-free);
- `HybridProposer`: the draft and the lookup sources in one tree under one node budget, a lookup node equal to a
  draft node merged (hybrid.py); the draft's forward is skipped in a cycle where every row's lookup is confident of
  its next token.
`build_proposer` picks one for a call.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from eagle3_hf.generation.corpus_source import CorpusSource
from eagle3_hf.generation.cycle import CycleView, Proposal, Proposer
from eagle3_hf.generation.drafting import DraftState, build_greedy_trees, catch_up
from eagle3_hf.generation.hybrid import (
    CORPUS,
    LOOKUP,
    Candidates,
    LookupOptions,
    LookupState,
    RowTree,
    best_lookup_nodes,
    graft,
    graft_sampled,
    merge_candidates,
    observe_nodes,
)
from eagle3_hf.generation.node_scores import reads_are_free
from eagle3_hf.generation.sampled_trees import build_sampled_trees
from eagle3_hf.generation.target_cache import worth_compacting
from eagle3_hf.generation.transfers import read
from eagle3_hf.generation.tree import DraftTree, HostTree
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel

__all__ = ["DraftProposer", "HybridProposer", "LookupProposer", "build_proposer", "root_only"]


def root_only(token: int, root: torch.Tensor) -> RowTree:
    """A tree of the root alone (`token`, already on the device as `root`, a 1-element tensor): a plain step of the
    row, built without a transfer."""
    host = HostTree([token], [-1], [0.0])
    return RowTree(
        DraftTree(
            root.long(),
            torch.full_like(root, -1, dtype=torch.long),
            torch.zeros_like(root, dtype=torch.float32),
            host=host,
        )
    )


class DraftProposer(Proposer):
    """The EAGLE-3 draft's trees, one draft forward per level for every row."""

    needs_hidden_states = True

    def __init__(self, draft: Eagle3DraftModel) -> None:
        self.draft = draft
        self.state = DraftState()

    def prefill(self, view, features, next_tokens, valid) -> None:
        self.state.add_verified(features, next_tokens, valid)

    def consult(self, view: CycleView) -> tuple[bool, bool]:
        """(consulted, worth): whether the cost model's back-off let the draft be consulted this cycle, and whether
        verifying some of each row's best next tokens then beats a plain step (a tree is worth building)."""
        if view.adaptive_tree and not view.cost.consult_draft():
            return False, False
        catch_up(self.draft, self.state)  # the verified pairs since the last consultation; not a draft step
        longest = view.longest_cached()  # after catching up, each row's draft pairs are its tokens in the target cache
        if worth_compacting(self.state.kv.length, longest):  # rows accept paths of different lengths: holes pile up
            self.state.compact(longest)
        if not view.adaptive_tree:
            return True, True
        probs = torch.softmax(self.state.last_logits.float() / view.temperature, dim=-1)
        best = probs.topk(min(view.budget.top_k, probs.shape[-1]), dim=-1).values  # [A, k]
        (values,) = read([best])  # the one read of the decision to draft
        return True, view.cost.worth_drafting(
            [values[i : i + best.shape[1]] for i in range(0, len(values), best.shape[1])]
        )

    def trees(self, view: CycleView, roots: torch.Tensor, totals: list[int] | None = None) -> list[DraftTree]:
        """Every row's tree (sampled trees of at most `totals[row]` nodes); times the draft's forwards."""
        cost, state, rows, clock = view.cost, self.state, roots.numel(), view.clock
        start, calls = clock.mark(), state.forward_calls
        if view.do_sample:
            grow = (lambda best, nodes: cost.worth_deeper(best * rows, nodes)) if view.adaptive_tree else None
            trees = build_sampled_trees(
                self.draft, state, roots, replace(view.budget, grow=grow), view.temperature, totals
            )
        else:
            # deciding each level reads its best node: where a read costs a synchronisation the tree is drafted to its
            # full depth, and the cost model sizes it from the one read of the whole tree (engine.propose)
            per_level = view.adaptive_tree and reads_are_free(roots.device)
            trees = build_greedy_trees(
                self.draft, state, roots, replace(view.budget, grow=cost.worth_deeper if per_level else None)
            )
        forwards = state.forward_calls - calls
        if forwards:
            clock.later(start, clock.mark(), lambda seconds: cost.draft_step.observe(rows, seconds / forwards))
        return trees

    def propose(self, view, roots) -> Proposal:
        consulted, worth = self.consult(view)
        if not worth:
            return Proposal(consulted=consulted)
        return Proposal([RowTree(tree) for tree in self.trees(view, roots)], consulted=True)

    def observe(self, view, proposal, results, features, tokens, keep) -> None:
        self.state.add_verified(features, tokens, keep)

    def select_rows(self, rows, index) -> None:
        self.state.select_rows(index)


class LookupProposer(Proposer):
    """The lookup sources' continuations of each row's suffix: the context lookup's (context_index.py; unless
    `context` is False) and the corpus's (`corpus`), merged, with estimates from hit rates measured during the call
    (hybrid.py)."""

    def __init__(self, options: LookupOptions, corpus: CorpusSource | None = None, context: bool = True) -> None:
        if not context and corpus is None:
            raise ValueError("A lookup proposer needs a source: the context lookup, a corpus, or both.")
        self.options, self.corpus, self.context = options, corpus, context
        self.lookups: list[LookupState] = []  # per active row (the context's index and hit rates)

    def prefill(self, view, features, next_tokens, valid) -> None:
        self.lookups = [LookupState(options=self.options) for _ in range(view.rows)] if self.context else []

    def tries(self, view: CycleView) -> list[Candidates]:
        """Each active row's candidates for this cycle (the context's first), its index synced with its output."""
        out = []
        for i in range(view.rows):
            sequence = view.sequence(i)  # the host's copy of the row's output
            cands = self.lookups[i].propose(sequence) if self.context else None
            if self.corpus is not None:
                found = self.corpus.propose(sequence)
                cands = found if cands is None else merge_candidates(cands, found)
            out.append(cands)
        return out

    def rows(self, view: CycleView, tries: list[Candidates]) -> list[RowTree] | None:
        """Lookup-only trees (None when no row has a continuation)."""
        trees, total = [], view.budget.total_tokens
        for i, (root, cands) in enumerate(zip(view.roots(), tries)):  # without a continuation: the root alone
            if view.do_sample:
                chosen = best_lookup_nodes(cands.trie, cands.cond, total - 1)
                base = root_only(root, view.root_ids[i : i + 1]).tree
                trees.append(graft_sampled(base, cands, chosen) if chosen else RowTree(base))
            else:
                trees.append(graft(HostTree([root], [-1], [0.0]), cands, total))
        return trees if any(row.tree.num_nodes > 1 for row in trees) else None

    def propose(self, view, roots) -> Proposal:
        return Proposal(self.rows(view, self.tries(view)))

    def observe(self, view, proposal, results, features, tokens, keep) -> None:
        if proposal.rows is None:
            return
        for i, (row, result) in enumerate(zip(proposal.rows, results)):
            if self.context and row.match is not None:
                observe_nodes(self.lookups[i].stats, row.tree.host.parents, row.match[LOOKUP], result.path)
            if self.corpus is not None and row.match is not None:
                self.corpus.observe(row.tree.host.parents, row.match[CORPUS], result.path)

    def select_rows(self, rows, index) -> None:
        self.lookups = [self.lookups[i] for i in rows] if self.context else []

    def finish(self, outputs) -> None:
        if self.corpus is not None:  # each row's new tokens, from the host's copy
            self.corpus.finish(outputs)


class HybridProposer(LookupProposer):
    """The draft's trees with the lookup sources' continuations grafted in (see the module docstring)."""

    needs_hidden_states = True

    def __init__(
        self, draft: Eagle3DraftModel, options: LookupOptions, corpus: CorpusSource | None = None, context: bool = True
    ) -> None:
        super().__init__(options, corpus, context)
        self.draft = DraftProposer(draft)

    def prefill(self, view, features, next_tokens, valid) -> None:
        self.draft.prefill(view, features, next_tokens, valid)
        super().prefill(view, features, next_tokens, valid)

    def propose(self, view, roots) -> Proposal:
        tries = self.tries(view)
        # a lookup this sure of every row's next token leaves the draft little to add: skip its forward this cycle
        confident = all(
            any(c.cond[i] >= self.options.confidence for i in range(1, c.trie.num_nodes) if c.trie.parents[i] == 0)
            for c in tries
        )
        consulted, worth = (False, False) if confident else self.draft.consult(view)
        if not worth:
            return Proposal(self.rows(view, tries), consulted=consulted)
        total = view.budget.total_tokens
        if view.do_sample:  # the lookup's nodes are chosen from the context alone, before any draw
            room = total - 1 - view.budget.top_k  # leave the draft its first level
            chosen = [best_lookup_nodes(c.trie, c.cond, room) for c in tries]
            trees = self.draft.trees(view, roots, totals=[total - len(c) for c in chosen])
            rows = [
                graft_sampled(tree, cands, c) if c else RowTree(tree) for tree, cands, c in zip(trees, tries, chosen)
            ]
        else:
            drafted = DraftTree.with_hosts(self.draft.trees(view, roots))[0]  # grafting reads them: all rows at once
            rows = [
                graft(tree.host, cands, total) if cands.trie.num_nodes > 1 else RowTree(tree)
                for tree, cands in zip(drafted, tries)
            ]
        return Proposal(rows, consulted=True)

    def observe(self, view, proposal, results, features, tokens, keep) -> None:
        self.draft.observe(view, proposal, results, features, tokens, keep)
        super().observe(view, proposal, results, features, tokens, keep)

    def select_rows(self, rows, index) -> None:
        self.draft.select_rows(rows, index)
        super().select_rows(rows, index)


def build_proposer(
    draft: Eagle3DraftModel | None, options: LookupOptions, context: bool, corpus: CorpusSource | None
) -> Proposer:
    """A call's proposer: the draft's tree alone, the lookup sources' alone (no draft), or all in one tree
    (`context`: whether the context lookup is one of them; `corpus`: the corpus source, if any)."""
    if draft is None:
        return LookupProposer(options, corpus, context)
    if not context and corpus is None:
        return DraftProposer(draft)
    return HybridProposer(draft, options, corpus, context)
