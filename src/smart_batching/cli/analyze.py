"""``smart-batching analyze DATA``: padding, compute and over-limit counts of every strategy on a dataset.

Prints a header (dataset, examples, length summary, tokenizer, settings) and the table of
:func:`smart_batching.analysis.format_table`; ``--json`` prints one JSON record per strategy per line
instead (nothing else on stdout), ``--plot FILE.png`` also draws the analysis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from smart_batching.data.formats import FORMATS
from smart_batching.planners import OVERLONG_POLICIES

DEFAULT_DATA = "default"
DEFAULT_TOKENIZER = "smollm2"
FORMAT_CHOICES = ("auto", *FORMATS)


PLOT_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def plot_path(text: str) -> str:
    """argparse type: a file name whose suffix is an image format matplotlib writes."""
    if not text.lower().endswith(PLOT_SUFFIXES):
        raise argparse.ArgumentTypeError(f"{text!r} must end in one of {', '.join(PLOT_SUFFIXES)}")
    return text


def check_readable_input(data: str) -> None:
    """Refuse standard input and pipes by name: lengths need a file that can be read twice.

    Raises:
        ConfigError: ``-``, a FIFO or a character device.
    """
    import stat

    from smart_batching.errors import ConfigError

    if data == "-" or (os.path.exists(data) and not (os.path.isfile(data) or os.path.isdir(data))):
        what = "standard input" if data == "-" or not os.path.exists(data) else "a pipe or device"
        if data != "-" and stat.S_ISFIFO(os.stat(data).st_mode):
            what = "a pipe"
        raise ConfigError(f"{data!r} is {what}: save the data to a file and pass its path")


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer ≥ 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def add_adaptive_options(p: Any, *, schedule_note: str = "") -> None:
    """The adaptive batch-size settings shared by ``train`` and ``bench`` (``p``: a parser or an argument
    group); ``schedule_note`` ends ``--batch-schedule``'s help (what the command needs besides)."""
    p.add_argument(
        "--batch-schedule", default=None, metavar="SCHEDULE",
        help="tokens (token_budget, packed) or examples (fixed-size strategies) per optimizer step as a "
        "function of what was seen, e.g. 'linear:4096->32768@20%%' or '0:4k 1M:16k' (see "
        "smart_batching.adaptive.schedule); each step runs as many micro-batches of the strategy's budget "
        f"as it needs{schedule_note}",
    )  # fmt: skip
    p.add_argument(
        "--lr-scaling", choices=("sqrt", "linear"), default=None,
        help="with --batch-schedule: scale each step's learning rate by (size / first size) ** 1/2 (Adam) or ** 1",
    )  # fmt: skip
    p.add_argument(
        "--oom-backoff", action="store_true",
        help="split a micro-batch that runs out of memory within its optimizer step and keep the lower budget "
        "(the Trainer's oom_backoff)",
    )  # fmt: skip


def add_analysis_options(p: argparse.ArgumentParser) -> None:
    """The planning settings shared by ``analyze`` and ``demo``."""
    g = p.add_argument_group("settings")
    g.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        metavar="N",
        help="examples per batch for random, max_length, group_by_length (default: 8)",
    )
    g.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="padded tokens per token_budget batch (default: batch size x p95 length, "
        "rounded up to a multiple of 64)",
    )
    g.add_argument(
        "--capacity",
        type=positive_int,
        default=None,
        metavar="N",
        help="tokens per packed row (default: --max-tokens, at most 262,143, the packed planner's limit)",
    )
    g.add_argument(
        "--overlong",
        choices=OVERLONG_POLICIES,
        default="truncate",
        help="what to do with examples over min(max tokens, capacity) (default: truncate)",
    )
    g.add_argument(
        "--strategies",
        default=None,
        metavar="LIST",
        help="comma-separated rows, e.g. random,group_by_length[megabatch],token_budget[window=512],packed (default: all strategies)",
    )
    g.add_argument("--seed", type=non_negative_int, default=0, metavar="N", help="plan seed (default: 0)")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "analyze",
        help="compare padding and compute of every batching strategy on a dataset",
        description=(
            "Compute token lengths of DATA and plan one epoch with every strategy on them: efficiency "
            "(real tokens / token slots), padding, batches, compute relative to the best, what "
            "happened to examples over the limit, and how random the batches are (a second epoch is "
            "planned: order correlation of consecutive batches, neighbours that meet again)."
        ),
    )
    p.add_argument(
        "data",
        metavar="DATA",
        help="a data file (.json, .jsonl, .jsonl.gz, .csv, .tsv, .parquet), a save_to_disk or data folder, "
        "a .npy array of lengths, a hub dataset name, or 'default' for the embedded default dataset",
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        metavar="T",
        help="tokenizer alias (smollm2, gpt2, llama-sp, minilm), folder or hub name, used when "
        "text must be tokenised (default: smollm2)",
    )
    d.add_argument(
        "--column",
        default=None,
        metavar="C",
        help="column of lengths, token ids or text (default: a length or input_ids column, else "
        "the records rendered by --format)",
    )
    d.add_argument("--format", default="auto", choices=FORMAT_CHOICES, help="record shape (default: auto)")
    d.add_argument(
        "--split", default=None, metavar="S", help="split of a folder or hub dataset (default: train)"
    )
    add_analysis_options(p)
    a = p.add_argument_group("batch schedule")
    a.add_argument(
        "--batch-schedule",
        default=None,
        metavar="SCHEDULE",
        help="also realise this schedule of tokens per optimizer step on every plan, e.g. "
        "'linear:4096->32768@20%%' or '0:4k 1M:16k' (see smart_batching.adaptive.schedule), and report "
        "its steps; --plot then also draws them (FILE_schedule.png)",
    )
    a.add_argument(
        "--world-size", type=positive_int, default=1, metavar="N",
        help="ranks the schedule's steps are balanced over (default: 1)",
    )  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON record per strategy per line")
    o.add_argument(
        "--plot",
        default=None,
        type=plot_path,
        metavar="FILE.png",
        help="also write a plot of the analysis (.png, .svg, .pdf)",
    )
    p.set_defaults(func=run)
    return p


