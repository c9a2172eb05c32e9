"""`eagle3-hf generate`: prompts through `target.generate(..., assistant_model=draft)`, against plain decoding.

Without `--prompt` it runs the built-in prompts: the first thing a newcomer runs, so it shows what the method is for,
and its numbers must not depend on luck. One run of each method is one sample of a machine that other jobs may share
(the same prompt once printed 0.17x, then 2.67x), so the answer is streamed once (which also warms both methods up)
and the speed is then measured over several short repeats, plain and EAGLE-3 in turn, as medians with their spread;
a spread above `SPREAD_WARNING` is said to make the numbers unreliable. Threads that share a core with another job
wait for it at every step (2 threads with one core busy ran ten times slower than 1), so it times on the cores that
are free, and not at all when none is (`eagle3_hf.utils.cpu_load`). It says what it loads before torch is
imported, so the terminal is never silent for the seconds that takes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from eagle3_hf.commands import add_thinking_argument
from eagle3_hf.commands.options import add_exact_verify_argument, add_precision_arguments, add_target_argument
from eagle3_hf.draft_names import LOOKUP_DRAFT, RANDOM_DRAFT, check_draft_option
from eagle3_hf.modeling.shipped import shipped_draft_name
from eagle3_hf.utils.cpu_load import pick_threads

# Answers a draft predicts well, a list and a piece of code, whose next token mostly follows from what came before:
# with the shipped SmolLM2 draft nearly every cycle drafts on these. Open-ended prose (the former default asked why
# the sky is blue) gets few drafts accepted, so the cost model decodes it almost plainly, which shows nothing of the
# method. (Asked for the months without the number of days, SmolLM2 answers in one sentence of prose instead.)
BUILT_IN_PROMPTS = (
    "List the twelve months of the year, one per line, each with its number of days.",
    "Write a Python function that returns the first n Fibonacci numbers, then call it for n = 10.",
)
# `spread` of a method's timed repeats above which the machine was too busy for the numbers to hold.
SPREAD_WARNING = 0.20


def add_cli_arguments(parser: Any) -> None:
    add_target_argument(parser)
    parser.add_argument(
        "--draft",
        default=None,
        help="draft: a folder, a shipped draft's name or a Hub id (default: the draft shipped for the "
        'target); "random": untrained; "lookup": no draft, the context lookup\'s tree alone '
        "(model-free)",
    )
    parser.add_argument(
        "--context-lookup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="graft the context lookup's continuations into the draft's tree (the hybrid tree, the "
        "default); --no-context-lookup: the draft's tree alone",
    )
    parser.add_argument(
        "--corpus",
        default=None,
        metavar="FILE",
        help="corpus index (`eagle3-hf corpus`) of the target's earlier answers, one more lookup "
        "source (default: the draft's own corpus.safetensors, if its folder has one)",
    )
    parser.add_argument("--no-corpus", action="store_true", help="no corpus, not even the draft's own")
    parser.add_argument("--prompt", default=None, help="the prompt (default: the built-in ones, a list and code)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="most new tokens of the streamed answer (an answer cut there is said to be)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats of each method, taken in turn after the streamed answer"
    )
    parser.add_argument(
        "--repeat-tokens", type=int, default=32, help="new tokens per timed repeat (at most --max-new-tokens)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    add_precision_arguments(
        parser,
        threads="torch threads; N forces N threads and the timing, busy cores or not (default: one per core that "
        "other jobs leave free, and no timing when none is)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps, ...")
    parser.add_argument("--no-compare", action="store_true", help="skip plain decoding (no speedup, no comparison)")
    add_thinking_argument(parser)
    add_exact_verify_argument(parser)


def _check_options(args: Any) -> None:
    """What can be checked before torch is imported, so that a typo is answered at once."""
    from eagle3_hf.target_names import hub_target_kwargs, resolve_target

    # before the draft: an unknown target is that, not a target without a shipped draft; a Hub id that cannot be
    # fetched (offline) nor found in the cache is refused now rather than after a minute of retries
    hub_target_kwargs(*resolve_target(args.target))
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty: pass the text to ask, or leave --prompt out for the built-in prompts.")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}.")
    for name in ("max_new_tokens", "repeats", "repeat_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")
    check_draft_option(args.target, args.draft)
    if args.corpus is not None and args.no_corpus:
        raise ValueError("--corpus FILE and --no-corpus contradict each other: pass one.")
    if args.corpus is not None and not os.path.isfile(args.corpus):
        raise ValueError(f"--corpus {args.corpus!r}: no such file (expected a corpus index of `eagle3-hf corpus`).")


def _loading_line(args: Any) -> str:
    from eagle3_hf.target_names import describe_target

    if args.draft is None:
        draft = f"its shipped draft {shipped_draft_name(args.target)}"
    else:
        draft = {RANDOM_DRAFT: "an untrained draft", LOOKUP_DRAFT: "no draft (the context lookup alone)"}.get(
            args.draft, f"the draft {args.draft}"
        )
    return f"Loading {describe_target(args.target)} and {draft} ..."


def choose_threads(forced: int | None, cores: int, busy: float | None) -> tuple[int, str | None, bool]:
    """``(threads, what to say about them, whether to time)`` for a run on `cores` cores of which other jobs keep
    `busy` in use (None: unknown). Without `--threads` (`forced` None) it takes the free cores (`pick_threads`), and
    when none is free it still answers on one thread but does not time; `--threads N` is taken as given, with a
    warning when it asks for more cores than are free."""
    free = pick_threads(cores, busy)
    load = "" if busy is None else f"other jobs keep {busy:.1f} of the {cores} cores busy"
    if forced is not None:
        if busy is None or forced <= free:
            return forced, None, True
        return (
            forced,
            f"warning: {load}, so {forced} thread(s) wait for them at every step: the timings below are slower and "
            "vary more than on an idle machine; rerun when it is idle, or leave --threads out to take the free cores.",
            True,
        )
    if free == 0:
        return (
            1,
            f"not timing: {load}, none free, so a timing would measure them rather than decoding; the answers below "
            "run on 1 thread. Rerun when a core is free, or force the timing with --threads N.",
            False,
        )
    if free < cores:
        return free, f"{load}: timing on the {free} free one(s) (--threads N forces N threads).", True
    return free, None, True


def cap_new_tokens(requested: int, prompt_length: int, max_positions: int | None) -> tuple[int, str | None]:
    """`--max-new-tokens`, capped at the positions the target's context leaves after the prompt (with the line that
    says so), or a `ValueError` when the prompt alone fills it; `max_positions` None: no known limit."""
    if max_positions is None or prompt_length + requested <= max_positions:
        return requested, None
    room = max_positions - prompt_length
    if room < 1:
        raise ValueError(
            f"The prompt is {prompt_length} tokens, and the target's context holds {max_positions}: no room to answer."
        )
    return room, (
        f"--max-new-tokens {requested} is more than the target's {max_positions} positions leave after this "
        f"{prompt_length}-token prompt: capped at {room}."
    )


def run_cli(args: Any) -> int:
    from eagle3_hf.utils.cpu_load import busy_cores, core_loads, cpu_quota, freest_cpus, usable_cpus

    _check_options(args)
    print(_loading_line(args), flush=True)  # before torch: importing it alone takes seconds
    cpus = usable_cpus()
    cores = min(len(cpus), cpu_quota() or len(cpus))
    # sampled while this process sleeps, before it loads anything: only the other jobs' work is counted; on an
    # accelerator the CPU's load matters less, and under a quota the host's load says little about this container
    sample = args.device == "cpu" and cores == len(cpus)
    loads = core_loads(cpus) if sample else None
    threads, note, timed = choose_threads(args.threads, cores, busy_cores(cpus, loads=loads) if sample else None)
    if loads and args.threads is None and 0 < threads < len(loads) and hasattr(os, "sched_setaffinity"):
        # on the free cores only: the scheduler would otherwise move the threads onto the busy ones now and then,
        # and each such move shows up as a slow repeat
        os.sched_setaffinity(0, freest_cpus(loads, threads))
    if note:
        print(note, file=sys.stderr if note.startswith("warning") else sys.stdout, flush=True)
    import torch

    from eagle3_hf.draft_names import load_draft_for
    from eagle3_hf.modeling.chat_template import apply_chat_template
    from eagle3_hf.modeling.packed_linear import prepack_linears
    from eagle3_hf.targets import check_device, load_target, load_tokenizer
    from eagle3_hf.utils.precision import resolve_dtype, short_name

    check_device(args.device)
    torch.set_num_threads(threads)
    dtype = resolve_dtype(args.dtype, args.device)
    target = load_target(args.target, dtype=dtype, device=args.device)
    tokenizer = load_tokenizer(args.target)
    draft = load_draft_for(args.target, target, args.draft)
    if not args.no_prepack:
        prepack_linears(target)
        if isinstance(draft, torch.nn.Module):  # a ContextLookup has no weights
            prepack_linears(draft)
    kwargs: dict[str, Any] = {}
    if args.temperature > 0:
        kwargs.update(do_sample=True, temperature=args.temperature, top_k=0)
    else:
        kwargs.update(do_sample=False)
    setup = f"{short_name(dtype)}, {torch.get_num_threads()} thread(s)"
    prompts = [args.prompt] if args.prompt is not None else list(BUILT_IN_PROMPTS)
    for i, prompt in enumerate(prompts):
        if args.prompt is None:  # say which built-in prompt the answer below is for
            if i:
                print()
            print(f">>> {prompt}")
        ids = apply_chat_template(
            tokenizer,
            [{"role": "user", "content": prompt}],
            enable_thinking=args.enable_thinking,
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"].to(target.device)
        limit = getattr(target.config, "max_position_embeddings", None)
        max_new_tokens, capped = cap_new_tokens(args.max_new_tokens, ids.shape[1], limit)
        if capped:
            print(capped, flush=True)
        call = dict(kwargs, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens)
        _run_prompt(target, draft, tokenizer, ids, call, args, dtype, setup if timed else None)
    return 0


def _run_prompt(
    target: Any, draft: Any, tokenizer: Any, ids: Any, kwargs: dict[str, Any], args: Any, dtype: Any, setup: str | None
) -> None:
    """Stream EAGLE-3's answer and say what it did (tau, drafted share, against plain), then time both methods
    (`setup`: the precision and threads the timing line names; None: no timing, no core being free)."""
    from transformers import TextStreamer

    from eagle3_hf.commands.options import exact_verify_setting

    eagle_kwargs = dict(kwargs, exact_verify=exact_verify_setting(args), context_lookup=args.context_lookup)
    if args.corpus is not None or args.no_corpus:  # else the draft's own corpus file, if it has one
        eagle_kwargs["corpus"] = False if args.no_corpus else args.corpus
    method = "lookup tree" if args.draft == LOOKUP_DRAFT else "EAGLE-3"  # with the context lookup (default) or without
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # prints as tokens are accepted
    out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, streamer=streamer, **eagle_kwargs)
    new = out.sequences[0, ids.shape[1] :]
    limit = kwargs["max_new_tokens"]
    if was_cut(new, target.generation_config.eos_token_id, limit):
        print(f"[cut at the {limit}-token limit; --max-new-tokens N lets the answer run longer]")
    cycles = len(out.accept_lengths)
    drafted = [a for a, n in zip(out.accept_lengths, out.tree_sizes) if n > 1]
    tau = sum(drafted) / len(drafted) if drafted else 0.0
    print(
        f"\n{method}: {new.numel()} tokens; tau {tau:.2f} over the {len(drafted)} of {cycles} cycles that drafted "
        f"({len(drafted) / max(cycles, 1):.0%})"
    )
    print(f"verification: {out.verification} ({out.verification_reason})")
    if out.accepted_from_lookup or out.accepted_from_corpus or out.accepted_from_both:
        print(
            f"accepted tokens from the draft {out.accepted_from_draft}, the context lookup "
            f"{out.accepted_from_lookup}, the corpus {out.accepted_from_corpus}, several {out.accepted_from_both}"
        )
    if not args.no_compare:  # plain's whole answer, to compare; its first call is also plain's warm-up
        plain_new = type(target).generate(target, ids, **kwargs)[0, ids.shape[1] :]
        agreement = _agreement(plain_new, new, args, dtype, out.verification_reason)
        print(f"plain:   {plain_new.numel()} tokens, {agreement}")
    if setup is None:
        return
    n = min(args.repeat_tokens, limit)
    calls = {method: lambda: target.generate(ids, assistant_model=draft, **dict(eagle_kwargs, max_new_tokens=n))}
    if not args.no_compare:  # type(target).generate: the model's own, which bind() does not route to EAGLE-3
        calls["plain"] = lambda: type(target).generate(target, ids, **dict(kwargs, max_new_tokens=n))
    print(
        f"timed ({setup}): {args.repeats} repeat(s) of {n} new tokens, the methods in turn; median, and spread = "
        f"{'interquartile range' if args.repeats >= 4 else '(max - min)'} / median"
    )
    _report_rates(time_in_turn(calls, args.repeats, ids.shape[1]), method)


def _report_rates(rates: dict[str, list[float]], method: str) -> None:
    """Each method's median tokens/s and spread, the speedup (the ratio of the two medians printed above it, so
    that the numbers on the screen agree; its spread is that of the repeats' own ratios), and a warning when a
    spread says the machine was busy."""
    spreads = {name: spread(values) for name, values in rates.items()}
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name in rates:
        print(f"  {name:<8} {medians[name]:6.1f} tok/s  (spread {spreads[name]:.0%})")
    if "plain" in rates:
        spreads["speedup"] = spread([e / p for e, p in zip(rates[method], rates["plain"])])
        print(
            f"  speedup  {medians[method] / medians['plain']:6.2f}x      (the ratio of the medians; the repeats' "
            f"ratios spread {spreads['speedup']:.0%})"
        )
    noisy = {name: s for name, s in spreads.items() if s > SPREAD_WARNING}
    if noisy:
        print(
            f"warning: the timed repeats spread by {', '.join(f'{s:.0%} ({m})' for m, s in noisy.items())}, more "
            f"than {SPREAD_WARNING:.0%}: something else was using the CPU; rerun when it is idle, or with more "
            "--repeats.",
            file=sys.stderr,
            flush=True,
        )


def was_cut(new_tokens: Any, eos_token_id: int | list[int] | None, max_new_tokens: int) -> bool:
    """Whether an answer stopped at the token limit rather than at an end-of-sequence token."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
    return new_tokens.numel() >= max_new_tokens and int(new_tokens[-1]) not in eos


