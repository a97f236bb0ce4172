"""What a :class:`~smart_batching.streaming.StreamingBatcher` reports, and its settings checks."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError


@dataclass(frozen=True)
class StreamingStats:
    """Running figures of a :class:`StreamingBatcher`. Tokens count token positions.

    Batches count once planned (emitted by a round), including those queued but not yet yielded.

    Attributes:
        num_examples: examples read from the source so far.
        efficiency: real tokens / token slots of the emitted batches (1.0: no padding).
        num_buffered: segments in the buffer now; ``max_buffered`` the most it has held.
        num_empty, num_masked: examples left out before planning: no tokens, no target token.
    """

    strategy: str
    num_examples: int
    num_segments: int
    num_batches: int
    num_rows: int
    real_tokens: int
    token_slots: int
    efficiency: float
    padding_ratio: float
    num_over_limit: int
    num_truncated: int
    truncated_tokens: int
    num_split: int
    num_dropped: int
    dropped_tokens: int
    num_empty: int
    num_masked: int
    num_rounds: int
    num_buffered: int
    max_buffered: int
    max_buffered_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_COUNTERS = (
    "num_examples",
    "num_segments",
    "num_batches",
    "num_rows",
    "real_tokens",
    "token_slots",
    "num_over_limit",
    "num_truncated",
    "truncated_tokens",
    "num_split",
    "num_dropped",
    "dropped_tokens",
    "num_empty",
    "num_masked",
    "max_buffered",
    "max_buffered_tokens",
)


def _positive_or_none(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name}= must be a positive integer or None, got {value!r}")
    return int(value)


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"{name}= must be a non-negative integer, got {value!r}")
    return int(value)
