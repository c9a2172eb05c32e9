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

A batch of several (left-padded) prompts goes to batched.py, the same cycle over every row at once. The loop
for one prompt: prefill the target, collecting the three tapped hidden states; then per
cycle draft a tree (drafting.py), verify all its nodes in one target forward with a 4D tree mask
and depth positions, accept the longest valid path (verification.py), keep only the accepted KV
entries, and feed the accepted tokens' tapped features -- taken from that same forward -- to the draft.

A context lookup (hybrid.py) adds the continuations of the current suffix's earlier occurrences to the same tree:
`context_lookup=True` with a draft (the hybrid tree; the default for one prompt), or `assistant_model=ContextLookup()`
without one (model-free, for a target that has no trained draft yet: `ContextLookup.bind(target)` routes its
generate() the same way).
"""

from __future__ import annotations

import copy
import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import LogitsProcessorList, StopStringCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from eagle3_hf.generation.batched import batched_decoding, refuse_unsupported, sequences as batched_sequences
from eagle3_hf.generation.cost_model import CycleCostModel
from eagle3_hf.generation.drafting import TreeBudget, crop_cache, editable_cache
from eagle3_hf.generation.exact_attention import exact_verification
from eagle3_hf.generation.hybrid import LookupOptions, LookupState
from eagle3_hf.generation.timing import NO_TIMER, NullTimer
from eagle3_hf.generation.verify_choice import VerifyChoice, check_exact_verify, choose_verification
from eagle3_hf.generation.steps import (
    DecodeRun,
    accept,
    draft_tree,
    emit,
    left_padding,
    prefill,
    record_cycle,
    update_caches_and_features,
    verify,
)
from eagle3_hf.modeling._compat import generate_output_cache_field
from eagle3_hf.modeling.embedding import embeddings_match, stored_embedding, whole_tensor
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel, register_binder


# Per-call tree options, also read from a GenerationConfig (GenerationConfig(tree_depth=4) keeps unknown fields).
TREE_OPTIONS = ("tree_depth", "tree_top_k", "tree_total_tokens", "adaptive_tree", "exact_verify", "context_lookup",
                "lookup_depth", "lookup_branches", "lookup_confidence")
# Options of stock assisted generation that mean nothing for a tree.
CHAIN_OPTIONS = ("num_assistant_tokens", "num_assistant_tokens_schedule")
_DEFAULT_CONFIG = GenerationConfig()


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
        accept_sources: per cycle, `(draft, lookup, both)`: how many of its accepted tree tokens (the bonus token
            excluded) the draft proposed, the context lookup proposed, or both did.
        accepted_from_draft, accepted_from_lookup, accepted_from_both: their totals over the call.
        verification: "row-exact" or "one-call", the verification that ran; verification_reason: why (verify_choice.py).

    A batch of B > 1 prompts gives `accept_lengths` and `tree_sizes` per row (a list each), the batch's times, no
    lookup statistics and no cache.
    """

    accept_lengths: list[int] | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    prefill_time: float | None = None
    tree_sizes: list[int] | None = None
    accept_sources: list[tuple[int, int, int]] | None = None
    accepted_from_draft: int | None = None
    accepted_from_lookup: int | None = None
    accepted_from_both: int | None = None
    verification: str | None = None
    verification_reason: str | None = None


@dataclass
class ContextLookup:
    """A model-free assistant: each cycle verifies the tree of the context lookup's continuations alone.

    For a target that has no trained draft yet::

        lookup = ContextLookup().bind(target)  # routes target.generate, as binding a draft does
        out = target.generate(input_ids, assistant_model=lookup, max_new_tokens=128)

    The fields are the defaults of the per-call options of the same names (a call's keyword wins): `tree_depth`
    (tokens per continuation), `tree_total_tokens` (tree size, root included), `lookup_branches` (earlier
    occurrences continued per cycle) and `lookup_max_ngram`. Exact like EAGLE-3: greedy output is the target's own
    greedy output, sampling follows its distribution.
    """

    tree_depth: int = 8
    tree_total_tokens: int = 16
    lookup_branches: int = 4
    lookup_max_ngram: int = 4

    def bind(self, target: PreTrainedModel) -> ContextLookup:
        """Route `target.generate` so that `assistant_model=self` (or a bound draft) selects tree decoding."""
        _route_generate(target)
        return self


