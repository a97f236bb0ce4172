"""Held-out loss during training (``eval_every``) and the time each run takes to reach a target loss.

* :func:`parse_eval_every` reads a cadence: ``5`` (every 5 optimizer steps), ``"20000tok"`` (each time
  another 20,000 real training tokens have gone by) or ``"auto"`` (:func:`auto_cadence`).
* :class:`~.measure.HeldOutCurve` is a ``TrainerCallback`` that evaluates the model on the bench's fixed held-out
  set at that cadence and keeps, at each point, the held-out loss with the optimizer steps, real tokens,
  examples, and the wall and process CPU seconds of *training* so far. Evaluation time is kept out of
  those clocks and counted beside them (``eval_wall_seconds``, ``eval_cpu_seconds``), as MLPerf and
  AlgoPerf keep untimed evaluations out of time to quality.
* :func:`time_to_target` reads a curve: the first point whose held-out loss is at or below a target.

A curve has a point at step 0 (the initial weights, evaluated once per bench), one at each epoch's end
and one at the end of training (the final evaluation every run has), so time to target needs no evaluation of its own when
the cadence is off; the cadence only makes the points between them.

A run's curve in its record (``eval_curve``)::

    {"step": [0, 5, 10, 15], "tokens": [0, 41312, 82790, 124001], "examples": [...],
     "wall_seconds": [0.0, 9.8, 19.1, 28.0], "cpu_seconds": [...], "epoch": [0.0, 0.33, 0.67, 1.0],
     "loss": [15.6, 9.1, 7.4, 6.8],
     "eval_wall_seconds": 4.2, "eval_cpu_seconds": 4.1, "every": {"steps": 5, "tokens": None}}
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from smart_batching.errors import ConfigError
from smart_batching.planners import BASELINE_STRATEGY

AUTO_EVAL_COST = 0.10
"""Share of the training compute the ``"auto"`` cadence gives the evaluations (at most)."""
AUTO_MAX_POINTS = 16
"""Most evaluations per run under ``"auto"`` (besides the initial and the final one)."""
_TOKENS = re.compile(r"^\s*(\d[\d_,]*)\s*(tok|tokens)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class EvalEvery:
    """An evaluation cadence: every ``steps`` optimizer steps, or every ``tokens`` real training tokens.

    Exactly one of the two is set (``auto`` resolves to one of them before training).
    """

    steps: int | None = None
    tokens: int | None = None
    auto: bool = False

    def __post_init__(self) -> None:
        if self.auto:
            return
        if (self.steps is None) == (self.tokens is None):
            raise ConfigError(
                "eval_every= takes a step count or a token count (e.g. 5 or '20000tok'), not both"
            )
        value = self.steps if self.steps is not None else self.tokens
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"eval_every={value!r} must be a positive number of steps or tokens")

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "tokens": self.tokens}


def parse_eval_every(value: Any) -> EvalEvery | None:
    """A cadence from ``5``, ``"5"``, ``"20000tok"``, ``"auto"``; None (or ``0``, ``"off"``) means off.

    >>> parse_eval_every("20000tok")
    EvalEvery(steps=None, tokens=20000, auto=False)
    >>> parse_eval_every(5)
    EvalEvery(steps=5, tokens=None, auto=False)

    Raises:
        ConfigError: anything else, with the accepted forms.
    """
    if value is None or isinstance(value, EvalEvery):
        return value
    if isinstance(value, bool):
        raise ConfigError(f"eval_every={value!r}: give a step count, 'Ntok' or 'auto'")
    if isinstance(value, int):
        return None if value == 0 else EvalEvery(steps=value)
    text = str(value).strip()
    if text.lower() in ("", "0", "off", "none"):
        return None
    if text.lower() == "auto":
        return EvalEvery(auto=True)
    if text.isdigit():
        return EvalEvery(steps=int(text))
    match = _TOKENS.match(text)
    if match:
        return EvalEvery(tokens=int(match.group(1).replace(",", "").replace("_", "")))
    raise ConfigError(
        f"eval_every={value!r} is not a cadence: give optimizer steps (5), real training tokens "
        "('20000tok'), 'auto' or 'off'"
    )


def auto_cadence(train_tokens: int, eval_tokens: int, num_steps: int) -> EvalEvery:
    """The ``"auto"`` cadence: evaluations costing about :data:`AUTO_EVAL_COST` of the training compute.

    An evaluation is a forward pass over ``eval_tokens`` (about a third of a training step's work per
    token: no backward pass), so evaluating every ``eval_tokens / (3 * AUTO_EVAL_COST)`` training tokens
    spends about that share; at most :data:`AUTO_MAX_POINTS` evaluations, at least one step apart.

    Args:
        train_tokens: real tokens the run trains on (all epochs).
        eval_tokens: real tokens of the held-out set.
        num_steps: optimizer steps of the run (all epochs, about).
    """
    every = max(eval_tokens / (3.0 * AUTO_EVAL_COST), train_tokens / (AUTO_MAX_POINTS + 1))
    every = max(every, train_tokens / max(1, num_steps))
    return EvalEvery(tokens=int(math.ceil(every)))


# --------------------------------------------------------------------------------------------------
# Time to target
# --------------------------------------------------------------------------------------------------

TTT_KEYS = ("wall_seconds", "cpu_seconds", "tokens", "step")


def epoch_losses(curve: dict[str, Any] | None) -> dict[int, float]:
    """Held-out loss at each epoch's end (epoch number -> loss), from a run's ``eval_curve``."""
    if not curve or "epoch" not in curve:
        return {}
    return {
        int(e): float(v)
        for e, v in zip(curve["epoch"], curve["loss"], strict=True)
        if e is not None and e >= 1 and float(e).is_integer()
    }


def time_to_target(curve: dict[str, Any] | None, target: float) -> dict[str, Any]:
    """Wall seconds, CPU seconds, real tokens and optimizer steps until the held-out loss first reaches
    ``target`` (at or below it), read from a run's ``eval_curve``; the first point that does (no
    interpolation: the cadence is the resolution).

    Returns:
        ``{"target", "reached", "wall_seconds", "cpu_seconds", "tokens", "steps", "reason"}``; the
        measures are None and ``reason`` says why where the curve never reaches the target.
    """
    out: dict[str, Any] = {"target": target, "reached": False, "reason": None}
    out.update({k: None for k in ("wall_seconds", "cpu_seconds", "tokens", "steps")})
    if not curve or not curve.get("loss"):
        out["reason"] = "no held-out curve in the record"
        return out
    for i, loss in enumerate(curve["loss"]):
        if loss is not None and loss <= target:
            out.update(
                reached=True,
                wall_seconds=curve["wall_seconds"][i],
                cpu_seconds=curve["cpu_seconds"][i],
                tokens=curve["tokens"][i],
                steps=curve["step"][i],
            )
            return out
    best = min(v for v in curve["loss"] if v is not None)
    out["reason"] = f"never reached: best held-out loss {best:.4f} > target {target:.4f}"
    return out


def default_targets(
    records: Sequence[dict[str, Any]], baseline: str = BASELINE_STRATEGY
) -> dict[tuple[str, int], float]:
    """The default target of each run: the final held-out loss of ``baseline`` for the same bench and
    seed (keyed by ``(bench_id, seed)``)."""
    out: dict[tuple[str, int], float] = {}
    for r in records:
        if (
            r.get("strategy") == baseline
            and r.get("status") == "ok"
            and (r.get("eval") or {}).get("loss") is not None
        ):
            out[(str(r.get("bench_id")), int(r["seed"]))] = float(r["eval"]["loss"])
    return out


def run_target(
    record: dict[str, Any], records: Sequence[dict[str, Any]], target: float | None = None
) -> float | None:
    """The target of ``record``: ``target`` when given, else the final held-out loss of ``random`` with
    the same bench and seed among ``records`` (None when there is none)."""
    if target is not None:
        return float(target)
    return default_targets(records).get((str(record.get("bench_id")), int(record["seed"])))


def attach_time_to_target(
    record: dict[str, Any], records: Sequence[dict[str, Any]], target: float | None = None
) -> dict[str, Any]:
    """Set ``record["time_to_target"]`` (:func:`time_to_target` against :func:`run_target`); returns it."""
    if record.get("status") != "ok":
        return record
    goal = run_target(record, [*records, record], target)
    if goal is None:
        record["time_to_target"] = {
            "target": None, "reached": False, "wall_seconds": None, "cpu_seconds": None, "tokens": None,
            "steps": None, "reason": "no target: no --target and no random run with this seed",
        }  # fmt: skip
    else:
        record["time_to_target"] = time_to_target(record.get("eval_curve"), goal)
    return record


__all__ = [
    "AUTO_EVAL_COST",
    "EvalEvery",
    "attach_time_to_target",
    "auto_cadence",
    "default_targets",
    "epoch_losses",
    "parse_eval_every",
    "run_target",
    "time_to_target",
]
