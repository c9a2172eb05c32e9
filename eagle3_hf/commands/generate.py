"""`eagle3-hf generate`: one prompt through `target.generate(..., assistant_model=draft)`, against plain decoding."""

from __future__ import annotations

import time
from typing import Any


def add_cli_arguments(parser: Any) -> None:
    parser.add_argument("--target", default="smollm2", help='target model folder, .gguf file, or "smollm2"')
    parser.add_argument("--draft", default=None, help='draft folder; default: the shipped draft; "random": untrained')
    parser.add_argument("--prompt", default="Explain in three sentences why the sky is blue.")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compare", action="store_true", help="skip the plain-generate run and speedup")


def _check_options(args: Any) -> None:
    """What can be checked before anything is loaded."""
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}.")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}.")


def run_cli(args: Any) -> int:
    _check_options(args)
    import torch

    from eagle3_hf.hub import load_draft_for
    from eagle3_hf.targets import check_device, load_target, load_tokenizer, resolve_target

    check_device(args.device)
    resolve_target(args.target)  # a bad name or path fails here, at once
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    tokenizer = load_tokenizer(args.target)
    draft = load_draft_for(args.target, target, args.draft)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"].to(target.device)
    kwargs: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "attention_mask": torch.ones_like(ids)}
    if args.temperature > 0:
        kwargs.update(do_sample=True, temperature=args.temperature, top_k=0)
    else:
        kwargs.update(do_sample=False)
    target.generate(ids, assistant_model=draft, **dict(kwargs, max_new_tokens=8))  # warm-up
    start = time.perf_counter()
    out = target.generate(ids, assistant_model=draft, return_dict_in_generate=True, **kwargs)
    eagle_s = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1] :]
    print(tokenizer.decode(new, skip_special_tokens=True))
    tau = sum(out.accept_lengths) / max(len(out.accept_lengths), 1)
    print(f"\nEAGLE-3: {new.numel()} tokens in {eagle_s:.2f} s ({new.numel() / eagle_s:.1f} tok/s), tau {tau:.2f}")
    if not args.no_compare:
        start = time.perf_counter()
        plain = type(target).generate(target, ids, **kwargs)
        plain_s = time.perf_counter() - start
        plain_new = plain[0, ids.shape[1] :]
        print(f"plain:   {plain_new.numel()} tokens in {plain_s:.2f} s ({plain_new.numel() / plain_s:.1f} tok/s)")
        print(f"speedup: {(new.numel() / eagle_s) / (plain_new.numel() / plain_s):.2f}x", end="")
        print(", identical output" if torch.equal(plain_new, new) else ", outputs differ (sampling)")
    return 0
