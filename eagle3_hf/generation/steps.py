"""The steps of one EAGLE-3 decoding call, each a function over one explicit per-call state (`DecodeRun`).

`eagle3_decoding` (decoding.py) only sequences them: `prefill`, then per cycle `draft_tree` -> `verify` -> `accept`
-> `update_caches_and_features` -> `record_cycle` -> `emit` (which checks the stopping criteria). Per-call state
lives in `DecodeRun`, the draft-side `DraftState` and the context lookup's `LookupState`, never on the modules.

With a context lookup (hybrid.py) each cycle's tree also holds the lookup's continuations; without a draft
(`run.draft is None`) it holds only those, and the target's hidden states are never asked for.

Invariants between cycles: the target cache holds every output token but the last (the tree's root), and the
draft state holds the tapped target features of every verified token, pending until the draft is next consulted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from eagle3_hf.generation.cost_model import CycleCostModel
from eagle3_hf.generation.exact_attention import ExactAttention
from eagle3_hf.generation.node_scores import NodeScores
from eagle3_hf.generation.timing import NO_TIMER, NullTimer
from eagle3_hf.generation.drafting import (
    DraftState,
    TreeBudget,
    build_greedy_tree,
    build_sampled_tree,
    flush_pending,
    keep_cache_entries,
)
from eagle3_hf.generation.hybrid import (
    DRAFT,
    LookupState,
    best_lookup_nodes,
    graft,
    graft_sampled,
    lookup_only_tree,
    prune_nodes,
    source_counts,
)
from eagle3_hf.generation.tree import DraftTree, rerank, tree_attention_mask, verification_mask
from eagle3_hf.generation.verification import AcceptResult, greedy_accept, sample_accept
from eagle3_hf.modeling._compat import cache_kwargs
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, select_target_features


# ------------------------------------------------------------------------------------------------
# per-call state


@dataclass
class DecodeRun:
    """Everything one `eagle3_decoding` call reads and updates (batch size 1)."""

    model: PreTrainedModel
    draft: Eagle3DraftModel | None  # None: the context lookup alone proposes (model-free)
    input_ids: torch.Tensor  # the whole output so far (prompt included)
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    budget: TreeBudget
    cache: DynamicCache  # the target's
    layer_ids: list[int]
    start: int = 0  # left padding to skip (the target and draft never see it)
    do_sample: bool = False
    temperature: float = 1.0
    adaptive_tree: bool = True
    streamer: Any = None
    output_scores: bool = False
    output_logits: bool = False
    cost: CycleCostModel = field(default_factory=CycleCostModel)
    exact: ExactAttention | None = None  # row-exact verification (exact_attention.py); None: one tree-masked call
    state: DraftState = field(default_factory=DraftState)
    lookup: LookupState | None = None  # the context lookup's index and hit rates; None: no lookup
    timer: NullTimer = NO_TIMER  # named sections per cycle (timing.py); NO_TIMER: not profiled
    scores: tuple[torch.Tensor, ...] = ()
    raw_logits: tuple[torch.Tensor, ...] = ()
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    accept_sources: list[tuple[int, int, int]] = field(default_factory=list)  # per cycle: (draft, lookup, both)
    draft_time: float = 0.0
    verify_time: float = 0.0
    prefill_time: float = 0.0
    finished: bool = False

    @property
    def device(self) -> torch.device:
        return self.input_ids.device


@dataclass
class DraftPlan:
    """What `draft_tree` decided this cycle: the tree (None: a plain step), its predicted acceptance, its cost."""

    tree: DraftTree | None = None
    predicted: float = 0.0
    consulted: bool = False
    seconds: float = 0.0
    sources: list[int] | None = None  # per node: DRAFT, LOOKUP or BOTH (hybrid.py); None: all from the draft
    match: list[int] | None = None  # per node: effective lookup match length, 0 for draft-only nodes
    point_mass: torch.Tensor | None = None  # sampled trees: nodes that are lookup proposals
    draws: dict[int, list[int]] | None = None  # sampled trees: draw sequences where duplicates were removed


# ------------------------------------------------------------------------------------------------
# the steps


def select_token(run: DecodeRun, processed: torch.Tensor) -> int:
    if run.do_sample:
        return int(torch.multinomial(torch.softmax(processed, dim=-1), 1))
    return int(processed.argmax())


def emit(run: DecodeRun, tokens: list[int], rows: torch.Tensor | None, raw: torch.Tensor | None) -> int:
    """Append tokens one by one, checking the stopping criteria after each (stop).

    Returns how many were appended: all of them, unless a criterion fired first (which also sets `run.finished`).
    """
    for i, tok in enumerate(tokens):
        new = torch.tensor([[tok]], device=run.device, dtype=run.input_ids.dtype)
        run.input_ids = torch.cat([run.input_ids, new], dim=1)
        if run.output_scores:
            run.scores += (rows[i : i + 1],)
        if run.output_logits:
            run.raw_logits += (raw[i : i + 1],)
        if run.streamer is not None:
            run.streamer.put(new[0].cpu())
        if bool(run.stopping_criteria(run.input_ids, run.scores if run.output_scores else None).any()):
            run.finished = True
            return i + 1
    return len(tokens)


def prefill(run: DecodeRun) -> None:
    """Run the target over the prompt, pick the first token, and queue the prompt's features for the draft."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = run.model(
            input_ids=run.input_ids[:, run.start :], use_cache=True, output_hidden_states=run.draft is not None,
            logits_to_keep=1, **cache_kwargs(run.cache), **_exact_kwargs(run),
        )  # fmt: skip
    raw = out.logits[:, -1].float()
    processed = run.logits_processor(run.input_ids, raw.clone())
    first_token = select_token(run, processed[0])
    if run.draft is not None:
        features = select_target_features(out.hidden_states, run.layer_ids)  # [1, N, 3Ht]
        first = torch.tensor([[first_token]], device=run.device)
        run.state.add_verified(features, torch.cat([run.input_ids[:, run.start + 1 :], first], dim=1))
    del out
    _sync(run.device)
    run.prefill_time = time.perf_counter() - t0
    emit(run, [first_token], processed, raw)