def spread(values: list[float]) -> float:
    """How far apart the repeats of one measurement fell, relative to their median: the middle half's range (the
    interquartile range) from 4 repeats on, so that one repeat that another job's burst slowed moves the spread no
    more than it moves the median; (max - min) below that (0 for a single repeat)."""
    middle = statistics.median(values)
    if middle <= 0:
        return 0.0
    if len(values) < 4:
        return (max(values) - min(values)) / middle
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return (high - low) / middle


def time_in_turn(calls: dict[str, Callable[[], Any]], repeats: int, prompt_length: int) -> dict[str, list[float]]:
    """New tokens per second of each call, over `repeats` rounds that run every call once, in turn.

    Taking the methods in turn, rather than all repeats of one and then the other, spreads a change in the
    machine's load over both; the first call runs first in even rounds and last in odd ones, so that neither always
    follows the other. Each call returns token ids of shape [1, prompt_length + new] (or an output holding them).
    """
    import torch

    rates: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(repeats):
        for name in list(calls) if round_index % 2 == 0 else list(calls)[::-1]:
            start = time.perf_counter()
            out = calls[name]()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the kernels of the call, not only their launches
            seconds = time.perf_counter() - start
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            rates[name].append((sequences.shape[1] - prompt_length) / seconds)
    return rates


def _agreement(plain_new: Any, new: Any, args: Any, dtype: Any, verification_reason: str) -> str:
    """Whether EAGLE-3's answer is plain decoding's, and if not, whether that is expected."""
    import torch

    from eagle3_hf.generation.verify_choice import PROVEN
    from eagle3_hf.utils.precision import short_name

    if torch.equal(plain_new, new):
        return "identical output"
    where = f"outputs differ from token {_first_difference(plain_new, new)}"
    if args.temperature > 0:
        return "outputs differ (sampling)"
    if dtype == torch.float32:
        return f"{where}: unexpected for greedy fp32"
    if verification_reason.startswith(PROVEN):
        return (
            f"{where}: unexpected with row-exact verification that the row-invariance probe proved bit for bit on "
            "this CPU"
        )
    # one tree-masked verify call rounds differently from a one-token step, so a near-tie can flip
    return f"{where} ({short_name(dtype)} rounding; `eagle3-hf bench` reports the fp32 margin at such a point)"


def _first_difference(a: Any, b: Any) -> int:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n
