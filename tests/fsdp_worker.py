"""Two-process worker for tests/test_fsdp.py (launched by `accelerate launch` or torchrun; not a test module).

    worker.py train OUTPUT        FSDP2 training checks on the tiny target; rank 0 prints one JSON line
    worker.py depth OUTPUT        3 FSDP2 steps of a 2-layer draft: its losses and which layers are FSDP units
    worker.py cli OUTPUT ARGV...  run `eagle3-hf` commands (each ARGV a JSON list) in these processes

`train` runs, under an accelerate FSDP2 config (full state dict checkpoints):
  A  6 steps uninterrupted, checkpoints every 2 steps, then the final draft saved, reloaded and used to generate;
  B  the same run with ``fsdp=...`` in the arguments and sharded checkpoints, stopped after step 4's checkpoint;
  C  B resumed; D  A resumed from its step-4 checkpoint into another folder.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist
from helpers.trainer_callbacks import StopAt

from eagle3_hf import Eagle3DraftModel, bind_target
from eagle3_hf.cli import main as cli_main
from eagle3_hf.training.distributed import fsdp_memory_per_process, is_fsdp2_module, parameter_bytes
from eagle3_hf.training.trainer import Eagle3Trainer, Eagle3TrainingArguments, install_draft_vocab
from eagle3_hf.utils import tiny

ROOT = pathlib.Path(__file__).parents[1]

SHARDED = {"fsdp": "full_shard auto_wrap", "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}


def training_args(output_dir, **overrides):
    """The arguments test_fsdp.py also uses for its one-process run (there accumulating 2 micro-batches a step)."""
    values = dict(
        output_dir=str(output_dir),
        max_steps=6,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-2,
        ttt_length=3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        seed=0,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
    )
    values.update(overrides)
    return Eagle3TrainingArguments(**values)


def new_draft(target, dataset, **config_overrides):
    torch.manual_seed(0)
    draft = Eagle3DraftModel.from_target(target, draft_vocab_size=48, **config_overrides)
    install_draft_vocab(draft, dataset)
    return draft


def losses(trainer):
    return {log["step"]: log["loss"] for log in trainer.state.log_history if "loss" in log}


def run_training(out: pathlib.Path) -> dict:
    target, dataset = tiny.make_tiny_target(), tiny.synthetic_dataset()
    summary = {}

    def trainer(folder, callbacks=(), **overrides):
        args = training_args(folder, **overrides)
        return Eagle3Trainer(
            new_draft(target, dataset),
            args,
            target=target,
            train_dataset=dataset,
            eval_dataset=dataset.select(range(4)),
            callbacks=list(callbacks),
        )

    whole = trainer(out / "A")
    summary["target_bytes"] = parameter_bytes(whole.target)  # (this process's shard, unsharded)
    whole.train()
    summary["draft_bytes"] = parameter_bytes(whole.model)
    states = [t for state in whole.optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()]
    summary["optimizer_bytes"] = sum(t.to_local().numel() * t.element_size() for t in states)  # AdamW's moments
    summary["estimate"] = fsdp_memory_per_process(whole.target, whole.model, dist.get_world_size())
    summary["A"] = losses(whole)
    summary["eval_loss"] = whole.evaluate()["eval_loss"]
    whole.save_model(str(out / "final"))
    gathered = whole.accelerator.get_state_dict(whole.model)  # a collective: every process
    if dist.get_rank() == 0:
        reference = tiny.make_tiny_target()  # the same (seeded) weights, unsharded, in one process
        draft = bind_target(Eagle3DraftModel.from_pretrained(str(out / "final"), target=reference).eval(), reference)
        summary["reload_equal"] = all(torch.equal(v, gathered[k]) for k, v in draft.state_dict().items())
        ids = torch.tensor([[5, 9, 13, 17, 21]])
        plain = reference.generate(ids, max_new_tokens=12, do_sample=False)
        eagle = reference.generate(ids, assistant_model=draft, max_new_tokens=12, do_sample=False)
        summary["lossless"] = torch.equal(plain, eagle)
    killed = trainer(out / "B", [StopAt(4)], **SHARDED)
    killed.train()
    summary["B_step"] = killed.state.global_step
    summary["B_files"] = sorted(os.listdir(out / "B" / "checkpoint-4"))
    resumed = trainer(out / "B", **SHARDED)
    resumed.train(resume_from_checkpoint=True)
    summary["C"] = losses(resumed)
    again = trainer(out / "D")
    again.train(resume_from_checkpoint=str(out / "A" / "checkpoint-4"))
    summary["D"] = losses(again)
    summary["D_files"] = sorted(os.listdir(out / "A" / "checkpoint-4"))
    return summary


def run_depth(out: pathlib.Path) -> dict:
    target, dataset = tiny.make_tiny_target(), tiny.synthetic_dataset()
    args = training_args(out, max_steps=3, save_strategy="no")
    trainer = Eagle3Trainer(new_draft(target, dataset, num_hidden_layers=2), args, target=target, train_dataset=dataset)
    trainer.train()
    return {"losses": losses(trainer), "units": [is_fsdp2_module(layer) for layer in trainer.model.draft_layers()]}


def main() -> int:
    torch.set_num_threads(1)
    mode, out = sys.argv[1], pathlib.Path(sys.argv[2])
    if mode == "train":
        summary = run_training(out)
    elif mode == "depth":
        summary = run_depth(out)
    else:
        summary = {"codes": [cli_main(json.loads(argv)) for argv in sys.argv[3:]]}
    if dist.get_rank() == 0:
        print(json.dumps(summary))
    # Wait for every process, and leave the group to os._exit below: destroying it can hang (ProcessGroupGloo's
    # destructor joins its worker thread holding the GIL, which a finished collective's tensors may still need).
    dist.barrier()
    return 0


if __name__ == "__main__":
    code = main()
    # The summary is printed and every process done; skip the interpreter's own teardown, where torch's gloo
    # threads can still abort a finished run ("terminate called without an active exception") on a loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
