"""The CUDA tier: the device these tests run on, and what they share.

Every test module here sets ``pytestmark = pytest.mark.cuda`` (``pytest -m cuda tests/cuda``; ``scripts/device_check.sh`` runs it on a
GPU machine). The ``device`` fixture gives ``cuda`` where CUDA is available. Without it the tests skip,
unless ``SMART_BATCHING_CUDA_TIER_ON_CPU=1``: the dry run, where the same comparisons run on the CPU and
only what is about a fused CUDA kernel skips (with the reason), so the tier is proven before a GPU comes.

Nothing here reads a model hub or tokenizer assets: models are built from configs with random weights
and fed token ids.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from cuda_tier import DRY_RUN_ENV  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda`` where available; the CPU for the dry run (``SMART_BATCHING_CUDA_TIER_ON_CPU=1``); else skip."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get(DRY_RUN_ENV) == "1":
        return torch.device("cpu")
    pytest.skip(f"needs a CUDA device (or {DRY_RUN_ENV}=1 for the dry run on CPU)")


@pytest.fixture(autouse=True)
def _cuda_peak(request, device):
    """Start each test from an empty CUDA cache and a reset peak; print the peak it reached (``-rA``)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    yield
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
        print(f"[cuda tier] {request.node.nodeid}: peak torch.cuda.max_memory_allocated {peak:.1f} MiB")
        torch.cuda.empty_cache()
