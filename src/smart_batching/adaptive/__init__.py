"""Adaptive batch size: the largest token budget that fits device memory (:mod:`.autotune`).

Importing this package loads no torch; :func:`~.autotune.find_max_tokens` does, when called.
"""

from __future__ import annotations

from smart_batching.adaptive.autotune import (
    DEFAULT_CANDIDATES,
    accumulation_steps_for,
    costliest_batch_shape,
    find_max_tokens,
)

__all__ = ["DEFAULT_CANDIDATES", "accumulation_steps_for", "costliest_batch_shape", "find_max_tokens"]
