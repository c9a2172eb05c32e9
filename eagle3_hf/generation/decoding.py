"""EAGLE-3 tree decoding inside `target.generate(..., assistant_model=draft)`: binding, options, the output.

How it plugs in. Stock assisted generation verifies single chains, and transformers has no registry for candidate
generators; its public extension point for a whole decoding loop is `generate(custom_generate=callable)`: generate()
still prepares the cache, logits processors and stopping criteria, then hands over. `bind_target(draft, target)` (or
`ContextLookup().bind(target)`) sets `target.generate` on that one instance -- the per-instance mechanism transformers
itself uses for `custom_generate` folders shipped with a model -- to a thin wrapper that calls the class's own
`generate` with `custom_generate=eagle3_decoding` for an EAGLE-3 assistant, and unchanged otherwise. Nothing in
transformers is patched. The loop itself is engine.py's; the proposers (the draft's tree, the context lookup's, the
corpus's, merged) are proposers.py's.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import LogitsProcessorList, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from eagle3_hf.generation.corpus_source import open_corpus
from eagle3_hf.generation.cost_model import CycleCostModel
from eagle3_hf.generation.cycle import CycleRecord, DecodeRun, Emission
from eagle3_hf.generation.drafting import TreeBudget
from eagle3_hf.generation.emission import score_steps, sequences
from eagle3_hf.generation.engine import decode
from eagle3_hf.generation.exact_attention import exact_verification
from eagle3_hf.generation.hybrid import LookupOptions, source_totals
from eagle3_hf.generation.proposers import build_proposer
from eagle3_hf.generation.target_cache import editable_cache
from eagle3_hf.generation.verify_choice import check_exact_verify, choose_verification
from eagle3_hf.modeling.modeling_eagle3 import Eagle3DraftModel
from eagle3_hf.modeling.target_fit import check_target, take_target_embedding
from eagle3_hf.utils.compat import generate_output_cache_field

# Per-call tree options, also read from a GenerationConfig (GenerationConfig(tree_depth=4) keeps unknown fields).
TREE_OPTIONS = (
    "tree_depth",
    "tree_top_k",
    "tree_total_tokens",
    "adaptive_tree",
    "exact_verify",
    "context_lookup",
    "lookup_depth",
    "lookup_branches",
    "lookup_confidence",
)
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
        accept_sources: per cycle, `(draft, context, corpus, several)`: how many of its accepted tree tokens (the
            bonus excluded) the draft alone proposed, the context lookup alone, the corpus alone, or several of them.
        accepted_from_draft, accepted_from_lookup, accepted_from_corpus, accepted_from_both: their totals.
        verification: "row-exact" or "one-call", the verification that ran; verification_reason: why (verify_choice.py).

    A batch of B > 1 prompts gives `accept_lengths`, `tree_sizes` and `accept_sources` per row (a list each), the
    batch's times and totals, and no cache; `scores` / `logits` are plain generate()'s, one `[B, V]` per step
    (emission.score_steps).
    """

    accept_lengths: list[int] | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    prefill_time: float | None = None
    tree_sizes: list[int] | None = None
    accept_sources: list[tuple[int, int, int, int]] | None = None
    accepted_from_draft: int | None = None
    accepted_from_lookup: int | None = None
    accepted_from_corpus: int | None = None
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
    occurrences continued per cycle) and `lookup_max_ngram`; `corpus`: a `CorpusIndex` or the path of one (`eagle3-hf
    corpus`), the target's earlier answers as a second source. Exact like EAGLE-3: greedy output is the target's own
    greedy output, sampling follows its distribution.
    """

    tree_depth: int = 8
    tree_total_tokens: int = 16
    lookup_branches: int = 4
    lookup_max_ngram: int = 4
    corpus: Any = None

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


def bind_target(draft: Eagle3DraftModel | ContextLookup, target: PreTrainedModel) -> Eagle3DraftModel | ContextLookup:
    """Make `target.generate(..., assistant_model=draft)` run EAGLE-3 tree decoding; returns `draft`.

    An `Eagle3DraftModel` is checked against `target` (`check_target`) and takes or compares its token embedding, as
    `from_pretrained(..., target=)` does; then `target.generate` is set, on that one instance, to a wrapper that runs
    tree decoding when `assistant_model` is an `Eagle3DraftModel` or a `ContextLookup` and stock generate() otherwise.
    """
    if isinstance(draft, ContextLookup):
        return draft.bind(target)
    if not isinstance(draft, Eagle3DraftModel):
        raise ValueError(
            f"bind_target expects an Eagle3DraftModel or a ContextLookup, got {type(draft).__name__}; a stock "
            "assistant model needs no binding (pass it to target.generate(assistant_model=...) as it is)."
        )
    check_target(draft.config, target)
    take_target_embedding(draft, target, "the draft")
    _route_generate(target)
    return draft


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
                "drafts a tree sized by tree_depth, tree_top_k and tree_total_tokens.",
                UserWarning,
                stacklevel=3,
            )


def _bound_generate(target: PreTrainedModel, *args: Any, assistant_model: Any = None, **kwargs: Any) -> Any:
    if not isinstance(assistant_model, (Eagle3DraftModel, ContextLookup)):
        return type(target).generate(target, *args, assistant_model=assistant_model, **kwargs)
    config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None)
    _tree_options_and_refusals(target, config, kwargs)
    # generate() hands a custom_generate callable neither the streamer nor the tokenizer (it rebuilds those
    # kwargs from the callable's signature): pass the streamer under our own name, and build the stop-string
    # criterion here, since generate() would otherwise fail to find a tokenizer for it.
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
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
        target,
        *args,
        custom_generate=eagle3_decoding,
        eagle3_draft=assistant_model,
        eagle3_streamer=kwargs.get("streamer"),
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------
# the decoding call


def eagle3_decoding(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    eagle3_draft: Eagle3DraftModel | ContextLookup | None = None,
    eagle3_streamer: Any = None,
    eagle3_observer: Callable[[CycleRecord], None] | None = None,
    tree_depth: int | None = None,
    tree_top_k: int | None = None,
    tree_total_tokens: int | None = None,
    adaptive_tree: bool = True,
    exact_verify: bool | str = "auto",
    context_lookup: bool | None = None,
    lookup_depth: int | None = None,
    lookup_branches: int | None = None,
    lookup_confidence: float | None = None,
    corpus: Any = None,
    corpus_growth: int | None = None,
    **model_kwargs: Any,
) -> torch.LongTensor | Eagle3GenerateOutput:
    """`custom_generate` callable running EAGLE-3 tree decoding (see the module docstring), for one prompt or a
    left-padded batch.

    Per-call options (defaults from the draft config): `tree_depth`, `tree_top_k`, `tree_total_tokens`;
    `adaptive_tree=False` always drafts the full tree instead of sizing it with the cost model.
    `exact_verify="auto"` (default) verifies each tree node with the attention call shape of the target's own
    decoding step (exact_attention.py) where the row-invariance probe proves that reproduces one-token steps bit for
    bit on this hardware, and the whole tree in one tree-masked call elsewhere (verify_choice.py); True / False force
    one or the other (a batch verifies in one call). The output's `verification` says which ran.

    Context lookup (hybrid.py): `context_lookup` (default: on) grafts the continuations of each row's current
    suffix's earlier occurrences into the draft's tree each cycle (always on with a `ContextLookup` assistant, which
    has no draft); `lookup_depth` tokens per continuation (default: the tree depth), `lookup_branches` continuations
    (default 4), and the draft's forward is skipped in a cycle where every row's best next lookup token has an
    estimated acceptance of at least `lookup_confidence` (default 0.8; 1.0 or more: never). `corpus` (corpus_source.py):
    a `CorpusIndex` or its file, False for none; default: the assistant's own (`ContextLookup.corpus`, or the
    corpus.safetensors beside a draft); `corpus_growth=N` also indexes this process's earlier outputs (N tokens).

    `eagle3_observer`: a callable handed a `cycle.CycleRecord` after every cycle (research scripts); nothing is
    timed for it that the cost model does not measure anyway.
    """
    if isinstance(eagle3_draft, ContextLookup):
        draft, context_lookup = None, True
        defaults = dict(
            depth=eagle3_draft.tree_depth,
            top_k=eagle3_draft.lookup_branches,
            total=eagle3_draft.tree_total_tokens,
            max_ngram=eagle3_draft.lookup_max_ngram,
        )
        lookup_branches = eagle3_draft.lookup_branches if lookup_branches is None else lookup_branches
    elif isinstance(eagle3_draft, Eagle3DraftModel):
        draft = eagle3_draft
        draft.config.check_target_config(model.config)  # the one draft-fits-target check of a generate() call
        defaults = dict(
            depth=draft.config.tree_depth,
            top_k=draft.config.tree_top_k,
            total=draft.config.tree_total_tokens,
            max_ngram=LookupOptions.max_ngram,
        )
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
    exact_verify = check_exact_verify(exact_verify)
    rows, length = input_ids.shape
    return_dict = bool(generation_config.return_dict_in_generate)
    if rows > 1 and exact_verify is True:
        raise ValueError(
            f"Row-exact verification (exact_verify=True) supports batch size 1; got a batch of {rows}. Batches verify "
            "in one tree-masked call (exact_verify='auto' or False): greedy bf16 output then equals plain "
            "decoding up to near-ties."
        )
    mask = left_padded_mask(input_ids, model_kwargs.get("attention_mask"))
    cache = editable_cache(model_kwargs.get("cache", model_kwargs.get("past_key_values")))
    options = LookupOptions(
        depth=budget.depth if lookup_depth is None else lookup_depth,
        branches=LookupOptions.branches if lookup_branches is None else lookup_branches,
        max_ngram=defaults["max_ngram"],
        confidence=LookupOptions.confidence if lookup_confidence is None else lookup_confidence,
    )
    text = model.config.get_text_config()
    source = open_corpus(
        getattr(eagle3_draft, "corpus", None) if corpus is None else corpus,
        text.vocab_size,
        options.depth,
        corpus_growth,
    )
    proposer = build_proposer(draft, options, context_lookup is None or bool(context_lookup), source)
    # the output buffer, padding and stopping as plain generate() has them
    has_eos = any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
    pad = generation_config._pad_token_tensor
    if rows > 1 and has_eos and pad is None:
        raise ValueError("With eos_token_id set, batched generation needs a pad_token_id to pad finished rows.")
    max_length = stopping_criteria.max_length or generation_config.max_length
    out = torch.zeros(rows, max(max_length, length + 1), dtype=input_ids.dtype, device=input_ids.device)
    out[:, :length] = input_ids
    do_sample = bool(generation_config.do_sample)
    emission = Emission(
        out=out,
        lengths=[length] * rows,
        tokens=input_ids.tolist(),
        starts=[int((m == 0).sum()) for m in mask],
        stopping_criteria=stopping_criteria,
        pad_token_id=None if pad is None else int(pad),
        pad_finished=rows > 1 and has_eos,
        max_length=max_length,
        streamer=eagle3_streamer,
        output_scores=return_dict and bool(generation_config.output_scores),
        output_logits=return_dict and bool(generation_config.output_logits),
    )
    run = DecodeRun(
        model=model,
        proposer=proposer,
        logits_processor=logits_processor,
        budget=budget,
        cache=cache,
        layer_ids=draft.config.resolved_target_layer_ids(text.num_hidden_layers) if draft else [],
        emission=emission,
        do_sample=do_sample,
        temperature=float(generation_config.temperature or 1.0) if do_sample else 1.0,
        adaptive_tree=adaptive_tree,
        observer=eagle3_observer,
        cost=CycleCostModel.for_device(model.device.type, model.dtype),
    )
    choice = choose_verification(model, exact_verify, rows=rows)
    with exact_verification(model, enabled=choice.exact) as run.exact:
        decode(run, input_ids, mask)
    proposer.finish(emission.new_tokens())
    output = sequences(run)
    scores, logits = score_steps(run) if return_dict else (None, None)
    if rows == 1:  # the cache holds every output token but the last, as plain decoding's
        run.columns.crop(run.cache, output.shape[1] - min(emission.starts) - 1)
    if not return_dict:
        return output
    per_row = (lambda values: values[0]) if rows == 1 else (lambda values: values)
    stats = run.stats
    sources = [counts for row in stats.accept_sources for counts in row]
    return Eagle3GenerateOutput(
        sequences=output,
        scores=scores,
        logits=logits,
        accept_lengths=per_row(stats.accept_lengths),
        draft_time=stats.draft_time,
        verify_time=stats.verify_time,
        prefill_time=stats.prefill_time,
        tree_sizes=per_row(stats.tree_sizes),
        accept_sources=per_row(stats.accept_sources),
        **source_totals(sources),
        verification=choice.mode,
        verification_reason=choice.reason,
        # a batch's finished rows leave the cache, which then no longer matches the output's rows
        **({generate_output_cache_field(): run.cache} if rows == 1 else {}),
    )


def left_padded_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The attention mask `[B, L]`, checked to be left padding only (zeros, then ones): left padding carries no
    information, so the target and the proposers never see it, while logits processors and stopping criteria see
    the whole sequence, as in plain generate()."""
    if attention_mask is None:
        return torch.ones_like(input_ids)
    attention_mask = attention_mask.to(input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}.")
    valid = attention_mask.bool()
    bad = ~valid[:, -1] | (valid[:, 1:].long() - valid[:, :-1].long() < 0).any(dim=1)  # [B]: a one before a zero
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(
            f"EAGLE-3 decoding accepts left padding only (each row's mask: zeros, then ones, ending in a one); row "
            f"{row}'s attention_mask is {attention_mask[row].tolist()}. Tokenise with padding_side='left'. Without an "
            "explicit attention_mask, generate() masks every prompt token equal to pad_token_id: pass "
            "attention_mask=torch.ones_like(input_ids)."
        )
    return attention_mask
