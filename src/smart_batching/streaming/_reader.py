"""Reading a stream source in chunks: examples or plain lengths, from a position."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from smart_batching.errors import DataError
from smart_batching.plan import as_lengths
from smart_batching.streaming._buffer import _EMPTY, _END, _READ_EXAMPLES, _READ_LENGTHS

# --- Reading the source ------------------------------------------------------------------------------


def _is_opener(source: Any) -> bool:
    return callable(source) and not isinstance(source, Iterable)


class _Reader:
    """Reads a source from a position on, in chunks of lengths (and the examples, when it yields them).

    The source's items decide its kind, from the first one: mappings (or anything, with ``length_fn``)
    are examples; integers are lengths; 1-D integer arrays are chunks of lengths.
    """

    def __init__(self, source: Any, length_fn: Callable[[Any], int] | None, start: int) -> None:
        if _is_opener(source):
            self._it: Iterator[Any] = iter(source(start))
            self.pos = start
        else:
            self._it = iter(source)
            self.pos = 0
        self.length_fn = length_fn
        self.kind: str | None = None  # "examples" | "lengths" | "chunks"
        self._chunk = _EMPTY
        self._chunk_at = 0

    def _detect(self) -> bool:
        first = next(self._it, _END)
        if first is _END:
            return False
        self._it = itertools.chain([first], self._it)
        if self.length_fn is not None or isinstance(first, Mapping):
            self.kind = "examples"
        elif isinstance(first, np.ndarray) and first.ndim == 1:
            self.kind = "chunks"
        elif isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            self.kind = "lengths"
        else:
            raise DataError(
                f"cannot batch stream items of type {type(first).__name__}: yield mappings with 'input_ids', "
                "integer token lengths or 1-D arrays of lengths, or pass length_fn="
            )
        return True

    def _length(self, item: Any) -> int:
        if self.length_fn is not None:
            return int(self.length_fn(item))
        try:
            return len(item["input_ids"])
        except (KeyError, TypeError) as exc:
            keys = sorted(item) if isinstance(item, Mapping) else type(item).__name__
            raise DataError(
                f"stream example at position {self.pos} has no 'input_ids' ({keys}); pass length_fn= to "
                "say how many tokens an example holds"
            ) from exc

    def read(self, n: int) -> tuple[np.ndarray, list[Any] | None] | None:
        """Up to ``n`` items from the current position (fewer at a chunk's end); None at the stream's end."""
        if self.kind is None and not self._detect():
            return None
        examples = None
        if self.kind == "examples":
            examples = list(itertools.islice(self._it, min(n, _READ_EXAMPLES)))
            if not examples:
                return None
            lengths = np.fromiter(map(self._length, examples), dtype=np.int64, count=len(examples))
        elif self.kind == "lengths":
            try:
                lengths = np.fromiter(itertools.islice(self._it, min(n, _READ_LENGTHS)), dtype=np.int64)
            except (TypeError, ValueError) as exc:
                raise DataError(f"stream of lengths near position {self.pos}: {exc}") from exc
            if lengths.size == 0:
                return None
        else:
            while self._chunk_at >= self._chunk.shape[0]:
                chunk = next(self._it, _END)
                if chunk is _END:
                    return None
                self._chunk = as_lengths(chunk, name=f"chunk of lengths at stream position {self.pos}")
                self._chunk_at = 0
            lengths = self._chunk[self._chunk_at : self._chunk_at + n]
            self._chunk_at += lengths.shape[0]
        if lengths.size and lengths.min() < 0:
            bad = int(np.flatnonzero(lengths < 0)[0])
            raise DataError(
                f"stream example at position {self.pos + bad} has a negative length {int(lengths[bad])}"
            )
        self.pos += lengths.shape[0]
        return lengths, examples
