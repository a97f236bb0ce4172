"""``smart-batching demo`` (``make demo``): the main job on the embedded default dataset.

The demo is a list of steps run in order, each a function ``step(args, ctx)`` that prints its part
and may leave results in ``ctx`` (a dict) for the steps after it:

1. ``analysis``: token lengths with the SmolLM2 tokenizer, every strategy planned, the table printed
   and a plot written under ``--out`` (``out/demo/`` by default, which git ignores).
2. ``bench``: the same tiny Llama fine-tuned once per strategy on the default dataset, with the
   report (Markdown, HTML, plots) under ``--out/bench`` and the summary table printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from smart_batching.cli.analyze import (
    DEFAULT_DATA,
    DEFAULT_TOKENIZER,
    add_analysis_options,
    load_lengths,
    print_report,
    run_analysis,
    write_plot,
)

DEFAULT_OUT = "out/demo"

Step = Callable[[argparse.Namespace, dict[str, Any]], None]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="analysis and a short training bench on the embedded default dataset (what `make demo` runs)",
        description=(
            "The main job on the embedded default dataset: analyse it with the SmolLM2 tokenizer (table and "
            "plot), then fine-tune a tiny Llama once per batching strategy (a short training bench, about "
            "a minute on 2 CPU cores) and write a report comparing speed, padding and loss."
        ),
    )
    p.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default: {DEFAULT_OUT})"
    )
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER, metavar="T", help="tokenizer (default: smollm2)")
    add_analysis_options(p)
    p.set_defaults(func=run)
    return p


def analysis_step(args: argparse.Namespace, ctx: dict[str, Any]) -> None:
    """Lengths of the default dataset, every strategy planned, the table printed, the plot written."""
    start = time.perf_counter()
    loaded = load_lengths(DEFAULT_DATA, tokenizer=args.tokenizer, progress=sys.stderr.isatty())
    records = run_analysis(loaded, args)
    print("== analysis: every batching strategy on the default dataset ==")
    print_report(loaded, records, args)
    plot = write_plot(loaded, records, Path(args.out) / "analysis.png")
    print(f"\nplot: {plot}")
    print(f"(analysis took {time.perf_counter() - start:.1f} s)")
    ctx.update(lengths=loaded.lengths, records=records, loaded=loaded)


def bench_step(args: argparse.Namespace, ctx: dict[str, Any]) -> None:
    """A short training bench: the same tiny Llama fine-tuned once per strategy, then the report."""
    from smart_batching.bench.demo import run_demo_bench

    print("== bench: fine-tune the same model once per strategy (tiny Llama, 64 examples) ==")
    sys.stdout.flush()
    records, report, table = run_demo_bench(Path(args.out) / "bench", progress=True)
    print(table)
    print(f"\nrecords: {records}\nreport:  {report}")


# The steps of the demo, in order.
STEPS: list[tuple[str, Step]] = [
    ("analysis", analysis_step),
    ("bench", bench_step),
]


def run(args: argparse.Namespace) -> int:
    ctx: dict[str, Any] = {}
    for i, (_name, step) in enumerate(STEPS):
        if i:
            print()
        step(args, ctx)
    return 0
