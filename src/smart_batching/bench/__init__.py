"""Training benchmarks: the same fine-tuning once per batching strategy, measured and reported.

::

    from smart_batching.bench import BenchConfig, run_bench, render_report, summary_table

    config = BenchConfig(data="gsm8k/train.jsonl", model="tiny-llama", strategies=("random", "packed"),
                         max_steps=40, out_dir="out/bench")
    records = run_bench(config)                      # writes out/bench/records.jsonl + report
    print(summary_table(records))

Measuring (:mod:`.runner`) and rendering (:mod:`.report`) are separate: a bench appends one JSON
record per run to ``records.jsonl``; :func:`render_report` draws the Markdown/HTML report from that
file at any later time (``smart-batching report RECORDS.jsonl``).

Needs the ``hf`` and ``plot`` extras (transformers, datasets, matplotlib); nothing here is imported
by ``import smart_batching``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BenchConfig", "read_records", "render_report", "run_bench", "run_demo_bench", "summary_table"]


def __getattr__(name: str) -> Any:
    # Lazy: `smart_batching.bench.report` must not pull in transformers, the runner does.
    if name == "BenchConfig":
        from smart_batching.bench.config import BenchConfig

        return BenchConfig
    if name in ("run_bench", "read_records"):
        from smart_batching.bench import runner

        return getattr(runner, name)
    if name in ("render_report", "summary_table"):
        from smart_batching.bench import report

        return getattr(report, name)
    if name == "run_demo_bench":
        from smart_batching.bench.demo import run_demo_bench

        return run_demo_bench
    raise AttributeError(f"module 'smart_batching.bench' has no attribute {name!r}")
