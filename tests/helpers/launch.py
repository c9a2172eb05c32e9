"""Several-process launches (torchrun, accelerate launch) run from the tests, through the exit loop's launcher."""

import importlib.util
import json
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fsdp_exit_loop", ROOT / "scripts" / "fsdp_exit_loop.py")
exit_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exit_loop)
free_port = exit_loop.free_port


def launch(command: list[str], cwd, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run a launcher command; return the JSON line its rank 0 printed last.

    On `timeout` the launch is killed whole (its own session): killing the launcher alone would leave its workers
    running after the test has failed.
    """
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    code, stdout, stderr = exit_loop.run_once(command, environment, cwd, timeout)
    assert code is not None, f"{command[:4]} still running after {timeout} s; stderr:\n{stderr[-3000:]}"
    assert code == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])
