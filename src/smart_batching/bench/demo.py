"""The short training bench of ``smart-batching demo`` (``make demo``).

:func:`run_demo_bench` fine-tunes ``tiny-llama`` on the first :data:`DEMO_CONFIG` ``num_examples``
examples of the embedded default dataset once per strategy (all five, one seed), truncated at 256
tokens, and writes the records and the report under ``out_dir``. Sized to finish within 3 minutes
on 2 CPU cores.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from smart_batching.bench.config import BenchConfig
from smart_batching.planners import STRATEGIES

DEMO_CONFIG = BenchConfig(
    data="default",
    model="tiny-llama",
    strategies=STRATEGIES,
    seeds=(0,),
    num_examples=64,
    batch_size=8,
    max_length=256,
    eval_examples=32,
    num_generations=2,
    max_new_tokens=24,
    render=False,
)
"""What the demo bench runs (:func:`~smart_batching.bench.runner.run_bench`; ``out_dir`` and
``progress`` are set per call)."""


def run_demo_bench(out_dir: str | os.PathLike, *, progress: bool = True) -> tuple[Path, Path, str]:
    """Run the demo bench and render its report.

    Args:
        out_dir: folder for ``records.jsonl``, ``report.md``, ``report.html`` and the plots (a previous
            demo's records there are replaced).
        progress: progress lines (and bars on a terminal) on stderr.

    Returns:
        ``(records_path, report_path, table)``: the JSON-lines records, the self-contained HTML report,
        and the one-screen summary table. After Ctrl-C the finished runs are kept and reported.
    """
    from smart_batching.bench.report import render_report, summary_table
    from smart_batching.bench.runner import RECORDS_NAME, read_records, run_bench

    out = Path(out_dir)
    start = time.perf_counter()
    run_bench(DEMO_CONFIG, out_dir=out, progress=progress)
    records_path = out / RECORDS_NAME
    if not records_path.exists():
        raise KeyboardInterrupt  # interrupted before the first run finished: nothing to report
    paths = render_report(records_path, out)
    table = summary_table(read_records(records_path))
    table += f"\n(bench took {time.perf_counter() - start:.0f} s)"
    return records_path, paths.html, table


__all__ = ["DEMO_CONFIG", "run_demo_bench"]
