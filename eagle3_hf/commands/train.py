"""`eagle3-hf train`: train a draft with `Eagle3Trainer` and the TTT loss (`eagle3_hf.training.trainer`).

The options are an `HfArgumentParser` over `Eagle3TrainingArguments` (every `transformers.TrainingArguments` field:
`--learning-rate`, `--num-train-epochs`, `--report-to tensorboard`, `--push-to-hub`, `--eval-strategy`, ...) and
`TrainCommandArguments` (the target, the data, how to start), so `--config FILE` (JSON or YAML) can hold any of
them, required ones included. `--help` lists ours without importing transformers; `--help-all` lists everything.

The output folder is never overwritten by accident: an existing non-empty one needs `--resume` (continue from its
last complete checkpoint, or from `--resume-from-checkpoint DIR`, checked the same way; see `train_checks`) or `--overwrite-output-dir` (start afresh: its earlier checkpoints are
removed once training begins, after every input has been checked); checkpoints are written whole
(`eagle3_hf.training.checkpointing`) and the final draft is written to a temporary folder and its files renamed
into place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Literal

from eagle3_hf.commands import (
    THINKING_HELP,
    OneLineErrors,
    ShowDefaults,
    apply_config,
    load_config_file,
    say,
    split_config,
)
from eagle3_hf.commands.options import TARGET_HELP
from eagle3_hf.commands.train_checks import ARCHITECTURE_FLAGS, check_train_arguments, resume_checkpoint
from eagle3_hf.commands.train_draft import build_draft
from eagle3_hf.commands.vocab import draft_vocab_size_arg
from eagle3_hf.training.arguments import DEFAULT_HELD_OUT_FRACTION, DEFAULT_MIN_COVERAGE, Eagle3TrainingOptions

PROG = "eagle3-hf train"
DESCRIPTION = "Train an EAGLE-3 draft with Trainer.train() and the TTT loss."


@dataclass
class TrainCommandArguments:
    """What `eagle3-hf train` adds to `Eagle3TrainingArguments`: the target, the data and how to start."""

    target: str = field(metadata={"help": TARGET_HELP})
    data: list[str] | None = field(
        default=None,
        metadata={
            "help": "conversations (online features): JSON, JSONL, .jsonl.gz or parquet files, folders of "
            "them, or Hub dataset ids; ShareGPT, messages or Alpaca records; several are joined"
        },
    )
    features: list[str] | None = field(
        default=None, metadata={"help": "folders written by `eagle3-hf features` (offline); several are joined"}
    )
    max_conversations: int | None = field(default=None, metadata={"help": "read at most this many conversations"})
    enable_thinking: bool | None = field(default=None, metadata={"help": THINKING_HELP + " (online features)"})
    tokenize_num_proc: int | None = field(
        default=None, metadata={"help": "processes that tokenise the conversations (default: this one)"}
    )
    init_draft: str | None = field(
        default=None,
        metadata={
            "help": "continue training this saved draft (with --draft-vocab-size/--vocab: remapped to that "
            "vocabulary, shared tokens keeping their head rows, new ones starting at zero)"
        },
    )
    vocab: str | None = field(
        default=None, metadata={"help": "draft vocabulary file written by `eagle3-hf vocab` (fresh drafts)"}
    )
    min_coverage: float = field(
        default=DEFAULT_MIN_COVERAGE, metadata={"help": "held-out coverage --draft-vocab-size auto must reach"}
    )
    held_out_fraction: float = field(
        default=DEFAULT_HELD_OUT_FRACTION,
        metadata={
            "help": "share of conversations (by id hash) held out from training: they measure the vocabulary's "
            "coverage and are the evaluation set of --eval-steps"
        },
    )
    eval_features: list[str] | None = field(
        default=None,
        metadata={
            "help": "offline features of held-out conversations (`eagle3-hf features --split held-out`), "
            "evaluated every --eval-steps"
        },
    )
    num_hidden_layers: int | None = field(
        default=None,
        metadata={
            "help": "the draft's own decoder layers (not the target's): a fresh draft's depth (default 1, "
            "EAGLE-3's); with --init-draft, a larger value grows it by layers that start as the "
            "identity (default: keep its depth)"
        },
    )
    init_from_target: bool = field(
        default=True,
        metadata={
            "help": "start a fresh draft's head from the target's head rows and final norm "
            "(--no-init-from-target: random)"
        },
    )
    init_layer_from_target: bool = field(
        default=False,
        metadata={"help": "also copy the target's last decoder layer's MLP, o_proj and norms into a fresh draft"},
    )
    target_layer_ids: str | None = field(
        default=None,
        metadata={
            "help": "three comma-separated output_hidden_states ids to tap (low,mid,high; default "
            "2,L//2,L-3), e.g. the same id three times for a top-layer-only ablation"
        },
    )
    fc_norm: bool | None = field(
        default=None,
        metadata={
            "help": "EAGLE-3.1: an RMSNorm on each target tap before fc (a fresh draft; with --init-draft or "
            "--resume it may only restate the draft's)"
        },
    )
    norm_output: bool | None = field(
        default=None,
        metadata={
            "help": "EAGLE-3.1: feed the post-norm state to the next drafting step, in TTT and decoding (with "
            "--init-draft: also how an official/SpecForge checkpoint's norm_output: true is read)"
        },
    )
    norm_before_fc: bool | None = field(
        default=None, metadata={"help": "one RMSNorm over the concatenated taps before fc (gpt-oss-style drafts)"}
    )
    target_id: str | None = field(
        default=None,
        metadata={
            "help": "the target's Hub id org/name, recorded in the draft and its model card "
            "(known without it for short names and Hub ids)"
        },
    )
    dtype: Literal["float32", "bfloat16", "float16"] = field(
        default="float32", metadata={"help": "target dtype and mixed precision of the draft (master weights fp32)"}
    )
    resume: bool = field(
        default=False,
        metadata={
            "help": "continue from the last checkpoint in --output-dir (--resume-from-checkpoint DIR: from that one; "
            "options that contradict the checkpoint are refused either way)"
        },
    )
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "start afresh in a non-empty --output-dir (its checkpoints are removed)"}
    )


# The recipe's defaults where they differ from TrainingArguments' (SpecForge's: cosine, warmup 1.5%, clip 0.5).
TRAIN_DEFAULTS: dict[str, Any] = {
    "learning_rate": 1e-4,
    "warmup_steps": 0.015,
    "lr_scheduler_type": "cosine",
    "adam_beta2": 0.95,
    "max_grad_norm": 0.5,
    "weight_decay": 0.0,
    "per_device_train_batch_size": 1,
    "save_steps": 500,
    "save_total_limit": 2,
    "logging_steps": 10,
    "seed": 0,
    "report_to": "none",
    "per_device_eval_batch_size": 1,
}
# Older flag names -> the TrainingArguments field they set.
ALIASES = {"--output": "output_dir", "--batch-size": "per_device_train_batch_size", "--warmup-ratio": "warmup_steps"}
_ALIAS_TYPES = {"output_dir": str, "per_device_train_batch_size": int, "warmup_steps": float}
_TRAINING_ARGUMENTS_SHOWN = (
    "--output-dir",
    "--max-steps",
    "--num-train-epochs",
    "--learning-rate",
    "--per-device-train-batch-size",
    "--gradient-accumulation-steps",
    "--save-steps",
    "--save-total-limit",
    "--logging-steps",
    "--eval-strategy",
    "--eval-steps",
    "--report-to",
    "--push-to-hub",
    "--hub-model-id",
    "--gradient-checkpointing",
    "--seed",
)


# ------------------------------------------------------------------------------------------------------------------
# parsing


def _add_fields(group: Any, cls: type) -> None:
    """Options for a dataclass of simple fields, as HfArgumentParser would make them (for the quick --help only)."""
    for f in dataclasses.fields(cls):
        kind = str(f.type)
        flag = f"--{f.name.replace('_', '-')}"
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kwargs: dict[str, Any] = {"help": f.metadata.get("help", ""), "required": required}
        if not required:
            kwargs["default"] = f.default
        if kind.startswith("bool"):
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        elif kind.startswith("list"):
            kwargs.update(nargs="+")
        elif kind.startswith("Literal"):
            kwargs.update(choices=[a.strip(" '\"") for a in kind[len("Literal[") : -1].split(",")])
        group.add_argument(flag, **kwargs)


def quick_help() -> str:
    """`eagle3-hf train --help`: our options and the EAGLE-3 ones, without importing transformers."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        formatter_class=ShowDefaults,
        usage=f"{PROG} --target TARGET (--data SRC [SRC ...] | --features DIR [DIR ...]) --output-dir DIR "
        "[options] [any TrainingArguments option]",
        epilog="Every transformers TrainingArguments field is an option as well ("
        + ", ".join(_TRAINING_ARGUMENTS_SHOWN)
        + ", ...): `eagle3-hf train --help-all` lists them all (it "
        "imports transformers, a few seconds). Defaults that differ from TrainingArguments': "
        + ", ".join(f"{k}={v}" for k, v in TRAIN_DEFAULTS.items())
        + ". Aliases: "
        + ", ".join(f"{a} = --{d.replace('_', '-')}" for a, d in ALIASES.items())
        + ". --config FILE (JSON or YAML) may hold any option, required ones included; flags given here win.",
    )
    ours = parser.add_argument_group("eagle3-hf train options")
    _add_fields(ours, TrainCommandArguments)
    _add_no_thinking(ours)
    _add_fields(parser.add_argument_group("EAGLE-3 training options (Eagle3TrainingArguments)"), Eagle3TrainingOptions)
    parser.add_argument("--config", help="JSON/YAML file of option values (flags given here win)")
    parser.add_argument("--help-all", action="store_true", help="list every option, TrainingArguments' included")
    return parser.format_help()


