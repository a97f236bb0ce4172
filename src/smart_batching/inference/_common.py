"""Helpers shared by generation and encoding: defaults, argument checks, batch plans, progress."""

from __future__ import annotations

from typing import Any

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.planners import TokenBudgetSpec, plan_batches

DEFAULT_MAX_TOKENS = {"cpu": 2048, "cuda": 65536}
"""Default token budget per batch (padded tokens, prompt + new tokens for generation) by device type."""

POOLINGS = ("mean", "cls", None)


def _default_max_tokens(model: Any) -> int:
    device = getattr(model, "device", None)
    return DEFAULT_MAX_TOKENS["cuda" if getattr(device, "type", "cpu") == "cuda" else "cpu"]


def _check_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}= must be an integer >= {minimum}, got {value!r}")


def _plan_indices(
    indices: np.ndarray, lengths: np.ndarray, max_tokens: int, max_batch_size: int | None
) -> list[np.ndarray]:
    """Token-budget batches over ``indices`` (positions into ``lengths``), widest batch first.

    Rows longer than the budget run alone: one row is the least memory they can take.
    """
    over = lengths[indices] > max_tokens
    fit = indices[~over]
    batches: list[np.ndarray] = [indices[over][i : i + 1] for i in range(int(over.sum()))]
    if fit.size:
        plan = plan_batches(
            lengths[fit], TokenBudgetSpec(max_tokens=max_tokens, max_batch_size=max_batch_size)
        )
        batches.extend(fit[b] for b in plan)
    # Widest first, so that running out of memory shows in the first batch, not the last.
    return sorted(batches, key=lambda b: -int(lengths[b].max()) * len(b))


def _progress(total: int, desc: str, unit: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
