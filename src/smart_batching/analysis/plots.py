"""Plots of an analysis: the length distribution and the efficiency of each strategy.

Rendering only: the numbers come from :func:`smart_batching.analysis.analyze` records. matplotlib
(the ``plot`` extra) is imported when a plot is drawn, with the non-interactive Agg backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.errors import DataError, require
from smart_batching.plan import as_lengths


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "plot")  # MissingExtraError naming the extra when absent
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_analysis(
    lengths: Any,
    records: list[dict[str, Any]],
    path: str | os.PathLike,
    *,
    title: str | None = None,
) -> Path:
    """Write a PNG: the token-length histogram (left) and efficiency per strategy (right).

    The histogram marks the median, the 95th percentile and the per-example limit of the analysis
    (examples past it were truncated, split or dropped). Each efficiency bar is labelled with its
    percentage and its compute relative to the best strategy.

    Args:
        lengths: (num_examples,) token lengths the records were computed from.
        records: :func:`smart_batching.analysis.analyze` output.
        path: the ``.png`` file to write; parent folders are created.
        title: figure title; None means a summary of the data.

    Returns:
        The path written.

    Raises:
        MissingExtraError: matplotlib is not installed.
        DataError: no lengths or no records.
    """
    arr = as_lengths(lengths)
    if arr.size == 0:
        raise DataError("plot_analysis: no lengths to plot")
    if not records:
        raise DataError("plot_analysis: no records to plot")
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)

    fig, (ax_len, ax_eff) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.1]}, constrained_layout=True
    )
    # Left: length histogram.
    bins = min(80, max(10, int(np.sqrt(arr.size))))
    ax_len.hist(arr, bins=bins, color="#4c72b0", alpha=0.85)
    p50, p95 = np.percentile(arr, [50, 95])
    ax_len.axvline(p50, color="#333333", linestyle="--", linewidth=1, label=f"median {p50:.0f}")
    ax_len.axvline(p95, color="#dd8452", linestyle="--", linewidth=1, label=f"p95 {p95:.0f}")
    limit = records[0].get("settings", {}).get("max_length")
    if limit is not None and limit <= arr.max() * 1.05:
        over = int(np.count_nonzero(arr > limit))
        done = {"truncate": "truncated", "split": "split", "drop": "dropped"}.get(
            records[0]["settings"].get("overlong"), "over"
        )
        ax_len.axvline(limit, color="#c44e52", linewidth=1.5, label=f"limit {limit} ({over:,} {done})")
    ax_len.set_xlabel("tokens per example")
    ax_len.set_ylabel("examples")
    if arr.max() > 8 * max(p50, 1.0):  # long tail: a log count axis keeps the tail's bars visible
        ax_len.set_yscale("log")
        ax_len.set_ylabel("examples (log scale)")
    ax_len.set_title(f"Token lengths (n={arr.size:,}, mean {arr.mean():.0f}, max {int(arr.max()):,})")
    ax_len.legend(frameon=False, fontsize=9)

    # Right: efficiency per strategy, best at the top.
    names = [r["strategy"] for r in records]
    eff = np.array([np.nan if r["efficiency"] is None else 100.0 * r["efficiency"] for r in records])
    ypos = np.arange(len(records))[::-1]
    colors = ["#55a868" if e >= 95 else "#dd8452" if e >= 75 else "#c44e52" for e in eff]
    ax_eff.barh(ypos, eff, color=colors, height=0.6)
    ax_eff.set_yticks(ypos, names)
    ax_eff.set_xlim(0, 118)
    ax_eff.set_xticks([0, 25, 50, 75, 100])
    ax_eff.set_xlabel("efficiency: real tokens / token slots (%)")
    for y, e, r in zip(ypos, eff, records, strict=True):
        rel = r.get("relative_compute")
        label = f"{e:.1f}%" + (f"  ({rel:.2f}x compute)" if rel is not None else "")
        ax_eff.text(min(e, 100) + 1, y, label, va="center", fontsize=9)
    s = records[0].get("settings", {})
    ax_eff.set_title(
        f"Efficiency per strategy (batch_size={s.get('batch_size')}, max_tokens={s.get('max_tokens')}, "
        f"capacity={s.get('capacity')})",
        fontsize=10,
    )
    ax_eff.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_schedule(series: list[dict[str, Any]], path: str | os.PathLike, *, title: str | None = None) -> Path:
    """Write a PNG of batch schedules as realised: the size of every optimizer step (dots, one color per
    run) against the step, with the schedule's target (line) it follows.

    Args:
        series: One dict per run: ``label``, ``size`` (per step, in ``unit``), ``target`` (the
            schedule's size at each step) and ``unit`` (``"tokens"`` or ``"examples"``).
        path: The image to write; parent folders are created.
        title: Figure title.

    Returns:
        The path written.

    Raises:
        DataError: no series with steps.
    """
    series = [s for s in series if s.get("size")]
    if not series:
        raise DataError("plot_schedule: no realised schedule to plot")
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4.8), constrained_layout=True)
    cmap = plt.get_cmap("tab10")
    for i, s in enumerate(series):
        steps = np.arange(len(s["size"]))
        color = cmap(i % 10)
        ax.plot(steps, s["size"], ".", color=color, markersize=4, label=f"{s['label']} (realised)")
        ax.plot(steps, s["target"], "-", color=color, linewidth=1, alpha=0.6)
    units = {s.get("unit", "tokens") for s in series}
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"{' / '.join(sorted(units))} per step")
    ax.set_title(title or "Batch schedule: realised step sizes (dots) and the schedule (lines)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=9)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


__all__ = ["plot_analysis", "plot_schedule"]