def build_parser() -> argparse.ArgumentParser:
    """The full parser: an HfArgumentParser over `Eagle3TrainingArguments` and `TrainCommandArguments`."""
    from transformers import HfArgumentParser

    from eagle3_hf.training.trainer import Eagle3TrainingArguments

    class Parser(OneLineErrors, HfArgumentParser):
        pass

    parser = Parser([Eagle3TrainingArguments, TrainCommandArguments], prog=PROG, description=DESCRIPTION)
    for alias, dest in ALIASES.items():
        parser.add_argument(
            alias,
            dest=dest,
            type=_ALIAS_TYPES[dest],
            default=argparse.SUPPRESS,
            help=f"alias of --{dest.replace('_', '-')}",
        )
    parser.add_argument("--config", help="JSON/YAML file of option values (flags given here win)")
    parser.set_defaults(**TRAIN_DEFAULTS)
    _action(parser, "draft_vocab_size").type = draft_vocab_size_arg  # a size, or "auto" (chosen by coverage)
    for flag in ARCHITECTURE_FLAGS:  # `--fc-norm` alone says true; left out, None: the draft's own, when it has one
        _action(parser, flag).nargs, _action(parser, flag).const = "?", True
    _action(parser, "enable_thinking").nargs, _action(parser, "enable_thinking").const = "?", True
    _add_no_thinking(parser)
    return parser


