"""``smart-batching report RECORDS.jsonl``: re-render a bench report from its records, without re-running."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="re-render the Markdown/HTML report of a bench from its records.jsonl",
        description="Render report.md, report.html and the PNG plots from the JSON-lines records of `smart-batching bench`.",
    )
    p.add_argument("records", metavar="RECORDS.jsonl", help="records written by `smart-batching bench`")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: the records' folder)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from smart_batching.bench.records import read_records
    from smart_batching.bench.report import render_report, summary_table

    paths = render_report(args.records, args.out)
    print(f"report: {paths.html} (and {paths.markdown}, {len(paths.plots)} plots)\n")
    print(summary_table(read_records(args.records)))
    return 0
