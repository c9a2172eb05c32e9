"""Several-process launches (torchrun, accelerate launch) run from the tests."""

import json
import os
import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: list[str], cwd, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run a launcher command; return the JSON line its rank 0 printed last.

    The launcher runs in a session of its own, killed whole on `timeout`: killing the launcher alone would leave
    its workers running (and holding the pipes open) after the test has failed.
    """
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
        cwd=cwd,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise AssertionError(f"{command[:4]} still running after {timeout} s; stderr:\n{stderr[-3000:]}") from None
    assert process.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])
