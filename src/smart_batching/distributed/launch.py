"""Start a Python module on several processes with torchrun, and stop them cleanly on Ctrl-C.

Shared by ``smart-batching train --nproc N`` (which re-launches itself) and ``bench --nproc N``
(which launches one torchrun per run). torchrun runs ``--standalone``: one machine, a free port
chosen for it, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set for every process. Processes use gloo on
CPU and NCCL on GPUs (that choice belongs to whoever initialises ``torch.distributed``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

STOP_GRACE_SECONDS = 30.0
"""After Ctrl-C, how long torchrun gets to stop its workers before it is killed."""


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """The command line that runs ``python -m module *args`` on ``nproc`` local processes."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(int(nproc)),
        "-m", module, *args,
    ]  # fmt: skip


def torchrun_env(
    threads_per_process: int | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's environment for the workers, with ``OMP_NUM_THREADS`` set.

    Args:
        threads_per_process: CPU threads per worker; None keeps ``OMP_NUM_THREADS`` if set, else 1
            (torchrun's own default, without its warning).
        extra: more variables to set.
    """
    env = {**os.environ, **(extra or {})}
    if threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(int(threads_per_process))
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_torchrun(
    nproc: int,
    module: str,
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    grace_seconds: float = STOP_GRACE_SECONDS,
) -> int:
    """Run ``module`` on ``nproc`` processes under torchrun and wait; returns torchrun's exit status.

    On Ctrl-C (``KeyboardInterrupt`` here) torchrun gets SIGINT, which it passes to its workers, and
    ``grace_seconds`` to stop them; then it is killed. The ``KeyboardInterrupt`` is re-raised, so the
    caller keeps its own Ctrl-C behaviour.

    Args:
        nproc: processes to start.
        module: the module torchrun runs with ``-m`` on every process.
        args: its arguments.
        env: the workers' environment; None means :func:`torchrun_env` ().
        stdout, stderr: as :class:`subprocess.Popen` (None: inherited).
        grace_seconds: see above.
    """
    cmd = torchrun_command(nproc, module, args)
    proc = subprocess.Popen(
        cmd, env=dict(env) if env is not None else torchrun_env(), stdout=stdout, stderr=stderr
    )
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop(proc, grace_seconds)
        raise


def _stop(proc: subprocess.Popen, grace_seconds: float) -> None:
    try:
        if proc.poll() is None:
            # In a terminal torchrun already has the SIGINT (same process group); sent again it is harmless.
            proc.send_signal(signal.SIGINT)
            proc.wait(grace_seconds)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


__all__ = ["STOP_GRACE_SECONDS", "run_torchrun", "torchrun_command", "torchrun_env"]
