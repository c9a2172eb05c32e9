"""The steps of one EAGLE-3 decoding call, each a function over one explicit per-call state (`DecodeRun`).

`eagle3_decoding` (decoding.py) only sequences them: `prefill`, then per cycle `draft_tree` -> `verify` -> `accept`
-> `update_caches_and_features` -> `record_cycle` -> `emit` (which checks the stopping criteria). Per-call state
lives in `DecodeRun` and the draft-side `DraftState`, never on the modules.

Invariants between cycles: the target cache holds every output token but the last (the tree's root), and the
draft state holds the tapped target features of every verified token, pending until the draft is next consulted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList, StoppingCriteriaList

from eagle3_hf.generation.cost_model import CycleCostModel
from eagle3_hf.generation.exact_attention import ExactAttention
from eagle3_hf.generation.drafting import (
    DraftState,
    TreeBudget,
    build_greedy_tree,
    build_sampled_tree,
    crop_cache,
    flush_pending,
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
    draft: Eagle3DraftModel
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
    scores: tuple[torch.Tensor, ...] = ()
    raw_logits: tuple[torch.Tensor, ...] = ()
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
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


# ------------------------------------------------------------------------------------------------
# the steps


def select_token(run: DecodeRun, processed: torch.Tensor) -> int:
    if run.do_sample:
        return int(torch.multinomial(torch.softmax(processed, dim=-1), 1))
    return int(processed.argmax())


def emit(run: DecodeRun, tokens: list[int], rows: torch.Tensor, raw: torch.Tensor) -> int:
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
            input_ids=run.input_ids[:, run.start :], use_cache=True, output_hidden_states=True, logits_to_keep=1,
            **cache_kwargs(run.cache), **_exact_kwargs(run),
        )  # fmt: skip
    raw = out.logits[:, -1].float()
    processed = run.logits_processor(run.input_ids, raw.clone())
    first_token = select_token(run, processed[0])
    features = select_target_features(out.hidden_states, run.layer_ids)  # [1, N, 3Ht]
    del out
    first = torch.tensor([[first_token]], device=run.device)
    run.state.add_verified(features, torch.cat([run.input_ids[:, run.start + 1 :], first], dim=1))
    _sync(run.device)
    run.prefill_time = time.perf_counter() - t0
    emit(run, [first_token], processed, raw)


def draft_tree(run: DecodeRun, root: int) -> DraftPlan:
    """Draft a tree from `root` -- or not, when the cost model says a plain step is faster this cycle."""
    cost, state, budget = run.cost, run.state, run.budget
    t0 = time.perf_counter()
    plan = DraftPlan(consulted=not run.adaptive_tree or cost.consult_draft())
    if plan.consulted:
        flush_pending(run.draft, state)  # verified pairs since the last consultation; not a draft step
        t_tree = time.perf_counter()
        calls_before = state.forward_calls
        # the draft's best next tokens: the depth-1 candidates a tree would start from
        probs = torch.softmax(state.last_logits.float() / run.temperature, dim=-1)
        top = probs.topk(min(budget.top_k, probs.numel())).values
        if not run.adaptive_tree or cost.worth_drafting(top):
            budget.grow = cost.worth_deeper if run.adaptive_tree else None
            if run.do_sample:
                plan.tree = build_sampled_tree(run.draft, state, root, budget, run.temperature)
            else:
                plan.tree = build_greedy_tree(run.draft, state, root, budget)
                if run.adaptive_tree:
                    order = torch.argsort(-plan.tree.scores[1:], stable=True)
                    n, plan.predicted = cost.choose_size(plan.tree.scores[1:][order].exp(), time.perf_counter() - t0)
                    plan.tree = _prune(plan.tree, n) if n > 0 else None
            if plan.tree is not None and plan.predicted == 0.0:
                plan.predicted = float(plan.tree.scores[1:].exp().sum())
        _sync(run.device)
        plan.seconds = time.perf_counter() - t0
        if state.forward_calls > calls_before:
            cost.draft_step.observe(1, (time.perf_counter() - t_tree) / (state.forward_calls - calls_before))
        run.draft_time += plan.seconds
    if plan.tree is None:
        plan.tree = DraftTree.from_parents(
            tokens=torch.tensor([root], device=run.device),
            parents=torch.tensor([-1], device=run.device),
            scores=torch.zeros(1, device=run.device),
        )
    return plan


def verify(run: DecodeRun, tree: DraftTree, past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One target forward over every tree node (tree mask, depth positions).

    Returns raw logits `[T, V]`, processed logits `[T, V]` (each node under its own path) and tapped features
    `[1, T, 3Ht]`.
    """
    model = run.model
    if run.exact is not None:
        run.exact.set_tree(tree.parents, past)
    try:
        with torch.no_grad():
            mask = None
            if tree.tokens.numel() > 1:
                mask = _target_mask(model.config, tree_attention_mask(tree.parents), past, model.dtype)
            out = model(
                input_ids=tree.tokens[None],
                attention_mask=mask,
                position_ids=(past + tree.depths)[None],
                use_cache=True,
                output_hidden_states=True,
                **cache_kwargs(run.cache),
                **_exact_kwargs(run),
            )
    finally:
        if run.exact is not None:
            run.exact.clear_tree()
    raw = out.logits[0].float()  # [T, V]
    processed = _process_tree_scores(run.logits_processor, run.input_ids, tree, raw.clone())
    return raw, processed, select_target_features(out.hidden_states, run.layer_ids)


