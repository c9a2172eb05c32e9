"""`eagle3-hf bench`: plain, prompt-lookup and EAGLE-3 decoding side by side (`eagle3_hf.benchmark`)."""

from __future__ import annotations

import json
import os
from typing import Any

# The choices of --methods; `eagle3_hf.benchmark.METHODS` (checked in the tests), spelt out so --help stays light.
METHODS = ("plain", "prompt_lookup", "eagle3_chain", "eagle3_tree")


def add_cli_arguments(parser: Any) -> None:
    parser.add_argument("--target", default="smollm2", help='target model folder, .gguf file, or "smollm2"')
    parser.add_argument("--draft", default=None, help="draft folder (default: the draft shipped for the target)")
    parser.add_argument("--prompts", default=None, help="MT-bench question.jsonl, or JSONL with prompt/messages")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steady on a busy machine)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {', '.join(METHODS)}")
    parser.add_argument("--tree-depth", type=int, default=None)
    parser.add_argument("--tree-top-k", type=int, default=None)
    parser.add_argument("--tree-total-tokens", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="write a PNG chart of acceptance by depth here (needs [plot])")
    parser.add_argument(
        "--model-card", action="store_true",
        help="rewrite the --draft folder's README.md (its model card) with the measurements",
    )  # fmt: skip
    parser.add_argument("--overwrite-output-dir", action="store_true",
                        help="replace an existing --json or --plot file")  # fmt: skip


def _check_options(args: Any) -> tuple[str, ...]:
    """Everything that can be checked before a model is loaded; returns the methods."""
    from eagle3_hf.outputs import check_output_file

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--methods {args.methods!r}: unknown method(s) {unknown}; choose from {', '.join(METHODS)}.")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}.")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens),
                        ("--threads", args.threads)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}.")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise ValueError("--plot needs matplotlib: pip install 'eagle3-hf[plot]' (or matplotlib).") from err
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            check_output_file(path, args.overwrite_output_dir, flag)
    if args.model_card and (not args.draft or args.draft == "random"):
        raise ValueError("--model-card needs --draft FOLDER (the draft whose card to rewrite).")
    if args.model_card and not os.path.isfile(os.path.join(args.draft, "config.json")):
        raise ValueError(f"--draft {args.draft!r} holds no config.json: expected a draft folder.")
    return methods


def run_cli(args: Any) -> int:
    methods = _check_options(args)
    import torch

    from eagle3_hf.benchmark import environment, format_table, plot_acceptance, read_prompts, run_benchmark
    from eagle3_hf.hub import default_prompts_path, load_draft_for
    from eagle3_hf.model_card import write_bench_card
    from eagle3_hf.outputs import staged_file
    from eagle3_hf.targets import check_device, load_target, load_tokenizer

    check_device(args.device)
    prompts_path = args.prompts or default_prompts_path()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype, device=args.device)
    tokenizer = load_tokenizer(args.target)
    draft = load_draft_for(args.target, target, args.draft)
    prompts = read_prompts(prompts_path, tokenizer, args.num_prompts)
    tree_kwargs = {
        k: v
        for k, v in {
            "tree_depth": args.tree_depth, "tree_top_k": args.tree_top_k, "tree_total_tokens": args.tree_total_tokens
        }.items()
        if v is not None
    }
    report = run_benchmark(target, draft, prompts, args.max_new_tokens, args.temperature, tree_kwargs, methods)
    report["config"] = {
        "target": args.target, "draft": args.draft or "(shipped)", "dtype": args.dtype, "device": args.device,
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        **tree_kwargs,
    }
    report["environment"] = environment()
    print(format_table(report))
    if args.json:
        with staged_file(args.json) as temporary, open(temporary, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot and "acceptance_by_depth" in report:
        with staged_file(args.plot) as temporary:
            plot_acceptance(report, temporary, fmt="png")
    if args.model_card:
        shown = ("target", "draft", "num_prompts", "max_new_tokens", "dtype")
        command = "eagle3-hf bench " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in report["config"].items() if k in shown
        )
        print(f"Model card written to {write_bench_card(args.draft, report, bench_command=command)}")
    return 0
