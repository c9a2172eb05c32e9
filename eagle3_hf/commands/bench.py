"""`eagle3-hf bench`: EAGLE-3 against the fastest plain configuration (`eagle3_hf.bench.runner`)."""

from __future__ import annotations

import json
import os
from typing import Any

from eagle3_hf.commands import add_thinking_argument
from eagle3_hf.commands.options import (
    add_exact_verify_argument,
    add_precision_arguments,
    add_target_argument,
    exact_verify_setting,
)

# The choices of --methods; `eagle3_hf.bench.runner.METHODS` (checked in the tests), spelt out so --help stays light.
METHODS = (
    "plain",
    "prompt_lookup",
    "prompt_lookup_sweep",
    "eagle3_chain",
    "eagle3_tree",
    "hybrid_tree",
    "lookup_tree",
    "corpus_tree",
)
DEFAULT_METHODS = ("plain", "eagle3_chain", "eagle3_tree")
# `--methods all`: every configuration, prompt lookup at each of its settings; corpus_tree when there is a --corpus.
ALL_METHODS = "all"
# `--markdown` with no file: the markdown table goes to the terminal in place of the text table.
STDOUT = "-"


def add_cli_arguments(parser: Any) -> None:
    add_target_argument(parser)
    parser.add_argument(
        "--draft",
        default=None,
        help="draft: a folder, a shipped draft's name or a Hub id (default: the draft shipped for the target)",
    )
    parser.add_argument("--prompts", default=None, help="MT-bench question.jsonl, or JSONL with prompt/messages")
    parser.add_argument("--every", type=int, default=8, help="take every n-th prompt (8: all MT-bench categories)")
    parser.add_argument("--num-prompts", type=int, default=None, help="at most this many prompts (default: all taken)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="runs over all prompts; tokens/s are their medians")
    add_precision_arguments(parser, "speculative decoding")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, mps, ...")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated subset of {', '.join(METHODS)}; or {ALL_METHODS}: every one (prompt lookup at each "
        "setting; corpus_tree with --corpus)",
    )
    parser.add_argument(
        "--tree-depth", type=int, default=None, help="levels the draft grows (default: the draft config's)"
    )
    parser.add_argument(
        "--tree-top-k", type=int, default=None, help="children kept per frontier node (default: the draft config's)"
    )
    parser.add_argument(
        "--tree-total-tokens", type=int, default=None, help="nodes verified at most (default: the draft config's)"
    )
    parser.add_argument(
        "--lookup-depth",
        type=int,
        default=None,
        help="tokens per context-lookup continuation (hybrid_tree, lookup_tree)",
    )
    parser.add_argument(
        "--lookup-branches",
        type=int,
        default=None,
        help="continuations per cycle (hybrid_tree, lookup_tree; default 4)",
    )
    parser.add_argument(
        "--lookup-total-tokens", type=int, default=None, help="lookup_tree size, root included (default 16)"
    )
    parser.add_argument(
        "--corpus",
        default=None,
        metavar="FILE",
        help="corpus index (`eagle3-hf corpus`) of the target's earlier answers: corpus_tree's, and "
        "hybrid_tree's too (default: the draft's own corpus.safetensors, if its folder has one)",
    )
    add_exact_verify_argument(parser)
    add_thinking_argument(parser)
    parser.add_argument(
        "--batch-size",
        default=None,
        help="comma-separated batch sizes (e.g. 1,4,8): the batched benchmark instead, plain batched "
        "generate() in fp32 and bf16 against EAGLE-3 over left-padded batches of mixed-length prompts",
    )
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument(
        "--markdown",
        nargs="?",
        const=STDOUT,
        default=None,
        metavar="FILE",
        help="the results as one markdown table (every configuration against plain and against prompt lookup at "
        "its best, with the CPU, its flags and the versions): printed in place of the text table, or written to "
        "FILE",
    )
    parser.add_argument("--plot", default=None, help="write a PNG chart of acceptance by depth here (needs [plot])")
    parser.add_argument(
        "--model-card",
        action="store_true",
        help="rewrite the --draft folder's README.md (its model card) with the measurements",
    )
    parser.add_argument(
        "--overwrite-output-dir", action="store_true", help="replace an existing --json, --markdown or --plot file"
    )


