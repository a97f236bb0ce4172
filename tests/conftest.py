"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module of tiny models: faster, and far faster on a busy CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _fresh_fallbacks():
    """Each test sees its own fallback warnings and counts (they warn once per process otherwise)."""
    from smart_batching.fallbacks import reset_fallbacks

    reset_fallbacks()
    yield