def draft_tree(run: DecodeRun, root: int) -> DraftPlan:
    """Draft a tree from `root` -- or not, when the cost model says a plain step is faster this cycle -- and graft
    the context lookup's continuations into it (or verify those alone, when the draft is skipped or declines)."""
    cost, state, budget = run.cost, run.state, run.budget
    t0 = time.perf_counter()
    trie = cond = None
    confident = False
    if run.lookup is not None:
        run.lookup.sync(run.input_ids[0, run.start :])
        trie, cond = run.lookup.propose()
        first = [cond[i] for i in range(1, trie.num_nodes) if trie.parents[i] == 0]
        # a lookup this sure of its next token leaves the draft little to add: skip its forward this cycle
        confident = bool(first) and max(first) >= run.lookup.options.confidence
    use_draft = run.draft is not None and not confident
    plan = DraftPlan(consulted=use_draft and (not run.adaptive_tree or cost.consult_draft()))
    if plan.consulted:
        mark = run.timer.now()
        flush_pending(run.draft, state)  # verified pairs since the last consultation; not a draft step
        run.timer.add("draft: catch-up forward", mark)
        t_tree = time.perf_counter()
        calls_before = state.forward_calls
        # the draft's best next tokens: the depth-1 candidates a tree would start from
        probs = torch.softmax(state.last_logits.float() / run.temperature, dim=-1)
        top = probs.topk(min(budget.top_k, probs.numel())).values
        run.timer.add("draft: worth drafting", t_tree)
        if not run.adaptive_tree or cost.worth_drafting(top):
            budget.grow = cost.worth_deeper if run.adaptive_tree else None
            if run.do_sample:
                _sampled_tree(run, plan, root, trie, cond, with_draft=True)
            else:
                plan.tree = build_greedy_tree(run.draft, state, root, budget, timer=run.timer)
                if trie is not None and trie.num_nodes > 1:
                    plan.tree, plan.sources, plan.match = graft(plan.tree, trie, cond, budget.total_tokens)
                _size_greedy(run, plan, t0)
        if state.forward_calls > calls_before:
            cost.draft_step.observe(1, (time.perf_counter() - t_tree) / (state.forward_calls - calls_before))
    if plan.tree is None and trie is not None and trie.num_nodes > 1:
        if run.do_sample:
            _sampled_tree(run, plan, root, trie, cond, with_draft=False)
        else:
            plan.tree, plan.sources, plan.match = lookup_only_tree(root, trie, cond, run.device, budget.total_tokens)
            _size_greedy(run, plan, t0)
    if plan.tree is not None and plan.predicted == 0.0:
        plan.predicted = float(plan.tree.scores[1:].exp().sum())
    _sync(run.device)
    plan.seconds = time.perf_counter() - t0
    run.draft_time += plan.seconds
    if plan.tree is None:
        plan.tree = DraftTree.from_parents(
            tokens=torch.tensor([root], device=run.device),
            parents=torch.tensor([-1], device=run.device),
            scores=torch.zeros(1, device=run.device),
        )
        plan.sources = plan.match = plan.point_mass = plan.draws = None
    return plan


