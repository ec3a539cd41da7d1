"""Run a check script of this folder in a fresh interpreter (Triton's interpreter is switched on
by an environment variable read at import, so it cannot be turned on inside pytest's process)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def run_script(script: str, *args: str, interpret: bool = True) -> subprocess.CompletedProcess:
    """`python HERE/script args...` with this folder importable (and `TRITON_INTERPRET=1` unless
    `interpret=False`); fails with the script's output when it exits non-zero."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return r


def rank_context():
    """The multiprocessing context the multi-rank tests start their ranks with: "forkserver"
    with torch and torch.distributed imported once by the server (a fresh interpreter per rank
    spends seconds of CPU on those imports), or "spawn" where the platform has no fork server.
    Ranks get this process's environment at the server's start: these workers read none."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor",
                                "torch.distributed.checkpoint"])  # fmt: skip
    return ctx