def _check_options(args: Any) -> tuple[str, ...]:
    """Everything that can be checked before a model is loaded; returns the methods."""
    from eagle3_hf.utils.outputs import check_output_file

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if methods == (ALL_METHODS,):
        methods = tuple(m for m in METHODS if m != "prompt_lookup" and (m != "corpus_tree" or args.corpus))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"--methods {args.methods!r}: unknown method(s) {unknown}; choose from {', '.join(METHODS)}.")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}.")
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--max-new-tokens", args.max_new_tokens),
        ("--threads", args.threads),
        ("--every", args.every),
        ("--repeats", args.repeats),
        ("--lookup-depth", args.lookup_depth),
        ("--lookup-branches", args.lookup_branches),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}.")
    if args.batch_size is not None:
        try:
            sizes = [int(size) for size in args.batch_size.split(",") if size.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise ValueError(f"--batch-size takes comma-separated sizes >= 1 (e.g. 1,4,8), got {args.batch_size!r}.")
        if args.plot or args.model_card:
            raise ValueError("--plot and --model-card describe the batch-1 benchmark; drop them with --batch-size.")
    if "corpus_tree" in methods and not args.corpus:
        raise ValueError("--methods corpus_tree needs --corpus FILE (a corpus index written by `eagle3-hf corpus`).")
    if args.corpus and not os.path.isfile(args.corpus):
        raise ValueError(f"--corpus {args.corpus!r}: no such file (expected a corpus index of `eagle3-hf corpus`).")
    if args.lookup_total_tokens is not None and args.lookup_total_tokens < 2:
        raise ValueError(f"--lookup-total-tokens must be >= 2 (the root and one node), got {args.lookup_total_tokens}.")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:
            raise ValueError("--plot needs matplotlib: pip install 'eagle3-hf[plot]' (or matplotlib).") from err
    for flag, path in (("--json", args.json), ("--markdown", args.markdown), ("--plot", args.plot)):
        if path and path != STDOUT:
            check_output_file(path, args.overwrite_output_dir, flag)
    if args.draft is not None and args.draft != "random":
        from eagle3_hf.draft_names import check_checkpoint_name

        check_checkpoint_name(args.draft, "--draft", ("random",))  # before the target loads
    if args.model_card and (not args.draft or args.draft == "random"):
        raise ValueError("--model-card needs --draft FOLDER (the draft whose card to rewrite).")
    if args.model_card and not os.path.isfile(os.path.join(args.draft, "config.json")):
        raise ValueError(f"--draft {args.draft!r} holds no config.json: expected a draft folder.")
    return methods


def draft_thinking_mismatch(draft: Any, enable_thinking: bool | None, name: str | None) -> str | None:
    """A warning when the draft's training recorded another thinking setting than the benchmark's prompts use; None
    when they agree or the draft recorded none (trained before the setting was recorded, or not by `train`)."""
    from eagle3_hf.modeling.chat_template import THINKING_VARIABLE, thinking_mismatch

    info = getattr(draft, "training_info", None) or {}
    if THINKING_VARIABLE not in info:
        return None
    return thinking_mismatch(
        info[THINKING_VARIABLE],
        enable_thinking,
        f"The draft {name or '(shipped)'} was trained",
        "this benchmark renders its prompts",
    )


def run_cli(args: Any) -> int:
    methods = _check_options(args)
    if args.batch_size is not None:
        methods = ("plain", "eagle3_tree")  # what the batched benchmark compares
    import torch

    from eagle3_hf.bench.cards import write_bench_card
    from eagle3_hf.bench.runner import (
        DRAFT_METHODS,
        TREE_METHODS,
        bench_configs,
        environment,
        format_markdown,
        format_table,
        load_models,
        plain_dtypes_for,
        plot_acceptance,
        read_prompts,
        row_exact_report,
        run_benchmark,
    )
    from eagle3_hf.modeling.shipped import default_prompts_path
    from eagle3_hf.targets import check_device, load_tokenizer, resolve_target
    from eagle3_hf.utils.outputs import staged_file
    from eagle3_hf.utils.precision import default_threads, has_native_bf16_matmul, resolve_dtype, short_name

    check_device(args.device)
    resolve_target(args.target)  # a bad name or path fails here, at once
    torch.set_num_threads(args.threads or default_threads())
    spec_dtype = resolve_dtype(args.dtype, args.device)
    plain_dtypes = plain_dtypes_for(args.device, has_native_bf16_matmul())
    if torch.bfloat16 not in (*plain_dtypes, spec_dtype):
        print(
            "plain bf16 left out: this CPU has no native bf16 matmul, so bf16 would run emulated "
            "(--dtype bfloat16 benchmarks it anyway)"
        )
    configs = bench_configs(spec_dtype, methods, plain_dtypes)
    need_draft = any(c.method in DRAFT_METHODS for c in configs)
    targets, drafts, prepacked = load_models(args, spec_dtype, {c.dtype for c in configs}, need_draft)
    prompts_path = args.prompts or default_prompts_path()
    prompts = read_prompts(
        prompts_path, load_tokenizer(args.target), args.num_prompts, args.every, args.enable_thinking
    )
    if warning := draft_thinking_mismatch(drafts.get(spec_dtype), args.enable_thinking, args.draft):
        print(f"Warning: {warning}")
    tree_kwargs = {
        k: v
        for k, v in {
            "tree_depth": args.tree_depth,
            "tree_top_k": args.tree_top_k,
            "tree_total_tokens": args.tree_total_tokens,
        }.items()
        if v is not None
    }
    tree_kwargs["exact_verify"] = exact_verify_setting(args)
    lookup_kwargs = {
        k: v
        for k, v in {
            "tree_depth": args.lookup_depth,
            "lookup_branches": args.lookup_branches,
            "tree_total_tokens": args.lookup_total_tokens,
        }.items()
        if v is not None
    }
    if args.batch_size is not None:
        return _run_batched(args, targets, drafts[spec_dtype], spec_dtype, prompts, tree_kwargs)
    report = run_benchmark(
        targets,
        drafts,
        prompts,
        configs,
        args.max_new_tokens,
        args.temperature,
        tree_kwargs,
        args.repeats,
        lookup_kwargs=lookup_kwargs,
        corpus=args.corpus,
    )
    if any(c.method in TREE_METHODS for c in configs):
        report["row_exact"] = row_exact_report(targets[spec_dtype], exact_verify=exact_verify_setting(args))
    source = "MT-bench turn 1" if args.prompts is None else os.path.basename(prompts_path)
    report["config"] = {
        "target": args.target,
        "draft": args.draft or "(shipped)",
        "dtype": str(spec_dtype).removeprefix("torch."),
        "spec_dtype": short_name(spec_dtype),
        "prepacked": prepacked,
        "device": args.device,
        "prompts": f"{source}, every {args.every}th record" if args.every > 1 else f"{source}, all records",
        "every": args.every,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "temperature": args.temperature,
        "enable_thinking": args.enable_thinking,
        **tree_kwargs,
        **{
            k: v
            for k, v in (
                ("lookup_depth", args.lookup_depth),
                ("lookup_branches", args.lookup_branches),
                ("lookup_total_tokens", args.lookup_total_tokens),
                ("corpus", args.corpus),
            )
            if v is not None
        },
    }
    report["environment"] = environment()
    print(format_markdown(report) if args.markdown == STDOUT else format_table(report))
    if args.json:
        with staged_file(args.json) as temporary, open(temporary, "w") as f:
            json.dump(report, f, indent=2)
    if args.markdown and args.markdown != STDOUT:
        with staged_file(args.markdown) as temporary, open(temporary, "w") as f:
            f.write(format_markdown(report) + "\n")
    if args.plot and "acceptance_by_depth" in report:
        with staged_file(args.plot) as temporary:
            plot_acceptance(report, temporary, fmt="png")
    if args.model_card:
        shown = ("target", "draft", "every", "num_prompts", "max_new_tokens", "repeats")
        command = (
            "eagle3-hf bench "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in report["config"].items() if k in shown)
            + f" --dtype {args.dtype}"
            + {None: "", True: " --enable-thinking", False: " --no-enable-thinking"}[args.enable_thinking]
        )
        print(f"Model card written to {write_bench_card(args.draft, report, bench_command=command)}")
    return 0


