"""Run the 2-process `eagle3-hf train` command N times and check that every run exits 0 (no abort at exit, no hang).

A worker that leaves its process group to the interpreter's exit can die after finishing its work ("terminate
called without an active exception", SIGABRT): now and then, so one run proves nothing and a loop is the check.
Each run trains a tiny random chat target (eagle3_hf.utils.tiny) for 2 steps on CPU processes (gloo),
saving a checkpoint every step, as the documented multi-process command does on a real target:

    python scripts/fsdp_exit_loop.py                          # torchrun, FSDP2, 10 runs
    python scripts/fsdp_exit_loop.py --launcher accelerate --parallel ddp --runs 3

Prints one line per run (exit code, seconds, and the last stderr line of a failed run) and exits 0 only when every
run exited 0 within --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The abort this loop looks for, as the C++ runtime words it; a run that printed it failed even if it exited 0.
ABORT_TEXT = "terminate called"
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: {distributed_type}
num_machines: 1
machine_rank: 0
num_processes: {processes}
mixed_precision: 'no'
use_cpu: true
"""
ACCELERATE_FSDP = """\
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_tiny_target(folder: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The tiny chat target and its ShareGPT data, as the tests build them."""
    from eagle3_hf.utils import tiny

    target = folder / "target"
    tiny.write_tiny_chat_target(str(target))
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in tiny.tiny_sharegpt()))
    return target, data


def accelerate_config(parallel: str, processes: int) -> str:
    """What `accelerate config` writes for `parallel` (``"fsdp"``: FSDP2, ``"ddp"``) over CPU processes."""
    if parallel not in ("fsdp", "ddp"):
        raise ValueError(f"parallel must be 'fsdp' or 'ddp', got {parallel!r}")
    kind = "FSDP" if parallel == "fsdp" else "MULTI_CPU"
    text = ACCELERATE_CONFIG.format(distributed_type=kind, processes=processes)
    return text + (ACCELERATE_FSDP if parallel == "fsdp" else "")


def launch_command(
    args: argparse.Namespace, work: pathlib.Path, output: pathlib.Path, target: pathlib.Path, data: pathlib.Path
) -> list[str]:
    train = [
        "train",
        "--target",
        str(target),
        "--data",
        str(data),
        "--output",
        str(output),
        "--max-steps",
        "2",
        "--ttt-length",
        "2",
        "--draft-vocab-size",
        "64",
        "--save-steps",
        "1",
        "--logging-steps",
        "1",
    ]
    if args.launcher == "torchrun":
        if args.parallel == "fsdp":
            train += ["--fsdp", "full_shard auto_wrap"]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.processes),
            "--master_port",
            str(free_port()),
            "-m",
            "eagle3_hf.cli",
            *train,
        ]
    # accelerate: the parallelism comes from its config file, as `accelerate config` writes it.
    config = work / f"accelerate_{args.parallel}.yaml"
    config.write_text(accelerate_config(args.parallel, args.processes))
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "--main_process_port",
        str(free_port()),
        "-m",
        "eagle3_hf.cli",
        *train,
    ]


def run_once(command: list[str], env: dict[str, str], cwd: pathlib.Path, timeout: float) -> tuple[int | None, str, str]:
    """``(exit code, stdout, stderr)`` of one launch; ``None`` for a run that hung (its whole process group is killed)."""
    # A session of its own: on a hang the launcher's workers go with it rather than linger (and hold the pipes open).
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return process.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        return None, stdout, stderr


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=positive, default=10)
    parser.add_argument("--launcher", choices=["torchrun", "accelerate"], default="torchrun")
    parser.add_argument("--parallel", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--processes", type=positive, default=2)
    parser.add_argument("--timeout", type=positive, default=600, help="seconds a run may take before it counts as hung")
    args = parser.parse_args(argv)

    # One thread per process (a shared CPU), and this checkout's package whatever an installed copy says.
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    failures = 0
    with tempfile.TemporaryDirectory(prefix="fsdp_exit_loop_") as tmp:
        work = pathlib.Path(tmp)
        target, data = write_tiny_target(work)
        print(f"{args.runs} runs of {args.launcher} {args.parallel}, {args.processes} processes:", flush=True)
        for run in range(1, args.runs + 1):
            command = launch_command(args, work, work / f"run{run}", target, data)
            start = time.monotonic()
            code, _, stderr = run_once(command, env, work, args.timeout)
            seconds = time.monotonic() - start
            saved = (work / f"run{run}" / "model.safetensors").is_file()
            ok = code == 0 and saved and ABORT_TEXT not in stderr
            failures += not ok
            line = f"run {run}: exit {'hung' if code is None else code}, {seconds:.0f} s, draft saved: {saved}"
            if not ok:
                last = [text for text in stderr.splitlines() if text.strip()][-3:]
                line += " -- " + " | ".join(last)
            print(line, flush=True)
    print(f"{args.runs - failures} of {args.runs} runs exited 0 cleanly.")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
