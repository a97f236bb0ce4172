"""Bench records: one JSON object per run, appended to a JSON-lines file as each run finishes.

The fields are listed in :data:`RECORD_FIELDS`; values are plain JSON (NaN and infinities become
``null``). Appending and flushing per run is what lets Ctrl-C keep the finished runs.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

RECORDS_NAME = "records.jsonl"
SCHEMA_VERSION = 1

RECORD_FIELDS = (
    "schema", "bench_id", "run_index", "status", "strategy", "strategy_options", "seed", "model", "task",
    "world_size", "num_steps", "num_examples_seen", "real_tokens", "token_slots", "target_tokens",
    "padding_ratio", "examples_digest",
    "wall_seconds", "cpu_seconds", "tokens_per_second", "samples_per_second", "step_seconds", "iteration_seconds",
    "peak_memory_mb", "peak_memory_mb_per_rank", "memory_kind", "loss_curve", "train_loss_final", "eval", "eval_initial",
    "task_metric", "generations", "dropped", "planned", "randomness", "token_weights", "fallbacks", "schedule", "oom_backoff", "data",
    "settings", "versions", "machine", "rank_balance",
)  # fmt: skip
"""Top-level fields of a record (``status="skipped"`` records carry ``skip_reason`` and no measurements).

``world_size`` is the number of processes the run trained on (records written before it existed: 1);
with several, ``tokens_per_second`` counts every process's real tokens over the slowest one's wall time
and ``peak_memory_mb`` is the largest of ``peak_memory_mb_per_rank``; ``rank_balance`` is how evenly the
processes' work was spread, per step (:func:`~smart_batching.bench.multiprocess.rank_balance`; None with one
process). ``target_tokens`` counts the labels the loss was taken over, every step of every process (the
prompt masked: the completions' tokens, each row's first excluded). ``fallbacks`` counts the slower
paths the run took, by kind (:mod:`smart_batching.fallbacks`; ``{}`` when none, summed over processes).
``randomness`` is how random the strategy's batches are, from its plans for epochs 0 and 1 with the run's
seed (``order_corr``, ``pair_repeat``, ``pair_repeat_random``: see
:func:`~smart_batching.analysis.batch_randomness`). ``token_weights`` is what its epoch-0 plan does to the
weight of a target token per length quarter of the examples, shortest first, over its share (four
floats, 1.0 uniform; :func:`~smart_batching.analysis.token_weights`; None for classification and for
runs on several processes). ``schedule`` is the batch schedule as the run realised
it (``tokens``, ``size`` and ``target`` of every optimizer step, all processes; None without
``batch_schedule``), ``oom_backoff`` what the out-of-memory back-off did (its budget, ``num_backoffs``,
``num_failures``, ``failed_seconds``, events; None when off). ``eval_initial`` is the evaluation of the initial
weights, the same in every record of a bench, with their ``generations`` (the "before" of each run's)."""


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become None, NumPy scalars become Python ones."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def append_record(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one record as a JSON line and flush it to disk (a later Ctrl-C keeps it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_clean(record), ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL file (blank lines skipped)."""
    from smart_batching.errors import DataError

    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}: line {lineno} is not a JSON record ({exc.msg})") from exc
    return out


__all__ = ["RECORDS_NAME", "RECORD_FIELDS", "SCHEMA_VERSION", "append_record", "read_records"]