def _route_generate(target: PreTrainedModel) -> None:
    bound = getattr(target, "generate", None)
    if not isinstance(bound, functools.partial) or bound.func is not _bound_generate:
        target.generate = functools.partial(_bound_generate, target)


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
    else:
        theirs = whole_tensor(target.get_input_embeddings().weight)  # gathered when FSDP2 shards the target
        if tuple(theirs.shape) == tuple(draft.embed_tokens.weight.shape) and not embeddings_match(
            stored_embedding(draft), theirs  # in the dtype it came in: the draft may hold it upcast
        ):
            raise ValueError(
                "The draft's token embedding differs from this target's (same shape, other values): it was trained "
                "for another model, or carries a re-initialised embedding. Load it with "
                "Eagle3DraftModel.from_pretrained(path, target=target, use_target_embedding=True) to use the "
                "target's embedding instead."
            )
    _route_generate(target)


def _tree_options_and_refusals(target: PreTrainedModel, config: GenerationConfig | None, kwargs: dict) -> None:
    """Read the tree options from a `GenerationConfig` (call kwargs win), and refuse the options of the other
    speculative methods: prompt lookup is a different method, and `num_assistant_tokens` sizes chains, not trees."""
    config = config if config is not None else target.generation_config
    for name in TREE_OPTIONS:
        if name not in kwargs and getattr(config, name, None) is not None:
            kwargs[name] = getattr(config, name)
    if kwargs.get("prompt_lookup_num_tokens") is not None or getattr(config, "prompt_lookup_num_tokens", None):
        raise ValueError(
            "prompt_lookup_num_tokens asks for prompt-lookup decoding (transformers'), assistant_model="
            "<Eagle3DraftModel> or <ContextLookup> for tree decoding: pass one of them."
        )
    for name in CHAIN_OPTIONS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{name} sizes the chains of stock assisted generation; EAGLE-3 drafts a tree: pass tree_depth, "
                "tree_top_k and tree_total_tokens instead."
            )
        if getattr(config, name, None) != getattr(_DEFAULT_CONFIG, name, None):
            warnings.warn(
                f"The generation config's {name}={getattr(config, name)!r} is ignored by EAGLE-3 decoding, which "
                "drafts a tree sized by tree_depth, tree_top_k and tree_total_tokens.", UserWarning, stacklevel=3,
            )  # fmt: skip


def _bound_generate(target: PreTrainedModel, *args: Any, assistant_model: Any = None, **kwargs: Any) -> Any:
    if not isinstance(assistant_model, (Eagle3DraftModel, ContextLookup)):
        return type(target).generate(target, *args, assistant_model=assistant_model, **kwargs)
    if isinstance(assistant_model, Eagle3DraftModel):
        assistant_model.config.check_target_config(target.config)
    _tree_options_and_refusals(target, kwargs.get("generation_config") or (args[1] if len(args) > 1 else None), kwargs)
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
# the decoding loop


