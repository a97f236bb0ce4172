"""The short training bench of ``smart-batching demo`` (``make demo``).

:func:`run_demo_bench` fine-tunes ``tiny-llama`` on the first :data:`DEMO_SETTINGS` ``num_examples``
examples of the embedded default dataset once per strategy (all five, one seed), truncated at 256
tokens, and writes the records and the report under ``out_dir``. Sized to finish within 3 minutes
on 2 CPU cores. Measured on a 2-core AMD EPYC VM (torch 2.13 CPU): 51 s for the whole process with
no other work running, 152 s with two other CPU-bound processes (load average about 2.5).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from smart_batching.planners import STRATEGIES

DEMO_SETTINGS: dict[str, Any] = {
    "data": "default",
    "model": "tiny-llama",
    "strategies": STRATEGIES,
    "seeds": (0,),
    "num_examples": 64,
    "batch_size": 8,
    "max_length": 256,
    "eval_examples": 32,
    "num_generations": 2,
    "max_new_tokens": 24,
}
"""What the demo bench runs (passed to :func:`~smart_batching.bench.runner.run_bench`)."""


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
    run_bench(out_dir=out, append=False, render=False, progress=progress, **DEMO_SETTINGS)
    records_path = out / RECORDS_NAME
    if not records_path.exists():
        raise KeyboardInterrupt  # interrupted before the first run finished: nothing to report
    paths = render_report(records_path, out)
    table = summary_table(read_records(records_path))
    table += f"\n(bench took {time.perf_counter() - start:.0f} s)"
    return records_path, paths.html, table


__all__ = ["DEMO_SETTINGS", "run_demo_bench"]
