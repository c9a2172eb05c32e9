"""`eagle3-hf generate`: prompts through `target.generate(..., assistant_model=draft)`, against plain decoding.

Without `--prompt` it runs the built-in prompts: the first thing a newcomer runs, so it shows what the method is for.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from eagle3_hf.precision import add_exact_verify_argument, add_precision_arguments

# Answers a draft predicts well, a list and a piece of code, whose next token mostly follows from what came before:
# with the shipped SmolLM2 draft nearly every cycle drafts on these. Open-ended prose (the former default asked why
# the sky is blue) gets few drafts accepted, so the cost model decodes it almost plainly, which shows nothing of the
# method. (Asked for the months without the number of days, SmolLM2 answers in one sentence of prose instead.)
BUILT_IN_PROMPTS = (
    "List the twelve months of the year, one per line, each with its number of days.",
    "Write a Python function that returns the first n Fibonacci numbers, then call it for n = 10.",
)


def add_cli_arguments(parser: Any) -> None:
    parser.add_argument("--target", default="smollm2", help='target model folder, .gguf file, or "smollm2"')
    parser.add_argument("--draft", default=None,
                        help='draft folder; default: the shipped draft; "random": untrained; "lookup": no draft, the '
                             "context lookup's tree alone (model-free)")  # fmt: skip
    parser.add_argument("--context-lookup", action=argparse.BooleanOptionalAction, default=True,
                        help="graft the context lookup's continuations into the draft's tree (the hybrid tree, the "
                             "default); --no-context-lookup: the draft's tree alone")  # fmt: skip
    parser.add_argument("--prompt", default=None, help="the prompt (default: the built-in ones, a list and code)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    add_precision_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-compare", action="store_true", help="skip the plain-generate run and speedup")
    add_exact_verify_argument(parser)


def _check_options(args: Any) -> None:
    """What can be checked before anything is loaded."""
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}.")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}.")


def run_cli(args: Any) -> int:
    _check_options(args)
    import torch

    from eagle3_hf.hub import load_draft_for
    from eagle3_hf.modeling.packed_linear import prepack_linears
    from eagle3_hf.precision import default_threads, resolve_dtype, short_name
    from eagle3_hf.targets import check_device, load_target, load_tokenizer, resolve_target

    check_device(args.device)
    resolve_target(args.target)  # a bad name or path fails here, at once
    torch.set_num_threads(args.threads or default_threads())
    dtype = resolve_dtype(args.dtype, args.device)
    target = load_target(args.target, dtype=dtype, device=args.device)
    tokenizer = load_tokenizer(args.target)
    draft = load_draft_for(args.target, target, args.draft)
    if not args.no_prepack:
        prepack_linears(target)
        if isinstance(draft, torch.nn.Module):  # a ContextLookup has no weights
            prepack_linears(draft)
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
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
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(target.device)
        _run_prompt(target, draft, tokenizer, ids, dict(kwargs, attention_mask=torch.ones_like(ids)), args, dtype,
                    setup, warm_up=i == 0)  # fmt: skip
    return 0


def _run_prompt(target: Any, draft: Any, tokenizer: Any, ids: Any, kwargs: dict[str, Any], args: Any, dtype: Any,
                setup: str, warm_up: bool) -> None:  # fmt: skip
    """Stream EAGLE-3's answer, then print what was measured: tokens/s, tau, drafted share, and against plain."""
    import torch
    from transformers import TextStreamer

    from eagle3_hf.generation.verify_choice import PROVEN
    from eagle3_hf.precision import exact_verify_setting, short_name

    eagle_kwargs = dict(kwargs, exact_verify=exact_verify_setting(args))
    eagle_kwargs["context_lookup"] = args.context_lookup
    method = "lookup tree" if args.draft == "lookup" else "EAGLE-3"  # with the context lookup (default) or without
    if warm_up:  # the first call of each method pays one-off costs (allocations, kernel selection)
        target.generate(ids, assistant_model=draft, **dict(eagle_kwargs, max_new_tokens=8))
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)  # prints as tokens are accepted
    start = time.perf_counter()
    out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, streamer=streamer, **eagle_kwargs)
    eagle_s = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1] :]
    cycles = len(out.accept_lengths)
    drafted = [a for a, n in zip(out.accept_lengths, out.tree_sizes) if n > 1]
    tau = sum(drafted) / len(drafted) if drafted else 0.0
    print(
        f"\n{method} ({setup}): {new.numel()} tokens in {eagle_s:.2f} s ({new.numel() / eagle_s:.1f} tok/s); "
        f"tau {tau:.2f} over the {len(drafted)} of {cycles} cycles that drafted ({len(drafted) / max(cycles, 1):.0%})"
    )
    print(f"verification: {out.verification} ({out.verification_reason})")
    if out.accepted_from_lookup or out.accepted_from_both:
        print(f"accepted tokens from the draft {out.accepted_from_draft}, the context lookup "
              f"{out.accepted_from_lookup}, both {out.accepted_from_both}")  # fmt: skip
    if args.no_compare:
        return
    if warm_up:
        type(target).generate(target, ids, **dict(kwargs, max_new_tokens=8))
    start = time.perf_counter()
    plain = type(target).generate(target, ids, **kwargs)
    plain_s = time.perf_counter() - start
    plain_new = plain[0, ids.shape[1] :]
    print(f"plain   ({setup}): {plain_new.numel()} tokens in {plain_s:.2f} s ({plain_new.numel() / plain_s:.1f} tok/s)")
    print(f"speedup: {(new.numel() / eagle_s) / (plain_new.numel() / plain_s):.2f}x", end="")
    if torch.equal(plain_new, new):
        print(", identical output")
    elif args.temperature > 0:
        print(", outputs differ (sampling)")
    elif dtype == torch.float32:
        print(f", outputs differ from token {_first_difference(plain_new, new)}: unexpected for greedy fp32")
    elif out.verification_reason.startswith(PROVEN):
        print(
            f", outputs differ from token {_first_difference(plain_new, new)}: unexpected with row-exact verification "
            "that the row-invariance probe proved bit for bit on this CPU"
        )
    else:  # one tree-masked verify call rounds differently from a one-token step, so a near-tie can flip
        print(
            f", outputs differ from token {_first_difference(plain_new, new)} ({short_name(dtype)} rounding; "
            "`eagle3-hf bench` reports the fp32 margin at such a point)"
        )


def _first_difference(a: Any, b: Any) -> int:
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n
