"""Compare batching strategies on one dataset: padding, compute and what happened to long examples.

:func:`analyze` plans one epoch per strategy on the same token lengths with shared settings and
returns one record (a plain dict, JSON-ready) per strategy; :func:`format_table` renders records as
a text table. Measuring and rendering are separate: the CLI prints the table or the JSON records,
:mod:`smart_batching.analysis.plots` draws them.

Shared settings, so the rows compare like with like:

* ``batch_size`` examples per batch for the fixed-size strategies (``random``, ``max_length``,
  ``group_by_length``);
* ``max_tokens`` padded tokens per batch for ``token_budget``; by default ``batch_size`` times the
  95th-percentile length, rounded up to a multiple of 64, so a token-budget batch costs about what a
  typical fixed-size batch does;
* ``capacity`` tokens per packed row for ``packed`` (one row per batch); by default ``max_tokens``, at
  most the planner's own limit (262,143 tokens), so a default never asks for what the planner refuses;
* one per-example limit, ``min(max_tokens, capacity)`` tokens, for every strategy, with the same
  ``overlong`` policy. Examples over it are truncated, split or dropped, never silently: every
  record carries ``num_over_limit``, ``num_truncated``, ``num_split`` and ``num_dropped``.

Next to the padding, each record measures the randomness the strategy gives up for it
(:func:`~smart_batching.analysis.batch_randomness`): how much one batch's length predicts the next one's,
and how often examples that share a batch (a row, when packing) share one again the next epoch. This
plans a second epoch per strategy.

Row names are registered strategy names, optionally with a variant in brackets:
``group_by_length[sorted]`` (``mode="sorted"``), ``packed[ffd]`` (``algorithm="ffd"``).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np

from smart_batching.analysis.randomness import pairs_cell, randomness_record
from smart_batching.errors import ConfigError, DataError, OverlongError
from smart_batching.plan import as_lengths
from smart_batching.planners import (
    OVERLONG_POLICIES,
    Knobs,
    analysis_rows,
    make_spec,
    option_limit,
    parse_strategy,
    plan_batches,
    spec_class,
)
from smart_batching.units import plan_units

DEFAULT_STRATEGIES = analysis_rows()
"""Rows shown by default: every built-in strategy and its ``name[variant]`` rows (e.g. ``group_by_length[sorted]``)."""

TOKEN_ROUNDING = 64  # default max_tokens is rounded up to a multiple of this (a GPU-friendly size)


def length_summary(lengths: Any) -> dict[str, Any]:
    """Distribution of token lengths.

    Returns:
        ``n`` (examples), ``total`` (tokens), ``mean``, ``min``, ``p50``, ``p90``, ``p95``, ``p99``,
        ``max`` (tokens per example). Percentiles are floats; an empty input gives zeros.
    """
    arr = as_lengths(lengths)
    if arr.size == 0:
        return {
            "n": 0,
            "total": 0,
            "mean": 0.0,
            "min": 0,
            "p50": 0.0,
            "p90": 0.0,
            "p95": 0.0,
            "p99": 0.0,
            "max": 0,
        }
    p50, p90, p95, p99 = np.percentile(arr, [50, 90, 95, 99])
    return {
        "n": int(arr.size),
        "total": int(arr.sum()),
        "mean": float(arr.mean()),
        "min": int(arr.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p95": float(p95),
        "p99": float(p99),
        "max": int(arr.max()),
    }


def default_max_tokens(lengths: np.ndarray, batch_size: int) -> int:
    """``batch_size`` × the 95th-percentile length, rounded up to a multiple of 64 (at least 64)."""
    p95 = float(np.percentile(lengths, 95)) if lengths.size else 0.0
    raw = int(np.ceil(batch_size * p95))
    return max(TOKEN_ROUNDING, -(-raw // TOKEN_ROUNDING) * TOKEN_ROUNDING)


def _check_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name}= must be a positive integer, got {value!r}")


def analyze(
    lengths: Any,
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
    capacity: int | None = None,
    strategies: list[str] | tuple[str, ...] | None = None,
    seed: int = 0,
    overlong: str = "truncate",
    empty_examples: str = "skip",
    batch_schedule: Any = None,
    world_size: int = 1,
) -> list[dict[str, Any]]:
    """Plan one epoch with each strategy on the same lengths and measure padding, compute and randomness.

    Each strategy is also planned for epoch 1 (same seed), to measure how its batches change from one
    epoch to the next; that second plan is not counted in ``plan_seconds``.

    Args:
        lengths: (num_examples,) token lengths.
        batch_size: examples per batch for ``random``, ``max_length`` and ``group_by_length``.
        max_tokens: padded tokens per ``token_budget`` batch; None means ``batch_size`` × p95 length,
            rounded up to a multiple of 64.
        capacity: tokens per ``packed`` row; None means ``max_tokens``, at most the packed planner's
            limit (:func:`~smart_batching.planners.option_limit`).
        strategies: row names (see the module docstring); None means :data:`DEFAULT_STRATEGIES`.
        seed: seed of every plan (epoch 0, and epoch 1 for the randomness).
        overlong: policy for examples over ``min(max_tokens, capacity)`` tokens: ``"truncate"``,
            ``"split"``, ``"drop"`` or ``"error"``.
        empty_examples: examples with no tokens are left out of every plan (``"skip"``, counted in
            ``num_empty`` and named in one warning, as the samplers and the Trainer do) or refused
            (``"error"``).
        batch_schedule: a :class:`~smart_batching.adaptive.BatchSchedule` (or its text, counted in
            tokens unless the schedule says otherwise) realised on each plan over ``world_size`` ranks:
            each record then holds ``schedule`` (the realised schedule in numbers,
            :meth:`~smart_batching.adaptive.realise.SteppedPlan.summary`) and ``schedule_steps``
            (``size``, ``target`` and ``tokens`` of every step, all ranks).
        world_size: ranks the schedule's steps are balanced over.

    Returns:
        One dict per strategy, in the order asked: ``strategy``, ``efficiency`` (real tokens / token
        slots), ``padding_ratio``, ``padding_pct``, ``num_batches``, ``num_rows``, ``num_examples``,
        ``num_segments``, ``real_tokens``, ``token_slots``, ``padding_tokens``, ``relative_compute``
        (token slots / the fewest token slots of any row; None where that is 0 and this row's is
        not), ``mean_examples_per_batch``, ``max_slots_per_batch`` (peak padded tokens of one batch), ``num_over_limit``,
        ``num_truncated``, ``truncated_tokens``, ``num_split``, ``num_dropped``, ``dropped_tokens``,
        ``num_empty`` (examples left out with no tokens), ``lower_bound_rows`` and ``rows_over_lower_bound`` (packing, else None),
        ``order_corr``, ``pair_repeat`` and ``pair_repeat_random`` (batch randomness between epochs 0
        and 1, see :func:`~smart_batching.analysis.batch_randomness`; None where undefined), ``plan_seconds``
        (after a warm-up on 256 examples, so kernel compilation is not counted) and ``settings`` (the
        shared settings and the spec's fields).

    Raises:
        DataError: no examples.
        ConfigError: a setting is invalid (the message names it).
        OverlongError: ``overlong="error"`` and some example is over the limit.
    """
    arr = as_lengths(lengths)
    if arr.size == 0:
        raise DataError("the dataset has no examples: nothing to analyze")
    _check_int("batch_size", batch_size)
    _check_int("max_tokens", max_tokens, allow_none=True)
    _check_int("capacity", capacity, allow_none=True)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ConfigError(f"seed= must be a non-negative integer, got {seed!r}")
    if overlong not in OVERLONG_POLICIES:
        raise ConfigError(f"overlong= must be one of {', '.join(OVERLONG_POLICIES)}; got {overlong!r}")
    if isinstance(strategies, str):
        strategies = [strategies]
    names = list(analysis_rows() if strategies is None else strategies)
    if not names:
        raise ConfigError("strategies= is empty; name at least one strategy")
    parsed = [parse_strategy(name) for name in names]
    num_rows = int(arr.shape[0])
    units = plan_units(arr, empty_examples=empty_examples)
    arr = units.lengths if units.skipped.num_skipped else arr  # (num_units,) the examples planned

    max_tokens = default_max_tokens(arr, batch_size) if max_tokens is None else int(max_tokens)
    most = option_limit("capacity")  # the packed planner's limit: a default must respect it
    capacity = (max_tokens if most is None else min(max_tokens, most)) if capacity is None else int(capacity)
    limit = min(max_tokens, capacity)
    top = int(arr.max()) if arr.size else 0
    num_over = int(np.count_nonzero(arr > limit))
    if overlong == "error" and num_over:
        first = int(np.flatnonzero(arr > limit)[0])
        setting = "max_tokens" if max_tokens <= capacity else "capacity"
        raise OverlongError(
            f"{num_over} example(s) are longer than {setting}={limit} tokens (example {first} has "
            f"{int(arr[first])}); raise max_tokens= and capacity=, or choose overlong='truncate', "
            "'split' or 'drop'"
        )
    shared = {
        "batch_size": int(batch_size),
        "max_tokens": max_tokens,
        "capacity": capacity,
        "max_length": limit,
        "overlong": overlong,
        "seed": int(seed),
    }

    records = []
    for name, (base, variant) in zip(names, parsed, strict=True):
        knobs = Knobs(
            batch_size=batch_size, max_tokens=max_tokens, capacity=capacity, max_length=limit,
            overlong=overlong, longest=top,
        )  # fmt: skip
        options = spec_class(base).options_from(knobs)
        spec = make_spec(base, **options, **variant)
        # Warm-up on a few examples: loading or compiling the numba kernels is not planning time.
        plan_batches(arr[:256], spec, seed=seed)
        start = time.perf_counter()
        plan = plan_batches(arr, spec, seed=seed)
        seconds = time.perf_counter() - start
        record = _record(name, plan, seconds, shared, asdict(spec))
        record.update(randomness_record(plan, plan_batches(arr, spec, seed=seed, epoch=1)))
        record["num_examples"], record["num_empty"] = num_rows, units.skipped.num_empty
        if batch_schedule is not None:
            record.update(_schedule_record(plan, batch_schedule, world_size, seed))
        records.append(record)
    fewest = min(r["token_slots"] for r in records)
    for r in records:
        if fewest:
            r["relative_compute"] = r["token_slots"] / fewest
        else:  # only empty examples: a row with no slots costs nothing, any other has no finite ratio
            r["relative_compute"] = 1.0 if r["token_slots"] == 0 else None
    return records


def _schedule_record(plan: Any, batch_schedule: Any, world_size: int, seed: int) -> dict[str, Any]:
    """The schedule realised on ``plan``: its summary and every step's size, target and tokens."""
    from smart_batching.adaptive.realise import realise
    from smart_batching.adaptive.schedule import BatchSchedule

    schedule = BatchSchedule.parse(batch_schedule, unit="tokens")
    stepped = realise(plan, schedule, world_size=int(world_size), seed=seed)
    return {
        "schedule": {**stepped.summary(), "batch_schedule": str(schedule)},  # as given (shares unresolved)
        "schedule_steps": {
            "size": stepped.step_weight.tolist(),
            "target": stepped.step_targets.tolist(),
            "tokens": stepped.step_tokens.tolist(),
            "unit": stepped.schedule.unit,
            "world_size": int(world_size),
        },
    }


def format_schedule(records: list[dict[str, Any]]) -> str:
    """The realised batch schedule of each row, one line each (records of ``analyze(batch_schedule=)``)."""
    rows = [r for r in records if r.get("schedule")]
    if not rows:
        return ""
    first = rows[0]["schedule"]
    lines = [
        f"batch schedule {first['batch_schedule']} ({first['schedule_unit']} per optimizer step, "
        f"{rows[0]['schedule_steps']['world_size']} rank(s)):"
    ]
    width = max(len(r["strategy"]) for r in rows)
    for r in rows:
        s = r["schedule"]
        mb = s["micro_batches_per_step"]
        lines.append(
            f"  {r['strategy']:<{width}}  {s['num_steps']:>6,} steps, first {s['first_step_size']:,} -> last "
            f"{s['last_step_size']:,}, at most {s['max_abs_step_error']:,} off the schedule, "
            f"{mb['min']}-{mb['max']} micro-batches per step, rank imbalance {s['max_step_imbalance']:.3f}"
        )
    return "\n".join(lines)


def _record(name: str, plan: Any, seconds: float, shared: dict, spec_fields: dict) -> dict[str, Any]:
    st = plan.stats()
    ov = st.overlong
    slots = plan.slots_per_batch
    return {
        "strategy": name,
        "efficiency": st.efficiency if st.token_slots else None,  # None: no token slots (n/a)
        "padding_ratio": st.padding_ratio,
        "padding_pct": 100.0 * st.padding_ratio if st.token_slots else None,
        "num_batches": st.num_batches,
        "num_rows": st.num_rows,
        "num_examples": st.num_examples,
        "num_segments": st.num_segments,
        "real_tokens": st.real_tokens,
        "token_slots": st.token_slots,
        "padding_tokens": st.padding_tokens,
        "relative_compute": None,  # filled in once every strategy is planned
        "mean_examples_per_batch": st.num_segments / st.num_batches if st.num_batches else 0.0,
        "max_slots_per_batch": int(slots.max()) if slots.size else 0,
        "num_over_limit": ov.num_over_limit,
        "num_truncated": ov.num_truncated,
        "truncated_tokens": ov.truncated_tokens,
        "num_split": ov.num_split,
        "num_dropped": ov.num_dropped,
        "dropped_tokens": ov.dropped_tokens,
        "num_empty": 0,
        "lower_bound_rows": st.lower_bound_rows,
        "rows_over_lower_bound": st.rows_over_lower_bound,
        "order_corr": None,  # the randomness, filled in once epoch 1 is planned
        "pair_repeat": None,
        "pair_repeat_random": None,
        "plan_seconds": seconds,
        "settings": {**shared, "spec": {"strategy": plan.strategy, **spec_fields}},
    }


def _int(v: int) -> str:
    return f"{v:,}"


def _overlong_cell(r: dict[str, Any]) -> str:
    if not r["num_over_limit"]:
        return "0"
    done = []
    for key, word in (("num_truncated", "trunc"), ("num_split", "split"), ("num_dropped", "drop")):
        if r[key]:
            done.append(f"{r[key]:,} {word}")
    return f"{r['num_over_limit']:,} ({', '.join(done)})" if done else f"{r['num_over_limit']:,}"


def format_table(records: list[dict[str, Any]]) -> str:
    """Render :func:`analyze` records as an aligned plain-text table (one line per strategy).

    Columns: efficiency and padding (%), batches, rows, token slots, compute relative to the best
    row, examples over the per-example limit (and what was done to them), packed rows over the lower
    bound, the randomness (``order corr``: correlation of consecutive batches' mean lengths, 0 when
    shuffled; ``pairs again``: neighbours in a batch, or a packed row, that share one again next epoch,
    with the value of random batches of the same sizes as ``(r ...)``), and planning time (ms). A
    record's ``num_dropped`` also counts examples a ``drop_last`` left out.
    """
    headers = [
        "strategy",
        "efficiency",
        "padding",
        "batches",
        "rows",
        "token slots",
        "rel. compute",
        "over limit",
        "rows/LB",
        "order corr",
        "pairs again",
        "plan ms",
    ]
    right = [False] + [True] * 6 + [False] + [True] * 4
    rows = []
    for r in records:
        rel = r.get("relative_compute")
        lb = r.get("rows_over_lower_bound")
        corr = r.get("order_corr")
        rows.append(
            [
                r["strategy"],
                "n/a" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}%",
                "n/a" if r["padding_pct"] is None else f"{r['padding_pct']:.1f}%",
                _int(r["num_batches"]),
                _int(r["num_rows"]),
                _int(r["token_slots"]),
                "-" if rel is None else f"{rel:.2f}x",
                _overlong_cell(r),
                "-" if lb is None else f"{lb:.4f}",
                "n/a" if corr is None else f"{corr:+.2f}",
                pairs_cell(r.get("pair_repeat"), r.get("pair_repeat_random")),
                f"{1000 * r['plan_seconds']:.1f}",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
        return "  ".join(out).rstrip()

    sep = "  ".join("-" * w for w in widths)
    table = [line(headers), sep, *(line(row) for row in rows)]
    empty = max((r.get("num_empty") or 0 for r in records), default=0)
    if empty:
        table.append(f"{_int(empty)} empty example(s) (no tokens) left out of every plan")
    return "\n".join(table)


__all__ = [
    "DEFAULT_STRATEGIES",
    "analyze",
    "default_max_tokens",
    "format_schedule",
    "format_table",
    "length_summary",
    "parse_strategy",
]