def accept(run: DecodeRun, tree: DraftTree, processed: torch.Tensor) -> AcceptResult:
    """The longest valid path (greedy match, or lossless stochastic acceptance) and the bonus token."""
    if run.do_sample:
        # A root-only tree has no drafted children: sample_accept then draws the bonus from p.
        draft_probs = tree.draft_probs if tree.draft_probs is not None else torch.zeros_like(processed)
        return sample_accept(tree.tokens, tree.parents, torch.softmax(processed, dim=-1), draft_probs)
    return greedy_accept(tree.tokens, tree.parents, processed.argmax(dim=-1))


def update_caches_and_features(
    run: DecodeRun, tree: DraftTree, past: int, result: AcceptResult, features: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """Keep only the accepted path in the target cache; queue its features for the draft. Returns (tokens, path)."""
    path = torch.tensor(result.path, device=run.device)
    _keep_cache_entries(run.cache, past, path)
    new_tokens = tree.tokens[path[1:]].tolist() + [int(result.bonus_token)]
    run.state.add_verified(features[:, path], torch.tensor([new_tokens], device=run.device))  # [1, a+1, 3Ht]
    _sync(run.device)
    return new_tokens, path


def record_cycle(run: DecodeRun, plan: DraftPlan, n_nodes: int, accepted: int, verify_s: float) -> None:
    """Bookkeeping: timings, tree sizes, and what the cost model learns from this cycle."""
    cost = run.cost
    run.verify_time += verify_s
    cost.verify.observe(n_nodes, verify_s)
    run.tree_sizes.append(n_nodes)
    if n_nodes > 1:
        cost.record_cycle(plan.predicted, accepted)
    if plan.consulted and run.adaptive_tree:
        # tokens gained over plain decoding in the same time: a declined consultation only cost its draft time
        spent = plan.seconds + (verify_s if n_nodes > 1 else 0.0)
        cost.after_consultation((accepted + 1 if n_nodes > 1 else 0) - spent * cost.plain_rate())


# ------------------------------------------------------------------------------------------------
# helpers


def editable_cache(cache: Any) -> DynamicCache:
    """The target cache to decode into; refuse caches whose entries cannot be selected and cropped."""
    if cache is None:
        return DynamicCache()
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"EAGLE-3 tree decoding edits the target KV cache (keeps only accepted tree nodes); a "
            f"{type(cache).__name__} cannot be edited that way. Use the default DynamicCache (no cache_implementation)."
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            f"EAGLE-3 decoding needs the target's hidden states for the whole prompt, so it prefills it itself; got a "
            f"cache already holding {cache.get_seq_length()} tokens. Pass no cache (or an empty DynamicCache)."
        )
    # A fresh cache: use plain full-attention layers, which can drop rejected nodes; sliding-window layers are
    # instead masked by the tree mask.
    return DynamicCache()


def _exact_kwargs(run: DecodeRun) -> dict[str, Any]:
    """The keyword that hands the call's row-exact state to the attention function (see exact_attention.py)."""
    return {} if run.exact is None else {"eagle3_exact": run.exact}


def _keep_cache_entries(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Move entries `start + keep` to `start, start+1, ...` and drop the rest (the accepted path of a tree).

    Entries already in place (a root-only cycle, or a path along the first nodes) are not copied, and nothing is
    cropped when nothing follows them: per layer that is four tensor ops saved on every plain step."""
    n = keep.numel()
    if keep.tolist() != list(range(n)):
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
                layer.keys[..., start : start + n, :] = layer.keys[..., start + keep, :]
                layer.values[..., start : start + n, :] = layer.values[..., start + keep, :]
    if cache.get_seq_length() > start + n:
        crop_cache(cache, start + n)


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


def _process_tree_scores(
    logits_processor: LogitsProcessorList, prefix: torch.Tensor, tree: DraftTree, logits: torch.Tensor
) -> torch.Tensor:
    """Apply the logits processors to every node's logits `[T, V]` with that node's own path as input_ids.

    Nodes at equal depth have equal path length, so each depth is one batched processor call.
    """
    logits = logits.float()
    if len(logits_processor) == 0:
        return logits
    parents = tree.parents.tolist()
    tokens = tree.tokens
    depths = tree.depths
    # path_tokens[i]: tokens of nodes on the path from depth 1 to i
    path_nodes: list[list[int]] = [[]]
    for i in range(1, len(parents)):
        path_nodes.append(path_nodes[parents[i]] + [i])
    out = torch.empty_like(logits)
    for d in range(int(depths.max()) + 1):
        rows = (depths == d).nonzero().flatten()
        ids = prefix.expand(rows.numel(), -1)
        if d > 0:
            paths = torch.tensor([path_nodes[r] for r in rows.tolist()], device=tokens.device)
            ids = torch.cat([ids, tokens[paths]], dim=1)
        out[rows] = logits_processor(ids, logits[rows])
    return out


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


