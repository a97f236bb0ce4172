"""No silent fallback: a slower or different path than asked for is warned about once and recorded.

Where the library cannot take the path the user asked for, or the one its default promises (the
continuous decoding loop, the fused varlen attention kernel, target-only logits), it takes another
that gives the same results, and says so: :func:`warn_fallback` issues one
:class:`FallbackWarning` per kind of fallback and process, naming the reason and what to change, and
counts every occurrence. Results that have stats carry the reason too
(:attr:`~smart_batching.inference.GenerationStats.fallback`); :func:`recorded_fallbacks` gives the
process-wide counts, which the bench writes into its records.

Silence them like any warning: ``warnings.filterwarnings("ignore", category=FallbackWarning)``.
"""

from __future__ import annotations

import threading
import warnings

_lock = threading.Lock()
_counts: dict[str, int] = {}
_warned: set[str] = set()


class FallbackWarning(UserWarning):
    """smart batching took a slower or different path than the one asked for (same results)."""


def warn_fallback(kind: str, message: str, *, stacklevel: int = 3) -> None:
    """Count one fallback of ``kind`` and warn the first time ``kind`` occurs in this process.

    Args:
        kind: A short stable key (``"generate.continuous"``, ``"attention.varlen"``...).
        message: What happened, why, and which setting to change.
        stacklevel: As for :func:`warnings.warn` (the default points at the caller's caller).
    """
    with _lock:
        _counts[kind] = _counts.get(kind, 0) + 1
        first = kind not in _warned
        _warned.add(kind)
    if first:
        warnings.warn(f"smart batching fell back ({kind}): {message}", FallbackWarning, stacklevel=stacklevel)


def recorded_fallbacks() -> dict[str, int]:
    """How often each kind of fallback happened in this process since the last reset."""
    with _lock:
        return dict(_counts)


def reset_fallbacks() -> None:
    """Forget the counts and warn again on the next fallback of each kind (tests, bench runs)."""
    with _lock:
        _counts.clear()
        _warned.clear()


__all__ = ["FallbackWarning", "recorded_fallbacks", "reset_fallbacks", "warn_fallback"]
