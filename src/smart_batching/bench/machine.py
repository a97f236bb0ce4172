"""What a benchmark ran on and what it used: machine, versions, peak memory.

Numbers without the machine they came from cannot be compared, so every bench record carries
:func:`machine_info` (CPU model, cores, torch device, load average) and :func:`versions`.

Peak memory is CUDA's ``max_memory_allocated`` on a GPU. On CPU there is no per-run allocator
counter, so :class:`PeakMemory` samples the process RSS from a background thread (every 10 ms by
default); it is process-wide and includes what earlier runs left allocated, which is why the runner
frees and trims the heap before each run.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import threading
import time
from typing import Any

from smart_batching.adaptive.backoff import free_memory


def cpu_model() -> str:
    """The CPU model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info(device: Any = None) -> dict[str, Any]:
    """The machine a bench runs on, JSON-ready.

    Args:
        device: the torch device the bench trains on; None means CUDA when available, else CPU.
    """
    import torch

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": dev.type,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "platform": platform.platform(),
        "hostname": platform.node(),
        "memory_gb": _total_memory_gb(),
        "load_average": load_average(),
    }
    return info


def _total_memory_gb() -> float | None:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        return None


def versions() -> dict[str, str]:
    """Versions of the packages whose behaviour a bench measures."""
    import torch
    import transformers

    from smart_batching import __version__

    out = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "smart_batching": __version__,
    }
    for name in ("accelerate", "datasets", "numpy"):
        with contextlib.suppress(ImportError):
            out[name] = __import__(name).__version__
    return out


def machine_line(machine: dict[str, Any]) -> str:
    """One line naming the machine, for tables and reports."""
    dev = machine.get("device", "?")
    gpu = f" ({machine['gpu']})" if machine.get("gpu") else ""
    load = machine.get("load_average")
    load_s = f", load average {load[0]:.1f} at start" if load else ""
    procs = machine.get("processes") or 1
    threads = (
        f"{procs} processes x {machine.get('torch_threads', '?')}"
        if procs > 1
        else machine.get("torch_threads", "?")
    )
    return (
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, torch device {dev}{gpu}, "
        f"{threads} torch threads{load_s}"
    )


def release_memory() -> None:
    """Collect garbage, empty the CUDA cache (:func:`~smart_batching.adaptive.backoff.free_memory`) and
    hand freed heap back to the OS (glibc ``malloc_trim``)."""
    free_memory()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # pragma: no cover - not glibc
            pass


class PeakMemory:
    """Peak memory over a block: CUDA max allocated, or the sampled process RSS on CPU.

    Use as a context manager; afterwards ``peak_mb``, ``start_mb`` and ``kind`` are set::

        with PeakMemory("cpu") as mem:
            trainer.train()
        mem.peak_mb, mem.kind     # (1234.5, "cpu_rss_peak")
    """

    def __init__(self, device: Any = "cpu", *, interval: float = 0.01) -> None:
        import torch

        self.device = torch.device(device)
        self.interval = interval
        self.kind = "cuda_max_allocated" if self.device.type == "cuda" else "cpu_rss_peak"
        self.start_mb: float | None = None
        self.peak_mb: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._process: Any = None

    def __enter__(self) -> PeakMemory:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mb = torch.cuda.memory_allocated(self.device) / 2**20
            return self
        try:
            import psutil
        except ImportError:  # pragma: no cover - fall back to the lifetime peak
            self.kind = "cpu_ru_maxrss"
            return self
        self._process = psutil.Process()
        self.start_mb = self._process.memory_info().rss / 2**20
        self.peak_mb = self.start_mb
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = self._process.memory_info().rss / 2**20
            if rss > (self.peak_mb or 0.0):
                self.peak_mb = rss
            time.sleep(self.interval)

    def __exit__(self, *exc: Any) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
            return
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            rss = self._process.memory_info().rss / 2**20
            self.peak_mb = max(self.peak_mb or 0.0, rss)
        else:  # pragma: no cover
            import resource

            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


__all__ = [
    "PeakMemory",
    "cpu_model",
    "load_average",
    "machine_info",
    "machine_line",
    "release_memory",
    "usable_cores",
    "versions",
]