def _add_no_thinking(parser: Any) -> None:
    """`--no-enable-thinking`, as the other commands have it (argparse.BooleanOptionalAction); `--enable-thinking`
    comes from the dataclass field, so that a --config file may hold it too."""
    parser.add_argument(
        "--no-enable-thinking",
        dest="enable_thinking",
        action="store_const",
        const=False,
        default=argparse.SUPPRESS,
        help="the same as --enable-thinking false",
    )


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)  # argparse keeps no public index of its options


def parse_cli(argv: list[str]) -> argparse.Namespace:
    if "-h" in argv or "--help" in argv:
        print(quick_help())
        raise SystemExit(0)
    config, rest = split_config(argv)
    parser = build_parser()
    if "--help-all" in rest:
        parser.print_help()
        raise SystemExit(0)
    if config is not None:
        apply_config(parser, load_config_file(config), config)
    return parser.parse_args(rest)


# ------------------------------------------------------------------------------------------------------------------
# running


def _training_arguments(args: argparse.Namespace, offline: bool) -> Any:
    import torch

    from eagle3_hf.training.trainer import Eagle3TrainingArguments

    names = {f.name for f in dataclasses.fields(Eagle3TrainingArguments) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    # The command chooses the vocabulary itself (`--draft-vocab-size` may be "auto"), so the trainer checks nothing.
    values.update(feature_mode="offline" if offline else "online", build_draft_vocab=False, draft_vocab_size=None)
    if values.get("eval_steps") and values["eval_strategy"] in ("no", None):
        values["eval_strategy"] = "steps"  # --eval-steps N alone: evaluate every N steps
    if values.get("metric_for_best_model") and values["eval_strategy"] in ("no", None):
        raise ValueError(
            f"--metric-for-best-model {values['metric_for_best_model']} selects checkpoints by their "
            "evaluation: add --eval-steps N (held-out conversations, or --eval-features)."
        )
    values["bf16"] = values["bf16"] or args.dtype == "bfloat16"
    values["fp16"] = values["fp16"] or args.dtype == "float16"
    if not torch.cuda.is_available():
        values["use_cpu"] = True  # bf16 autocast on a CPU-only machine needs it said explicitly
    return Eagle3TrainingArguments(**values)


def _save_final(trainer: Any, output_dir: str) -> None:
    """Save the draft into a temporary folder inside `output_dir`, then rename its files into place."""
    staging = os.path.join(output_dir, ".saving-draft.tmp")  # the same name on every process (FSDP saves on all)
    trainer.save_model(staging, _internal_call=True)
    if trainer.is_world_process_zero():
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        shutil.rmtree(staging, ignore_errors=True)


def _data(args: argparse.Namespace, training_args: Any, offline: bool) -> tuple[Any, Any, Any]:
    """(training set, evaluation set or None, rows the vocabulary is chosen on): offline features, or the
    conversations less the held-out ones. The vocabulary rows are every conversation: `select_draft_vocab` counts the
    training ones and measures coverage on the held-out ones (given the training part only, it fell back to
    training coverage)."""
    from eagle3_hf.targets import load_tokenizer
    from eagle3_hf.training.feature_dataset import OfflineFeatureDataset
    from eagle3_hf.training.split import split_held_out
    from eagle3_hf.training.tokenise import tokenise_data

    evaluate = training_args.eval_strategy != "no"
    if offline:
        dataset = OfflineFeatureDataset(args.features)
        say(f"Offline features: {len(dataset)} samples from {dataset.folder}.")
        return dataset, OfflineFeatureDataset(args.eval_features) if args.eval_features else None, dataset
    tokenizer = load_tokenizer(args.target)
    everything, _ = tokenise_data(
        tokenizer,
        args.data,
        training_args.max_length,
        args.max_conversations,
        num_proc=args.tokenize_num_proc,
        enable_thinking=args.enable_thinking,
    )
    dataset, held_out = split_held_out(everything, args.held_out_fraction)
    say(f"Held out {len(held_out)} of {len(everything)} conversations (by id hash) from training.")
    if evaluate and len(held_out) == 0:
        raise ValueError("--eval-steps: no conversation is held out; raise --held-out-fraction or add data.")
    return dataset, held_out if evaluate else None, everything


def _thinking_info(args: argparse.Namespace, dataset: Any, offline: bool) -> dict[str, bool | None]:
    """``{"enable_thinking": ...}`` for training_info: this run's flag, or offline, what `eagle3-hf features`
    recorded, when every features folder recorded the same one (none: nothing is known, nothing recorded)."""
    if not offline:
        return {"enable_thinking": args.enable_thinking}
    settings = {m.get("enable_thinking") for m in dataset.manifests}
    if len(settings) > 1:
        say(
            f"Warning: the --features folders were rendered with different thinking settings "
            f"({', '.join(map(str, settings))}); the draft records none."
        )
    if len(settings) == 1 and all("enable_thinking" in m for m in dataset.manifests):
        return {"enable_thinking": settings.pop()}
    return {}


def run_cli(args: argparse.Namespace) -> int:
    check_train_arguments(args)
    # before anything is loaded: it may refuse; --resume-from-checkpoint is checked as --resume is
    checkpoint = resume_checkpoint(args) if args.resume or args.resume_from_checkpoint is not None else None
    import torch
    from transformers.trainer_utils import set_seed

    from eagle3_hf.targets import load_target, resolve_target
    from eagle3_hf.training.checkpointing import RemoveCheckpointsOnTrainBegin
    from eagle3_hf.training.data_files import is_dataset_id
    from eagle3_hf.training.distributed import check_fsdp_loading, init_distributed_from_launcher
    from eagle3_hf.training.trainer import Eagle3Trainer
    from eagle3_hf.utils.precision import emulated_bf16_warning

    if warning := emulated_bf16_warning(args.dtype, "cuda" if torch.cuda.is_available() else "cpu"):
        say(f"Warning: {warning}")
    offline = args.features is not None
    training_args = _training_arguments(args, offline)
    resolve_target(args.target)
    set_seed(training_args.seed)
    dataset, eval_dataset, vocab_rows = _data(args, training_args, offline)
    # Under FSDP (--fsdp, or an accelerate FSDP config) each process loads only its shard of the target.
    fsdp = bool(training_args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    check_fsdp_loading()
    target = load_target(
        args.target, dtype=getattr(torch, args.dtype), shard=fsdp and init_distributed_from_launcher()[1] > 1
    )
    if args.target_id:
        target.config._name_or_path = args.target_id
    draft = build_draft(args, target, vocab_rows, checkpoint)
    sources = args.features if offline else args.data
    before = (draft.training_info or {}).get("steps") or 0 if args.init_draft else 0
    draft.training_info = {  # what the draft's model card says about its training
        "data": ", ".join(sources) + (" (offline features)" if offline else ""),
        "datasets": [s for s in sources if is_dataset_id(s) and not os.path.exists(s)] or None,
        "ttt_length": training_args.ttt_length,
        "loss": training_args.loss,
        # how the chat template rendered the conversations (bench checks its prompts against it)
        **_thinking_info(args, dataset, offline),
    }
    output_dir = training_args.output_dir
    # The earlier run's checkpoints go once training has begun, so that a mistake found before then deletes nothing.
    callbacks = [RemoveCheckpointsOnTrainBegin(output_dir, say)] if args.overwrite_output_dir else []
    trainer = Eagle3Trainer(
        draft,
        training_args,
        target=None if offline else target,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    draft.training_info["steps"] = before + trainer.state.global_step
    _save_final(trainer, output_dir)
    trainer.save_state()
    if training_args.push_to_hub:
        trainer.push_to_hub()
    last = next((log for log in reversed(trainer.state.log_history) if "acc_0" in log), None)
    if last is not None:
        accs = " ".join(f"{last[f'acc_{j}']:.3f}" for j in range(training_args.ttt_length))
        say(f"Last logged accuracy per TTT step: {accs}; simulated acceptance length {last['sim_accept_len']:.2f}.")
    say(f"Saved the draft to {output_dir} ({trainer.state.global_step} steps).")
    return 0