@dataclass
class LoadedLengths:
    """Token lengths and where they came from (for the header and the JSON records)."""

    lengths: np.ndarray
    dataset: str
    tokenizer: str | None  # None: lengths were read, not tokenised


def load_lengths(
    data: str,
    *,
    tokenizer: str = DEFAULT_TOKENIZER,
    column: str | None = None,
    format: str = "auto",
    split: str | None = None,
    progress: bool = False,
) -> LoadedLengths:
    """Lengths of ``data`` (any source :func:`~smart_batching.data.lengths.compute_lengths` takes, or ``default``)."""
    from smart_batching.data.lengths import compute_lengths

    check_readable_input(data)
    kwargs = {"column": column, "format": format, "split": split, "progress": progress}
    if data == DEFAULT_DATA:
        from smart_batching.data.default_data import default_dataset_as_hf

        lengths = compute_lengths(default_dataset_as_hf(), tokenizer, **kwargs)
        return LoadedLengths(lengths, "default (embedded default dataset)", tokenizer)
    if data.lower().endswith(".npy"):
        return LoadedLengths(compute_lengths(data, None, **kwargs), data, None)
    return LoadedLengths(compute_lengths(data, tokenizer, **kwargs), data, tokenizer)


def strategy_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    from smart_batching.planners import split_strategies

    return split_strategies(text)


def run_analysis(loaded: LoadedLengths, args: argparse.Namespace) -> list[dict[str, Any]]:
    from smart_batching.analysis import analyze

    return analyze(
        loaded.lengths,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        capacity=args.capacity,
        strategies=strategy_list(args.strategies),
        seed=args.seed,
        overlong=args.overlong,
        batch_schedule=getattr(args, "batch_schedule", None),
        world_size=getattr(args, "world_size", 1),
    )


def header(
    loaded: LoadedLengths,
    records: list[dict[str, Any]],
    *,
    max_tokens_given: bool,
    capacity_given: bool = False,
) -> str:
    """The lines printed above the table."""
    from smart_batching.analysis import length_summary

    s = length_summary(loaded.lengths)
    st = records[0]["settings"]
    how = "" if max_tokens_given else f" (batch size x p95 {s['p95']:.0f}, rounded up to 64)"
    capped = st["capacity"] < st["max_tokens"] and not capacity_given
    cap_how = " (max_tokens, capped at the packed planner's limit)" if capped else ""
    lines = [
        f"dataset:    {loaded.dataset}",
        f"examples:   {s['n']:,}",
        f"tokenizer:  {loaded.tokenizer or 'none (lengths read from the file)'}",
        f"lengths:    {s['total']:,} tokens; mean {s['mean']:.1f}, p50 {s['p50']:.0f}, p90 {s['p90']:.0f}, "
        f"p99 {s['p99']:.0f}, max {s['max']:,}",
        f"settings:   batch_size={st['batch_size']}, max_tokens={st['max_tokens']}{how}, "
        f"capacity={st['capacity']}{cap_how}, overlong={st['overlong']}, seed={st['seed']}",
    ]
    num_over = max(r["num_over_limit"] for r in records)
    if num_over:
        lines.append(
            f"over limit: {num_over:,} example(s) longer than {st['max_length']} tokens "
            f"({st['overlong']}; see the 'over limit' column)"
        )
    return "\n".join(lines)


def print_report(loaded: LoadedLengths, records: list[dict[str, Any]], args: argparse.Namespace) -> None:
    from smart_batching.analysis import format_table

    print(
        header(
            loaded,
            records,
            max_tokens_given=args.max_tokens is not None,
            capacity_given=args.capacity is not None,
        )
    )
    print()
    print(format_table(records))
    from smart_batching.analysis import format_schedule

    schedule = format_schedule(records)
    if schedule:
        print()
        print(schedule)


def write_plot(loaded: LoadedLengths, records: list[dict[str, Any]], path: str | os.PathLike) -> str:
    """The analysis plot at ``path``; with a batch schedule also its steps at ``<stem>_schedule<suffix>``."""
    from pathlib import Path

    from smart_batching.analysis.plots import plot_analysis, plot_schedule

    title = f"{loaded.dataset} ({loaded.tokenizer or 'given lengths'})"
    written = os.fspath(plot_analysis(loaded.lengths, records, path, title=title))
    steps = [dict(r["schedule_steps"], label=r["strategy"]) for r in records if r.get("schedule_steps")]
    if steps:
        p = Path(path)
        where = p.with_name(f"{p.stem}_schedule{p.suffix}")
        text = records[0]["schedule"]["batch_schedule"]
        written += ", " + os.fspath(plot_schedule(steps, where, title=f"{title}: batch schedule {text}"))
    return written


def run(args: argparse.Namespace) -> int:
    loaded = load_lengths(
        args.data,
        tokenizer=args.tokenizer,
        column=args.column,
        format=args.format,
        split=args.split,
        progress=not args.json and sys.stderr.isatty(),
    )
    records = run_analysis(loaded, args)
    if args.json:
        for r in records:
            print(json.dumps({**r, "dataset": loaded.dataset, "tokenizer": loaded.tokenizer}))
    else:
        print_report(loaded, records, args)
    if args.plot:
        path = write_plot(loaded, records, args.plot)
        print(f"plot: {path}", file=sys.stderr if args.json else sys.stdout)
    return 0
