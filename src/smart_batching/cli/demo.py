"""``smart-batching demo`` (``make demo``): the main job on the embedded default dataset.

The demo is a list of steps run in order, each a function ``step(args, ctx)`` that prints its part
and may leave results in ``ctx`` (a dict) for the steps after it:

1. ``analysis``: token lengths with the SmolLM2 tokenizer, every strategy planned, the table printed
   and a plot written under ``--out`` (``out/demo/`` by default, which git ignores).
2. ``bench``: pretrained SmolLM2-135M-Instruct (its last layers) fine-tuned on the default dataset
   once per strategy of ``random``, ``token_budget`` and ``packed``, then ``packed`` again on two
   processes (:mod:`smart_batching.bench.demo`); the report (Markdown, HTML, plots) goes under
   ``--out/bench``, and the console gets speed-up, padding, memory and held-out loss per run and the
   model's generations before and after, side by side.
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
            "plot), then fine-tune pretrained SmolLM2-135M-Instruct (its last decoder layers) once per batching "
            "strategy (random, token_budget, packed) and once more on two processes, and write a report comparing "
            "speed, padding, memory, held-out loss and what the model says before and after (about 3 minutes "
            "on 2 CPU cores)."
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
    """The training bench: SmolLM2 fine-tuned once per strategy and once on two processes, then the report."""
    from smart_batching.bench.demo import DEMO_CONFIG, DEMO_DISTRIBUTED, DEMO_NPROC, run_demo_bench

    c = DEMO_CONFIG
    print(
        f"== bench: fine-tune {c.model} on {c.num_examples} examples, once per strategy "
        f"({', '.join(c.strategies)}), then {DEMO_DISTRIBUTED} on {DEMO_NPROC} processes =="
    )
    sys.stdout.flush()
    result = run_demo_bench(Path(args.out) / "bench", progress=True)
    print(result.text)
    print(
        f"\nrecords: {result.records}\nreport:  {result.report} (and report.md beside it; the plot of held-out "
        f"loss against training time: {result.report.parent / 'demo-time-to-target.png'})"
    )


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
