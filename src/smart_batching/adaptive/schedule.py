"""A schedule of the size of an optimizer step, as a function of what training has seen.

``batch_schedule=`` takes a :class:`BatchSchedule` or its text. Sizes and thresholds count the same
unit: tokens (the token-budget strategies) or examples (the fixed-size strategies), per optimizer step
over all ranks and accumulation micro-batches::

    linear:16384->131072@20%      16,384 tokens per step, rising linearly to 131,072 over the first 20 %
                                  of the first epoch's tokens, then 131,072
    linear:16Ki->64Ki@5M->128Ki@20M   two linear pieces (5M and 20M tokens seen)
    0:16k 5M:64k 20M:128k         16,000 per step from the start, 64,000 once 5M have been seen, ...

Counts take Megatron-LM's suffixes (``K`` 1e3, ``M`` 1e6, ``B`` or ``G`` 1e9, ``T`` 1e12; case does not
matter) and binary ones (``Ki`` 1,024, ``Mi`` 1,048,576, ``Gi``); ``N%`` is a share of the first
epoch's total, fixed when the plan is made (:meth:`BatchSchedule.resolve`; ``150%`` is half-way
through the second epoch). Any ratio between sizes is
allowed, not only integer factors.

The size of step ``s`` is the schedule's value at what steps ``0..s-1`` consumed (counted in the same
unit); :func:`cut_steps` cuts a stream of examples into such steps, each within one example of its
target. The value is pure: no torch, no I/O.

    >>> s = BatchSchedule.parse("linear:100->300@1000")
    >>> [int(s.size_at(x)) for x in (0, 500, 1000, 5000)]
    [100, 200, 300, 300]
    >>> cut_steps(np.full(12, 50), BatchSchedule.parse("0:100 300:200")).tolist()
    [0, 2, 4, 6, 10, 12]
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.plan import offsets_of

UNITS = ("tokens", "examples")

_SUFFIX = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "b": 10**9,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ki|mi|gi|k|m|b|g|t)?\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*%\s*$")


@dataclass(frozen=True)
class SchedulePoint:
    """One point of a schedule: from ``at`` seen (a count, or ``share`` of the epoch's total), ``size``
    per step."""

    size: int
    at: int | None = 0
    share: float | None = None

    def position(self, total: int | None) -> int:
        if self.share is None:
            return int(self.at)
        if total is None:
            raise ConfigError(
                f"batch_schedule: a threshold of {self.share:.4g}% needs the epoch's total; resolve the "
                "schedule against the plan (BatchSchedule.resolve(total)) or give a count instead"
            )
        return int(round(self.share / 100.0 * total))


@dataclass(frozen=True)
class BatchSchedule:
    """Size of an optimizer step (all ranks, all micro-batches) as a function of what was seen.

    Attributes:
        kind: ``"linear"`` (linear between points, the last size after) or ``"steps"`` (each size
            from its threshold on).
        points: Thresholds in rising order; the first is at 0.
        unit: ``"tokens"`` or ``"examples"``; None: the strategy's (tokens for a token budget, examples
            for a fixed batch size).
    """

    kind: str
    points: tuple[SchedulePoint, ...]
    unit: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "steps"):
            raise ConfigError(f"batch_schedule: kind={self.kind!r} must be 'linear' or 'steps'")
        if self.unit is not None and self.unit not in UNITS:
            raise ConfigError(f"batch_schedule: unit={self.unit!r} must be one of {', '.join(UNITS)} or None")
        if not self.points:
            raise ConfigError("batch_schedule: give at least one size")
        first = self.points[0]
        if first.share not in (None, 0.0) or (first.share is None and first.at != 0):
            raise ConfigError(
                f"batch_schedule {self}: the first threshold must be 0 (the size training starts with)"
            )
        for p in self.points:
            if p.size < 1:
                raise ConfigError(f"batch_schedule {self}: sizes must be positive, got {p.size}")
        keys = [(p.share is not None, p.share if p.share is not None else p.at) for p in self.points]
        for (rel_a, a), (rel_b, b) in zip(keys, keys[1:], strict=False):
            if rel_a == rel_b and b <= a:
                raise ConfigError(
                    f"batch_schedule {self}: thresholds must rise ({a:g} then {b:g}); list them in order"
                )

    # -- text ------------------------------------------------------------------------------------------

    @classmethod
    def parse(cls, text: Any, *, unit: str | None = None) -> BatchSchedule:
        """A schedule from its text (see the module docstring); a :class:`BatchSchedule` passes through
        (its unit filled in from ``unit`` when it has none).

        Raises:
            ConfigError: the text does not parse; the message shows the expected forms.
        """
        if isinstance(text, BatchSchedule):
            return text if text.unit is not None or unit is None else cls(text.kind, text.points, unit)
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"batch_schedule={text!r} must be a schedule text. {_FORMS}")
        body = text.strip()
        try:
            if body.lower().startswith("linear:"):
                return cls("linear", _linear_points(body[len("linear:") :]), unit)
            return cls("steps", _step_points(body), unit)
        except ConfigError as exc:
            if str(exc).startswith("batch_schedule "):
                raise
            raise ConfigError(f"batch_schedule={text!r}: {exc}. {_FORMS}") from None

    def __str__(self) -> str:
        def where(p: SchedulePoint) -> str:
            return f"{p.share:g}%" if p.share is not None else str(p.at)

        if self.kind == "linear":
            parts = [str(self.points[0].size)] + [f"{p.size}@{where(p)}" for p in self.points[1:]]
            return "linear:" + "->".join(parts)
        return " ".join(f"{where(p)}:{p.size}" for p in self.points)

    # -- values ----------------------------------------------------------------------------------------

    def with_unit(self, unit: str) -> BatchSchedule:
        return BatchSchedule(self.kind, self.points, unit)

    @property
    def is_resolved(self) -> bool:
        return all(p.share is None for p in self.points)

    def resolve(self, total: int) -> BatchSchedule:
        """The same schedule with every ``N%`` threshold turned into a count of ``total`` (the first
        epoch's tokens or examples). Thresholds that come out equal or falling are refused."""
        if self.is_resolved:
            return self
        points = tuple(SchedulePoint(p.size, p.position(int(total))) for p in self.points)
        return BatchSchedule(self.kind, points, self.unit)

    def _xy(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.is_resolved:
            raise ConfigError(
                f"batch_schedule {self}: a threshold is a share of the epoch; resolve(total) it first"
            )
        x = np.array([p.at for p in self.points], dtype=np.float64)
        y = np.array([p.size for p in self.points], dtype=np.float64)
        return x, y

    def size_at(self, seen: Any) -> Any:
        """Step size once ``seen`` units were consumed (a number or an array of them)."""
        x, y = self._xy()
        seen_arr = np.asarray(seen, dtype=np.float64)
        if self.kind == "linear":
            out = np.rint(np.interp(seen_arr, x, y)).astype(np.int64)
        else:
            out = y[np.searchsorted(x, seen_arr, side="right") - 1].astype(np.int64)
        return out if out.ndim else int(out)

    @property
    def initial_size(self) -> int:
        return self.points[0].size

    @property
    def final_size(self) -> int:
        return self.points[-1].size

    @property
    def max_size(self) -> int:
        return max(p.size for p in self.points)

    def end_of_change(self, total: int | None = None) -> int:
        """Units seen after which the size no longer changes (the last threshold)."""
        return self.points[-1].position(total)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_schedule": str(self), "unit": self.unit}


_FORMS = (
    "Expected 'linear:START->END@OVER' (OVER a count such as 5M or a share such as 20%; more pieces "
    "with ->SIZE@AT) or 'AT:SIZE AT:SIZE ...' starting at 0 (e.g. '0:16k 5M:64k 20M:128k'); counts take "
    "K/M/B/T (1e3..1e12) or Ki/Mi/Gi (1024..)"
)


def schedule_unit(spec: Any) -> str:
    """What a strategy's steps are counted in: tokens where a token budget bounds its micro-batches
    (``max_tokens``, ``capacity``), examples where a batch size does."""
    return "tokens" if getattr(spec, "budget_option", None) else "examples"


def parse_count(text: str) -> int:
    """``"16k"`` -> 16000, ``"16Ki"`` -> 16384, ``"2.5M"`` -> 2500000.

    Raises:
        ConfigError: not a count.
    """
    m = _AMOUNT.match(text)
    if not m:
        raise ConfigError(f"{text.strip()!r} is not a count")
    value = float(m.group(1)) * _SUFFIX[(m.group(2) or "").lower()]
    if value != int(value):
        raise ConfigError(f"{text.strip()!r} is not a whole count")
    return int(value)


def _threshold(text: str) -> tuple[int | None, float | None]:
    m = _PERCENT.match(text)
    if m:
        return None, float(m.group(1))  # over 100 %: past the first epoch
    return parse_count(text), None


def _linear_points(body: str) -> tuple[SchedulePoint, ...]:
    parts = [p for p in body.split("->")]
    if len(parts) < 2:
        raise ConfigError("a linear schedule needs START->END@OVER")
    points = [SchedulePoint(parse_count(parts[0]))]
    for part in parts[1:]:
        if "@" not in part:
            raise ConfigError(f"{part.strip()!r} needs @OVER (where the ramp reaches it)")
        size, where = part.split("@", 1)
        at, share = _threshold(where)
        points.append(SchedulePoint(parse_count(size), at, share))
    return tuple(points)


def _step_points(body: str) -> tuple[SchedulePoint, ...]:
    items = [t for t in re.split(r"[\s,]+", body) if t]
    points = []
    for item in items:
        if item.count(":") != 1:
            raise ConfigError(f"{item!r} is not AT:SIZE")
        where, size = item.split(":")
        at, share = _threshold(where)
        points.append(SchedulePoint(parse_count(size), at, share))
    return tuple(points)


def cut_steps(weights: np.ndarray, schedule: BatchSchedule, *, seen: int = 0) -> np.ndarray:
    """Cut a stream of examples into optimizer steps that follow ``schedule``.

    Step ``s`` starts where step ``s-1`` ended and ends where its weight comes closest to the
    schedule's size at what was seen before it (``seen`` plus the weight of steps ``0..s-1``): so a
    step misses its target by at most half of the example that crosses it, and holds at least one.

    Args:
        weights: (num_examples,) weight of each example in stream order: its tokens, or ones to count
            examples.
        schedule: A resolved schedule (no ``N%`` thresholds).
        seen: Weight consumed before the stream starts (a resumed stream, a later epoch).

    Returns:
        (num_steps + 1,) int64 offsets into the stream: step ``s`` is ``[offsets[s], offsets[s+1])``.

    One ``searchsorted`` per step over the cumulative weights: O(num_steps log num_examples).
    """
    w = np.asarray(weights, dtype=np.int64)
    n = w.shape[0]
    csum = offsets_of(w)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    x, y = schedule._xy()
    offsets = [0]
    pos = 0
    while pos < n:  # one iteration per step, O(log n) inside
        done = seen + int(csum[pos])
        size = int(y[-1]) if done >= x[-1] else int(schedule.size_at(done))
        pos = _closest_end(csum, pos, int(csum[pos]) + size)
        offsets.append(pos)
    return np.asarray(offsets, dtype=np.int64)


def _closest_end(csum: np.ndarray, pos: int, goal: int) -> int:
    """The end ``e > pos`` whose cumulative weight ``csum[e]`` is closest to ``goal`` (ties: shorter)."""
    n = csum.shape[0] - 1
    j = int(np.searchsorted(csum, goal, side="left"))
    if j > n:
        return n
    if j <= pos + 1:
        return pos + 1
    return j - 1 if goal - csum[j - 1] <= csum[j] - goal else j


__all__ = ["UNITS", "BatchSchedule", "SchedulePoint", "cut_steps", "parse_count", "schedule_unit"]
