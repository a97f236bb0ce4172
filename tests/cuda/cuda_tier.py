"""Helpers of the CUDA tier's tests (a module of its own: ``conftest`` is not importable by name)."""

from __future__ import annotations

import pytest
import torch

DRY_RUN_ENV = "SMART_BATCHING_CUDA_TIER_ON_CPU"


def needs_cuda(device: torch.device, what: str) -> None:
    """Skip the rest of a test on the dry run: ``what`` is about a CUDA kernel or CUDA memory."""
    if device.type != "cuda":
        pytest.skip(f"dry run on {device.type}: {what} needs CUDA")


def to_device(batch: dict, device: torch.device) -> dict:
    """A collated batch with its tensors (nested dicts too: DPO's packed row) on ``device``."""
    moved = {}
    for key, value in batch.items():
        if torch.is_tensor(value):
            value = value.to(device)
        elif isinstance(value, dict):
            value = to_device(value, device)
        moved[key] = value
    return moved