def _size_greedy(run: DecodeRun, plan: DraftPlan, t0: float) -> None:
    """Let the cost model choose how many of the tree's best nodes to verify (adaptive trees only)."""
    if not run.adaptive_tree:
        return
    order = torch.argsort(-plan.tree.scores[1:], stable=True)
    n, plan.predicted = run.cost.choose_size(plan.tree.scores[1:][order].exp(), time.perf_counter() - t0)
    if n == 0:
        plan.tree = None
    elif plan.sources is not None:
        plan.tree, plan.sources, plan.match = prune_nodes(plan.tree, plan.sources, plan.match, n)
    else:
        plan.tree = _prune(plan.tree, n)


def _sampled_tree(run: DecodeRun, plan: DraftPlan, root: int, trie: Any, cond: list[float] | None,
                  with_draft: bool) -> None:  # fmt: skip
    """A sampled tree: the lookup's best nodes as point-mass proposals (chosen from the context alone, before any
    draw), and with `with_draft` the draft's sampled tree in the rest of the budget."""
    budget = run.budget
    room = budget.total_tokens - 1 - (budget.top_k if with_draft else 0)  # leave the draft its first level
    chosen = best_lookup_nodes(trie, cond, room) if trie is not None else []
    if with_draft:
        tree = build_sampled_tree(run.draft, run.state, root, replace(budget, total_tokens=budget.total_tokens -
                                  len(chosen)), run.temperature)  # fmt: skip
    elif chosen:
        tree = DraftTree.from_parents(tokens=torch.tensor([root], device=run.device),
                                      parents=torch.tensor([-1], device=run.device),
                                      scores=torch.zeros(1, device=run.device))  # fmt: skip
    else:
        return
    if not chosen:
        plan.tree = tree
        return
    grafted = graft_sampled(tree, trie, cond, chosen)
    plan.tree, plan.sources, plan.match = grafted.tree, grafted.sources, grafted.match
    plan.point_mass, plan.draws = grafted.point_mass, grafted.draws


def verify(run: DecodeRun, tree: DraftTree, past: int) -> tuple[NodeScores, torch.Tensor | None]:
    """One target forward over every tree node (tree mask, depth positions).

    Returns the nodes' scores (fp32 and processed, each node under its own path, where first read: node_scores.py)
    and the tapped features `[1, T, 3Ht]` (None without a draft).
    """
    model, timer = run.model, run.timer
    mark = timer.now()
    if run.exact is not None:
        run.exact.set_tree(tree.parents, past)
    timer.add("exact: plan tree", mark)
    try:
        with torch.no_grad():
            mark = timer.now()
            mask = None
            if tree.tokens.numel() > 1:
                mask = _target_mask(model.config, tree_attention_mask(tree.parents), past, model.dtype)
            positions = (past + tree.depths)[None]
            timer.add("mask and positions", mark)
            mark = timer.now()
            out = model(
                input_ids=tree.tokens[None],
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                output_hidden_states=run.draft is not None,
                **cache_kwargs(run.cache),
                **_exact_kwargs(run),
            )
            timer.add("target forward", mark)
    finally:
        if run.exact is not None:
            run.exact.clear_tree()
    scores = NodeScores(out.logits[0], tree, run.input_ids, run.logits_processor)
    mark = timer.now()
    features = select_target_features(out.hidden_states, run.layer_ids) if run.draft is not None else None
    timer.add("feature gathering", mark)
    return scores, features


def accept(run: DecodeRun, plan: DraftPlan, scores: NodeScores) -> AcceptResult:
    """The longest valid path (greedy match, or lossless stochastic acceptance) and the bonus token; the lookup
    learns its hit rates from it. Only the visited nodes' scores are processed (in fp32: logits processors and
    timings see what they see in plain decoding)."""
    tree, mark = plan.tree, run.timer.now()
    if run.do_sample:
        # A root-only tree has no drafted children: sample_accept then draws the bonus from p.
        draft_probs = tree.draft_probs if tree.draft_probs is not None else (lambda node: torch.zeros_like(
            scores.raw(node)))  # fmt: skip
        result = sample_accept(tree.tokens, tree.parents, scores.probs, draft_probs,
                               point_mass=plan.point_mass, draws=plan.draws)  # fmt: skip
    else:
        result = greedy_accept(tree.tokens, tree.parents, scores.greedy_choice)
    if run.lookup is not None and plan.match is not None:
        run.lookup.observe(tree.parents.tolist(), plan.match, result.path)
    run.timer.add("acceptance", mark)
    return result


