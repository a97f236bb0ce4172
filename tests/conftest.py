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