def eagle3_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    eagle3_draft: Eagle3DraftModel | ContextLookup | None = None,
    eagle3_streamer: Any = None,
    eagle3_timer: NullTimer = NO_TIMER,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    tree_total_tokens: int | None = None,
    adaptive_tree: bool = True,
    exact_verify: bool | str = "auto",
    context_lookup: bool | None = None,
    lookup_depth: int | None = None,
    lookup_branches: int | None = None,
    lookup_confidence: float | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | Eagle3GenerateOutput:
    """`custom_generate` callable running EAGLE-3 tree decoding (see the module docstring).

    Per-call options (defaults from the draft config): `tree_depth`, `tree_top_k`, `tree_total_tokens`;
    `adaptive_tree=False` always drafts the full tree instead of sizing it with the cost model.
    `exact_verify="auto"` (default) verifies each tree node with the attention call shape of the target's own
    decoding step (exact_attention.py) where the row-invariance probe proves that reproduces one-token steps bit for
    bit on this hardware, and the whole tree in one tree-masked call elsewhere (verify_choice.py); True / False force
    one or the other. The output's `verification` says which ran.

    Context lookup (hybrid.py): `context_lookup` (default: on for one prompt, the fastest method measured; off for a
    batch, which does not support it yet) grafts the continuations of the current suffix's earlier
    occurrences into the draft's tree each cycle (always on with a `ContextLookup` assistant, which has no draft);
    `lookup_depth` tokens per continuation (default: the tree depth), `lookup_branches` continuations (default 4),
    and the draft's forward is skipped in a cycle where the lookup's best next token has an estimated acceptance of
    at least `lookup_confidence` (default 0.8; 1.0 or more: never).
    """
    if isinstance(eagle3_draft, ContextLookup):
        draft, context_lookup = None, True
        defaults = dict(depth=eagle3_draft.tree_depth, top_k=eagle3_draft.lookup_branches,
                        total=eagle3_draft.tree_total_tokens, max_ngram=eagle3_draft.lookup_max_ngram)  # fmt: skip
        lookup_branches = eagle3_draft.lookup_branches if lookup_branches is None else lookup_branches
    elif isinstance(eagle3_draft, Eagle3DraftModel):
        draft = eagle3_draft
        draft.config.check_target_config(model.config)
        defaults = dict(depth=draft.config.tree_depth, top_k=draft.config.tree_top_k,
                        total=draft.config.tree_total_tokens, max_ngram=LookupOptions.max_ngram)  # fmt: skip
    else:
        raise ValueError(
            f"eagle3_decoding needs `eagle3_draft`, an Eagle3DraftModel or a ContextLookup; got "
            f"{type(eagle3_draft).__name__}."
        )
    input_ids = input_ids.to(model.device)  # generate() passes CPU ids through for a model on an accelerator
    if generation_config.num_beams not in (None, 1):
        raise ValueError(
            f"EAGLE-3 decoding does not combine with beam search; got num_beams={generation_config.num_beams}."
        )
    if (generation_config.num_return_sequences or 1) != 1:
        raise ValueError(
            f"EAGLE-3 decoding returns one sequence; got num_return_sequences={generation_config.num_return_sequences}."
        )
    budget = TreeBudget(
        depth=defaults["depth"] if tree_depth is None else tree_depth,
        top_k=defaults["top_k"] if tree_top_k is None else tree_top_k,
        total_tokens=defaults["total"] if tree_total_tokens is None else tree_total_tokens,
    )
    if budget.depth < 1 or budget.top_k < 1 or budget.total_tokens < 2:
        raise ValueError(
            f"tree_depth and tree_top_k must be >= 1 and tree_total_tokens >= 2; got depth={budget.depth}, "
            f"top_k={budget.top_k}, total_tokens={budget.total_tokens}."
        )
    do_sample = bool(generation_config.do_sample)
    return_dict = bool(generation_config.return_dict_in_generate)
    exact_verify = check_exact_verify(exact_verify)
    if input_ids.shape[0] > 1:
        cache = editable_cache(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
        return _decode_batch(model, draft, input_ids, logits_processor, stopping_criteria, generation_config, budget,
                             cache, model_kwargs.get("attention_mask"), eagle3_streamer, bool(context_lookup),
                             exact_verify, adaptive_tree)  # fmt: skip
    start = left_padding(input_ids, model_kwargs.get("attention_mask"))
    cache = editable_cache(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
    lookup = None
    if context_lookup is None or context_lookup:
        lookup = LookupState(options=LookupOptions(
            depth=budget.depth if lookup_depth is None else lookup_depth,
            branches=LookupOptions.branches if lookup_branches is None else lookup_branches,
            max_ngram=defaults["max_ngram"],
            confidence=LookupOptions.confidence if lookup_confidence is None else lookup_confidence,
        ))  # fmt: skip
    layers = model.config.get_text_config().num_hidden_layers
    run = DecodeRun(
        model=model, draft=draft, input_ids=input_ids, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, budget=budget, lookup=lookup,
        cache=cache, layer_ids=draft.config.resolved_target_layer_ids(layers) if draft is not None else [],
        start=start, do_sample=do_sample,
        temperature=float(generation_config.temperature or 1.0) if do_sample else 1.0, adaptive_tree=adaptive_tree,
        streamer=eagle3_streamer, timer=eagle3_timer, output_scores=return_dict and bool(generation_config.output_scores),
        output_logits=return_dict and bool(generation_config.output_logits),
        cost=CycleCostModel.for_device(model.device.type, model.dtype),
    )  # fmt: skip

    choice = choose_verification(model, exact_verify)
    with exact_verification(model, enabled=choice.exact) as run.exact:
        if run.exact is not None:
            run.exact.timer = run.timer
        _decode(run)
    return _finish(run, return_dict, choice)


def _decode(run: DecodeRun) -> None:
    """Prefill, then draft -> verify -> accept -> update -> record -> emit until a stopping criterion fires."""
    prefill(run)
    while not run.finished:
        past = run.cache.get_seq_length()
        run.timer.start_cycle(past=past)
        plan = draft_tree(run, root=int(run.input_ids[0, -1]))
        t0 = time.perf_counter()
        scores, features = verify(run, plan.tree, past)
        result = accept(run, plan, scores)
        new_tokens, _ = update_caches_and_features(run, plan.tree, past, result, features)
        verify_s = time.perf_counter() - t0
        if run.timer.enabled:
            run.timer.note(nodes=plan.tree.num_nodes, accepted=len(result.path) - 1, draft_s=plan.seconds,
                           verify_s=verify_s, parents=plan.tree.parents.tolist())
        # A stopping criterion may cut the cycle short: count only the tokens that reached the output, and keep the
        # cache in step with them (like plain decoding's, it holds every token but the last).
        mark = run.timer.now()
        nodes = result.path
        rows = scores.processed_rows(nodes) if run.output_scores else None
        emitted = emit(run, new_tokens, rows, scores.raw_rows(nodes) if run.output_logits else None)
        run.timer.add("emit (outside verify)", mark)
        record_cycle(run, plan, result.path, emitted, verify_s)
        run.accept_lengths.append(emitted)
        if emitted < len(new_tokens):
            crop_cache(run.cache, past + emitted)


def _decode_batch(
    model: PreTrainedModel, draft: Eagle3DraftModel | None, input_ids: torch.Tensor, logits_processor: Any,
    stopping_criteria: Any, generation_config: GenerationConfig, budget: TreeBudget, cache: Any,
    attention_mask: torch.Tensor | None, streamer: Any, context_lookup: bool, exact_verify: bool | str,
    adaptive_tree: bool,
) -> torch.LongTensor | Eagle3GenerateOutput:
    """A batch of B > 1 prompts (batched.py), after refusing what that loop does not do yet."""
    refuse_unsupported(input_ids.shape[0], draft, context_lookup, exact_verify, generation_config)
    run = batched_decoding(model, draft, input_ids, logits_processor, stopping_criteria, generation_config, budget,
                           cache, attention_mask, streamer, adaptive_tree)  # fmt: skip
    if not generation_config.return_dict_in_generate:
        return batched_sequences(run)
    choice = choose_verification(model, exact_verify, rows=input_ids.shape[0])
    return Eagle3GenerateOutput(
        sequences=batched_sequences(run), accept_lengths=run.accept_lengths, tree_sizes=run.tree_sizes,
        draft_time=run.draft_time, verify_time=run.verify_time, prefill_time=run.prefill_time,
        verification=choice.mode, verification_reason=choice.reason,
    )  # no cache: the loop drops finished rows from it, so it no longer matches the output's rows


def _finish(run: DecodeRun, return_dict: bool, choice: VerifyChoice) -> torch.LongTensor | Eagle3GenerateOutput:
    if run.streamer is not None:
        run.streamer.end()
    if not return_dict:
        return run.input_ids
    return Eagle3GenerateOutput(
        sequences=run.input_ids,
        scores=run.scores if run.output_scores else None,
        logits=run.raw_logits if run.output_logits else None,
        accept_lengths=run.accept_lengths,
        draft_time=run.draft_time,
        verify_time=run.verify_time,
        prefill_time=run.prefill_time,
        tree_sizes=run.tree_sizes,
        accept_sources=run.accept_sources,
        accepted_from_draft=sum(c[0] for c in run.accept_sources),
        accepted_from_lookup=sum(c[1] for c in run.accept_sources),
        accepted_from_both=sum(c[2] for c in run.accept_sources),
        verification=choice.mode,
        verification_reason=choice.reason,
        **{generate_output_cache_field(): run.cache},
    )