def update_caches_and_features(
    run: DecodeRun, tree: DraftTree, past: int, result: AcceptResult, features: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Keep only the accepted path in the target cache; queue its features for the draft. Returns (tokens, path)."""
    mark = run.timer.now()
    path = torch.tensor(result.path, device=run.device)
    keep_cache_entries(run.cache, past, path)
    run.timer.add("cache compaction", mark)
    mark = run.timer.now()
    new_tokens = tree.tokens[path[1:]].tolist() + [int(result.bonus_token)]
    if run.draft is not None:
        run.state.add_verified(features[:, path], torch.tensor([new_tokens], device=run.device))  # [1, a+1, 3Ht]
    run.timer.add("feature gathering", mark)
    _sync(run.device)
    return new_tokens, path


def record_cycle(run: DecodeRun, plan: DraftPlan, path: list[int], emitted: int, verify_s: float) -> None:
    """Bookkeeping: timings, tree sizes, where the accepted tokens came from, and what the cost model learns."""
    cost = run.cost
    n_nodes, accepted = plan.tree.num_nodes, len(path) - 1
    run.verify_time += verify_s
    cost.verify.observe(n_nodes, verify_s)
    run.tree_sizes.append(n_nodes)
    sources = plan.sources if plan.sources is not None else [0] + [DRAFT] * (n_nodes - 1)
    counts = source_counts(sources, path, min(accepted, emitted)) if n_nodes > 1 else (0, 0, 0)
    run.accept_sources.append(counts)
    if n_nodes > 1:
        cost.record_cycle(plan.predicted, accepted)
    if plan.consulted and run.adaptive_tree:
        # tokens gained over plain decoding in the same time: a declined consultation only cost its draft time.
        # Only the tokens the draft proposed count: the lookup's would have come without consulting it.
        from_draft = sum(1 for node in path[1:] if sources[node] & DRAFT)
        spent = plan.seconds + (verify_s if n_nodes > 1 else 0.0)
        cost.after_consultation((from_draft + 1 if n_nodes > 1 else 0) - spent * cost.plain_rate())


# ------------------------------------------------------------------------------------------------
# helpers


def _exact_kwargs(run: DecodeRun) -> dict[str, Any]:
    """The keyword that hands the call's row-exact state to the attention function (see exact_attention.py)."""
    return {} if run.exact is None else {"eagle3_exact": run.exact}


def _target_mask(config: Any, tree_mask: torch.Tensor, past: int, dtype: torch.dtype) -> Any:
    """4D additive tree mask for the target; a per-layer-type dict when it mixes sliding-window layers."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    full = verification_mask(tree_mask, past, dtype)
    if window and layer_types and "sliding_attention" in layer_types:
        sliding = verification_mask(tree_mask, past, dtype, sliding_window=window)
        return {"full_attention": full, "sliding_attention": sliding}
    if window and not layer_types and getattr(text, "use_sliding_window", True):
        return verification_mask(tree_mask, past, dtype, sliding_window=window)
    return full


def _prune(tree: DraftTree, n: int) -> DraftTree:
    """The tree of the root and its `n` best nodes (by cumulative draft score)."""
    if n >= tree.tokens.numel() - 1:
        return tree
    kept, parents = rerank(tree.scores[1:], tree.parents[1:] - 1, n + 1)
    index = torch.cat([torch.zeros(1, dtype=torch.long, device=kept.device), kept + 1])
    return DraftTree.from_parents(tokens=tree.tokens[index], parents=parents, scores=tree.scores[index])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """Tokens of left padding to skip. Batch-1 left padding carries no information: the target and draft never see
    it, while logits processors and stopping criteria see the whole sequence, as in plain generate()."""
    if attention_mask is None:
        return 0
    attention_mask = attention_mask.to(input_ids.device)
    if bool(attention_mask.all()):
        return 0
    valid = attention_mask[0].bool()
    first = int(valid.nonzero()[0]) if valid.any() else input_ids.shape[1]
    if not bool(valid[first:].all()):
        raise ValueError(
            "EAGLE-3 decoding accepts left padding only, but the attention_mask has zeros after the first token "
            f"(mask {attention_mask[0].tolist()}). Without an explicit attention_mask, generate() masks every "
            "prompt token equal to pad_token_id: pass attention_mask=torch.ones_like(input_ids)."
        )
    return first
