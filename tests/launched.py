"""Run a launcher (torchrun, a script of several processes) from a test, and keep what it printed
when it hangs: ``subprocess.run``'s timeout raises without the output, which is what says where."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any

import pytest


def run_launcher(cmd: Sequence[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)``; past the
    timeout the test fails with the last 3,000 characters of stdout and stderr."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(
            f"{cmd[:4]} ran past {timeout} s\n--- stdout ---\n{out[-3000:]}\n--- stderr ---\n{err[-3000:]}"
        )
