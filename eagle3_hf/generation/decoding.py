"""EAGLE-3 tree decoding inside `target.generate(..., assistant_model=draft)`.

How it plugs in. Stock assisted generation verifies single chains (even the candidate generators that
read the target's hidden states), and transformers has no registry for candidate generators. Its public extension
point for a whole decoding loop is `generate(custom_generate=callable)`: generate() still prepares
the cache, logits processors and stopping criteria, then hands over. Binding a draft to a target
(`draft.bind(target)`, done by `Eagle3DraftModel.from_pretrained(..., target=)` and `from_target`)
sets `target.generate` on that one instance -- the same per-instance mechanism transformers itself
uses for `custom_generate` folders shipped with a model -- to a thin wrapper: with an
`Eagle3DraftModel` as `assistant_model` it calls the class's own `generate` with
`custom_generate=eagle3_decoding`; otherwise it calls it unchanged. Nothing in transformers is
patched, and it only relies on the public `custom_generate` contract.

The loop (batch size 1): prefill the target, collecting the three tapped hidden states; then per
cycle draft a tree (drafting.py), verify all its nodes in one target forward with a 4D tree mask
and depth positions, accept the longest valid path (verification.py), keep only the accepted KV
entries, and feed the accepted tokens' tapped features -- taken from that same forward -- to the draft.
"""

from __future__ import annotations

import copy
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import LogitsProcessorList, StopStringCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from eagle3_hf.modeling._compat import cache_kwargs, generate_output_cache_field
from eagle3_hf.generation.cost_model import CycleCostModel
from eagle3_hf.generation.drafting import (
    DraftState,
    TreeBudget,
    build_greedy_tree,
    build_sampled_tree,
    crop_cache,
    flush_pending,
)
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, register_binder, select_target_features
from eagle3_hf.generation.tree import DraftTree, rerank, tree_attention_mask, verification_mask
from eagle3_hf.generation.verification import greedy_accept, sample_accept


@dataclass
class Eagle3GenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus EAGLE-3 statistics.

    Args:
        accept_lengths: tokens each verification cycle added to the output (accepted drafts + the bonus token; a plain
            step counts 1; the last cycle counts only what the stopping criteria let through). The prefill's token is
            not a cycle, so `sum(accept_lengths) == generated tokens - 1`.
        draft_time: seconds spent in the draft (tree building and cache updates).
        verify_time: seconds spent in target forwards (prefill excluded) and acceptance.
        prefill_time: seconds of the target's prompt forward.
        tree_sizes: nodes verified per cycle, root included (1 = plain step).
    """

    accept_lengths: list[int] | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    prefill_time: float | None = None
    tree_sizes: list[int] | None = None


# ------------------------------------------------------------------------------------------------
# binding


@register_binder
def bind_target(draft: Eagle3DraftModel, target: PreTrainedModel) -> None:
    """Check `draft` fits `target`, give it the target embedding if it lacks one, route generate() to EAGLE-3."""
    if not isinstance(draft, Eagle3DraftModel):
        raise ValueError(f"bind_target expects an Eagle3DraftModel, got {type(draft).__name__}.")
    draft.config.check_target_config(target.config)
    if draft.config.target_num_hidden_layers is None:
        draft.config.target_num_hidden_layers = target.config.get_text_config().num_hidden_layers
    if draft.config.target_layer_ids is None:
        draft.config.target_layer_ids = draft.config.resolved_target_layer_ids(draft.config.target_num_hidden_layers)
    if not draft.embedding_loaded:
        if draft.config.hidden_size != draft.config.target_hidden_size:
            raise ValueError(
                f"The draft has no embedding and cannot share the target's: draft hidden_size "
                f"{draft.config.hidden_size} != target hidden size {draft.config.target_hidden_size}."
            )
        draft.load_target_embedding(target)
    bound = getattr(target, "generate", None)
    if not isinstance(bound, functools.partial) or bound.func is not _bound_generate:
        target.generate = functools.partial(_bound_generate, target)


def _bound_generate(target: PreTrainedModel, *args: Any, assistant_model: Any = None, **kwargs: Any) -> Any:
    if not isinstance(assistant_model, Eagle3DraftModel):
        return type(target).generate(target, *args, assistant_model=assistant_model, **kwargs)
    assistant_model.config.check_target_config(target.config)
    # generate() hands a custom_generate callable neither the streamer nor the tokenizer (it rebuilds those
    # kwargs from the callable's signature): pass the streamer under our own name, and build the stop-string
    # criterion here, since generate() would otherwise fail to find a tokenizer for it.
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
    if config is None and getattr(target.generation_config, "stop_strings", None):
        kwargs["generation_config"] = config = target.generation_config
    if stop_strings is None and config is not None and getattr(config, "stop_strings", None):
        config = copy.deepcopy(config)
        stop_strings, config.stop_strings = config.stop_strings, None
        if "generation_config" in kwargs:
            kwargs["generation_config"] = config
        else:
            args = (args[0], config, *args[2:])
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass `tokenizer=` to generate().")
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        kwargs["stopping_criteria"] = criteria
    return type(target).generate(
        target, *args, custom_generate=eagle3_decoding, eagle3_draft=assistant_model,
        eagle3_streamer=kwargs.get("streamer"), **kwargs,
    )


# ------------------------------------------------------------------------------------------------
# helpers


def _editable_cache(cache: Any) -> DynamicCache:
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


def _keep_cache_entries(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Move entries `start + keep` to `start, start+1, ...` and drop the rest (the accepted path of a tree)."""
    n = keep.numel()
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0:
            layer.keys[..., start : start + n, :] = layer.keys[..., start + keep, :]
            layer.values[..., start : start + n, :] = layer.values[..., start + keep, :]
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