def _run_batched(args: Any, targets: dict, draft: Any, spec_dtype: Any, prompts: list, tree_kwargs: dict) -> int:
    """`--batch-size`: the batched benchmark (`eagle3_hf.bench.batch`), its table printed and written."""
    from eagle3_hf.bench.batch import format_batch_table, run_batch_benchmark
    from eagle3_hf.bench.runner import environment
    from eagle3_hf.targets import load_tokenizer
    from eagle3_hf.utils.outputs import staged_file

    tokenizer = load_tokenizer(args.target)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sizes = [int(size) for size in args.batch_size.split(",") if size.strip()]
    report = run_batch_benchmark(
        targets,
        draft,
        spec_dtype,
        prompts,
        sizes,
        args.max_new_tokens,
        tree_kwargs,
        args.repeats,
        pad_id or 0,
        corpus=args.corpus,
    )
    report["enable_thinking"] = args.enable_thinking
    report["environment"] = environment()
    table = format_batch_table(report)
    print(table)
    if args.json:
        with staged_file(args.json) as temporary, open(temporary, "w") as f:
            json.dump(report, f, indent=2)
    if args.markdown and args.markdown != STDOUT:  # the table printed above is markdown already
        with staged_file(args.markdown) as temporary, open(temporary, "w") as f:
            f.write(table + "\n")
    return 0