# ------------------------------------------------------------------------------------------------
# the decoding loop


def eagle3_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    eagle3_draft: Eagle3DraftModel | None = None,
    eagle3_streamer: Any = None,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    tree_total_tokens: int | None = None,
    adaptive_tree: bool = True,
    **model_kwargs: Any,
) -> torch.LongTensor | Eagle3GenerateOutput:
    """`custom_generate` callable running EAGLE-3 tree decoding (see the module docstring).

    Per-call options (defaults from the draft config): `tree_depth`, `tree_top_k`, `tree_total_tokens`;
    `adaptive_tree=False` always drafts the full tree instead of sizing it with the cost model.
    """
    draft = eagle3_draft
    if not isinstance(draft, Eagle3DraftModel):
        raise ValueError("eagle3_decoding needs `eagle3_draft`, an Eagle3DraftModel.")
    input_ids = input_ids.to(model.device)  # generate() passes CPU ids through for a model on an accelerator
    draft.config.check_target_config(model.config)
    if generation_config.num_beams not in (None, 1):
        raise ValueError(
            f"EAGLE-3 decoding does not combine with beam search; got num_beams={generation_config.num_beams}."
        )
    if (generation_config.num_return_sequences or 1) != 1:
        raise ValueError(
            f"EAGLE-3 decoding returns one sequence; got num_return_sequences={generation_config.num_return_sequences}."
        )
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"EAGLE-3 tree decoding supports batch size 1; got a batch of {input_ids.shape[0]}. "
            "Generate the prompts one at a time."
        )
    budget = TreeBudget(
        depth=draft.config.tree_depth if tree_depth is None else tree_depth,
        top_k=draft.config.tree_top_k if tree_top_k is None else tree_top_k,
        total_tokens=draft.config.tree_total_tokens if tree_total_tokens is None else tree_total_tokens,
    )
    if budget.depth < 1 or budget.top_k < 1 or budget.total_tokens < 2:
        raise ValueError(
            f"tree_depth and tree_top_k must be >= 1 and tree_total_tokens >= 2; got depth={budget.depth}, "
            f"top_k={budget.top_k}, total_tokens={budget.total_tokens}."
        )
    do_sample = bool(generation_config.do_sample)
    temperature = float(generation_config.temperature or 1.0) if do_sample else 1.0
    streamer = eagle3_streamer
    return_dict = bool(generation_config.return_dict_in_generate)
    output_scores = return_dict and bool(generation_config.output_scores)
    output_logits = return_dict and bool(generation_config.output_logits)

    # Batch-1 left padding carries no information: the target and draft never see it (`start` skips it), while
    # logits processors and stopping criteria see the whole sequence, as in plain generate().
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = None if attention_mask is None else attention_mask.to(model.device)
    start = 0
    if attention_mask is not None and not bool(attention_mask.all()):
        valid = attention_mask[0].bool()
        first = int(valid.nonzero()[0]) if valid.any() else input_ids.shape[1]
        if not bool(valid[first:].all()):
            raise ValueError(
                "EAGLE-3 decoding accepts left padding only, but the attention_mask has zeros after the first token "
                f"(mask {attention_mask[0].tolist()}). Without an explicit attention_mask, generate() masks every "
                "prompt token equal to pad_token_id: pass attention_mask=torch.ones_like(input_ids)."
            )
        start = first

    cache = _editable_cache(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
    layer_ids = draft.config.resolved_target_layer_ids(model.config.get_text_config().num_hidden_layers)
    dtype = model.dtype
    device = input_ids.device
    cost = CycleCostModel()
    state = DraftState(cache=DynamicCache())
    scores: tuple[torch.Tensor, ...] = ()
    raw_logits: tuple[torch.Tensor, ...] = ()
    accept_lengths: list[int] = []
    tree_sizes: list[int] = []
    draft_time = verify_time = 0.0

    def emit(tokens: list[int], rows: torch.Tensor, raw: torch.Tensor) -> int:
        """Append tokens one by one, checking the stopping criteria after each.

        Returns how many were appended: all of them, unless a criterion fired first (which also sets `finished`).
        """
        nonlocal input_ids, scores, raw_logits, finished
        for i, tok in enumerate(tokens):
            new = torch.tensor([[tok]], device=device, dtype=input_ids.dtype)
            input_ids = torch.cat([input_ids, new], dim=1)
            if output_scores:
                scores += (rows[i : i + 1],)
            if output_logits:
                raw_logits += (raw[i : i + 1],)
            if streamer is not None:
                streamer.put(new[0].cpu())
            if bool(stopping_criteria(input_ids, scores if output_scores else None).any()):
                finished = True
                return i + 1
        return len(tokens)

    def select(processed: torch.Tensor) -> int:
        if do_sample:
            return int(torch.multinomial(torch.softmax(processed, dim=-1), 1))
        return int(processed.argmax())

    # -- prefill ---------------------------------------------------------------------------------
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(
            input_ids=input_ids[:, start:], use_cache=True, output_hidden_states=True, logits_to_keep=1,
            **cache_kwargs(cache),
        )
    raw = out.logits[:, -1].float()
    processed = logits_processor(input_ids, raw.clone())
    first_token = select(processed[0])
    features = select_target_features(out.hidden_states, layer_ids)  # [1, N, 3Ht]
    del out
    next_pairs = torch.cat([input_ids[:, start + 1 :], torch.tensor([[first_token]], device=device)], dim=1)
    state.add_verified(features, next_pairs)
    _sync(device)
    prefill_time = time.perf_counter() - t0
    finished = False
    emit([first_token], processed, raw)

    # -- cycles ----------------------------------------------------------------------------------
    while not finished:
        past = cache.get_seq_length()
        root = int(input_ids[0, -1])
        t0 = time.perf_counter()
        tree: DraftTree | None = None
        predicted = 0.0
        consulted = not adaptive_tree or cost.consult_draft()
        cycle_draft_s = 0.0
        if consulted:
            flush_pending(draft, state)  # verified pairs since the last consultation; not a draft step
            t_tree = time.perf_counter()
            calls_before = state.forward_calls
            top_p = float(torch.softmax(state.last_logits.float() / temperature, dim=-1).max())
            if not adaptive_tree or cost.worth_drafting(top_p):
                budget.grow = cost.worth_deeper if adaptive_tree else None
                if do_sample:
                    tree = build_sampled_tree(draft, state, root, budget, temperature)
                else:
                    tree = build_greedy_tree(draft, state, root, budget)
                    if adaptive_tree:
                        order = torch.argsort(-tree.scores[1:], stable=True)
                        n, predicted = cost.choose_size(tree.scores[1:][order].exp(), time.perf_counter() - t0)
                        tree = _prune(tree, n) if n > 0 else None
                if tree is not None and predicted == 0.0:
                    predicted = float(tree.scores[1:].exp().sum())
            _sync(device)
            spent = time.perf_counter() - t0
            if state.forward_calls > calls_before:
                cost.draft_step.observe(1, (time.perf_counter() - t_tree) / (state.forward_calls - calls_before))
            cycle_draft_s = spent
            draft_time += spent
        if tree is None:
            tree = DraftTree.from_parents(
                tokens=torch.tensor([root], device=device),
                parents=torch.tensor([-1], device=device),
                scores=torch.zeros(1, device=device),
            )
        n_nodes = tree.tokens.numel()

        t1 = time.perf_counter()
        with torch.no_grad():
            mask = _target_mask(model.config, tree_attention_mask(tree.parents), past, dtype) if n_nodes > 1 else None
            out = model(
                input_ids=tree.tokens[None],
                attention_mask=mask,
                position_ids=(past + tree.depths)[None],
                use_cache=True,
                output_hidden_states=True,
                **cache_kwargs(cache),
            )
        raw = out.logits[0].float()  # [T, V]
        processed = _process_tree_scores(logits_processor, input_ids, tree, raw.clone())
        if do_sample:
            # A root-only tree has no drafted children: sample_accept then draws the bonus from p.
            draft_probs = tree.draft_probs if tree.draft_probs is not None else torch.zeros_like(processed)
            result = sample_accept(tree.tokens, tree.parents, torch.softmax(processed, dim=-1), draft_probs)
        else:
            result = greedy_accept(tree.tokens, tree.parents, processed.argmax(dim=-1))
        path = torch.tensor(result.path, device=device)
        _keep_cache_entries(cache, past, path)
        features = select_target_features(out.hidden_states, layer_ids)[:, path]  # [1, a+1, 3Ht]
        del out
        new_tokens = tree.tokens[path[1:]].tolist() + [int(result.bonus_token)]
        state.add_verified(features, torch.tensor([new_tokens], device=device))
        _sync(device)
        spent = time.perf_counter() - t1
        verify_time += spent
        cost.verify.observe(n_nodes, spent)
        accepted = len(result.path) - 1
        tree_sizes.append(n_nodes)
        if n_nodes > 1:
            cost.record_cycle(predicted, accepted)
            rate = (accepted + 1) / max(spent + cycle_draft_s, 1e-9)
            cost.after_cycle(True, rate > cost.plain_rate())
        elif consulted and adaptive_tree:  # the draft was asked and drafting did not pay: back off
            cost.after_cycle(False, False)
        # A stopping criterion may cut the cycle short: count only the tokens that reached the output, and keep the
        # cache in step with them (like plain decoding's, it holds every token but the last).
        emitted = emit(new_tokens, processed[path], raw[path])
        accept_lengths.append(emitted)
        if emitted < len(new_tokens):
            crop_cache(cache, past + emitted)

    if streamer is not None:
        streamer.end()
    sequences = input_ids
    if not return_dict:
        return sequences
    return Eagle3GenerateOutput(
        sequences=sequences,
        scores=scores if output_scores else None,
        logits=raw_logits if output_logits else None,
        accept_lengths=accept_lengths,
        draft_time=draft_time,
        verify_time=verify_time,
        prefill_time=prefill_time,
        tree_sizes=tree_sizes,
        **{generate_output_cache_field(): cache},
    )
