"""PNG plots of bench records: throughput and padding, loss curves, eval metric, length histogram.

Rendering only: every number comes from the records (:mod:`smart_batching.bench.runner`). Each
function takes the records of one bench (one ``bench_id``) and writes one PNG. matplotlib (the ``plot``
extra) is imported on use, with the Agg backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.errors import require

COLORS = [
    "#4c72b0",
    "#dd8452",
    "#55a868",
    "#c44e52",
    "#8172b3",
    "#937860",
    "#da8bc3",
    "#8c8c8c",
    "#ccb974",
    "#64b5cd",
    "#2f4f4f",
    "#b8860b",
]


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "plot")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def spread(values: list[float]) -> tuple[float, float, float]:
    """``(center, low, high)``: the value; min–max for 2 values; mean ± sample std for 3 or more."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return float("nan"), float("nan"), float("nan")
    if arr.size == 1:
        return float(arr[0]), float(arr[0]), float(arr[0])
    if arr.size == 2:
        return float(arr.mean()), float(arr.min()), float(arr.max())
    mean, std = float(arr.mean()), float(arr.std(ddof=1))
    return mean, mean - std, mean + std


def _by_strategy(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status") == "ok":
            out.setdefault(r["strategy"], []).append(r)
    return out


def _colors(names: list[str]) -> dict[str, str]:
    return {n: COLORS[i % len(COLORS)] for i, n in enumerate(names)}


def _bars(
    ax: Any, names: list[str], values: list[list[float]], colors: dict[str, str], fmt: str
) -> list[float]:
    centers = []
    for i, (name, vals) in enumerate(zip(names, values, strict=True)):
        c, lo, hi = spread(vals)
        centers.append(c)
        err = None if lo == hi else [[c - lo], [hi - c]]
        ax.bar(i, c, color=colors[name], yerr=err, capsize=4, width=0.65)
        ax.text(i, c, fmt.format(c), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return centers


def plot_throughput(
    records: list[dict[str, Any]], path: str | os.PathLike, ratios: dict[str, float] | None = None
) -> Path:
    """Three panels per strategy: real tokens/s (with the ratio to ``random``), padding %, peak memory."""
    plt = _pyplot()
    groups = _by_strategy(records)
    names = list(groups)
    colors = _colors(names)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2), constrained_layout=True)
    tps = [[r["tokens_per_second"] for r in groups[n]] for n in names]
    _bars(axes[0], names, tps, colors, "{:,.0f}")
    if ratios:
        for i, n in enumerate(names):
            if ratios.get(n) is not None:
                axes[0].text(
                    i,
                    0,
                    f"{ratios[n]:.2f}x",
                    ha="center",
                    va="bottom",
                    fontsize=9,
                    color="white",
                    weight="bold",
                )
    axes[0].set_title("real tokens / s (higher is better; white: x random)", fontsize=10)
    pad = [[100 * r["padding_ratio"] for r in groups[n]] for n in names]
    _bars(axes[1], names, pad, colors, "{:.1f}%")
    axes[1].set_title("padding: pad tokens / token slots computed (%)", fontsize=10)
    mem = [[r.get("peak_memory_mb") or 0.0 for r in groups[n]] for n in names]
    _bars(axes[2], names, mem, colors, "{:,.0f}")
    kind = records[0].get("memory_kind", "") if records else ""
    axes[2].set_title(f"peak memory, MB ({kind})", fontsize=10)
    return _save(fig, plt, path)


def _ema(values: list[float], alpha: float) -> np.ndarray:
    out = np.empty(len(values))
    acc = values[0] if values else 0.0
    for i, v in enumerate(values):
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def plot_loss_curves(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Training loss against examples seen, one color per strategy, one line per seed (smoothed)."""
    plt = _pyplot()
    groups = _by_strategy(records)
    colors = _colors(list(groups))
    styles = ["-", "--", "-.", ":"]  # lines of strategies that train alike (random, max_length) stay visible
    fig, ax = plt.subplots(figsize=(9, 4.8), constrained_layout=True)
    for s_index, (name, runs) in enumerate(groups.items()):
        for k, r in enumerate(runs):
            curve = r.get("loss_curve") or {}
            x, y = curve.get("examples") or [], curve.get("loss") or []
            if not x:
                continue
            ax.plot(x, y, color=colors[name], alpha=0.2, linewidth=0.8)
            alpha = min(1.0, 4.0 / max(len(y), 1) * 2)
            label = name if k == 0 else None
            ax.plot(
                x,
                _ema(y, alpha),
                color=colors[name],
                linewidth=1.8,
                label=label,
                linestyle=styles[s_index % 4],
            )
    initial = (records[0].get("eval_initial") or {}).get("loss") if records else None
    if initial is not None:
        ax.axhline(
            initial, color="#333333", linestyle=":", linewidth=1, label=f"eval loss at start {initial:.3f}"
        )
    ax.set_xlabel("training examples seen")
    ax.set_ylabel("training loss (nats / target token)")
    ax.set_title(
        "Training loss (faint: per step; bold: smoothed), same examples for every strategy", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=9)
    return _save(fig, plt, path)


def plot_eval(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Held-out eval loss per strategy (spread across seeds) and the task metric when there is one."""
    plt = _pyplot()
    groups = _by_strategy(records)
    names = list(groups)
    colors = _colors(names)
    has_metric = any(r.get("task_metric") for rs in groups.values() for r in rs)
    fig, axes = plt.subplots(
        1, 2 if has_metric else 1, figsize=(12 if has_metric else 7, 4.2), constrained_layout=True
    )
    axes = np.atleast_1d(axes)
    losses = [[(r.get("eval") or {}).get("loss") for r in groups[n]] for n in names]
    centers = _bars(axes[0], names, losses, colors, "{:.3f}")
    initial = (records[0].get("eval_initial") or {}).get("loss") if records else None
    finite = [c for c in centers if np.isfinite(c)]
    if finite:
        lo, hi = min(finite), max(finite)
        margin = max((hi - lo) * 0.6, 0.02 * hi, 1e-3)
        axes[0].set_ylim(max(0.0, lo - margin), hi + margin)
    title = "held-out eval loss (lower is better)"
    if initial is not None:
        title += f"; {initial:.3f} before training"
    seeds = max((len(v) for v in losses), default=1)
    spread_s = {1: "", 2: ", bars: min-max of 2 seeds"}.get(seeds, f", bars: mean ± std of {seeds} seeds")
    axes[0].set_title(title + spread_s, fontsize=10)
    if has_metric:
        metric_name = next(
            r["task_metric"]["name"] for rs in groups.values() for r in rs if r.get("task_metric")
        )
        vals = [[100 * (r.get("task_metric") or {}).get("value", 0.0) for r in groups[n]] for n in names]
        _bars(axes[1], names, vals, colors, "{:.1f}%")
        top = max((max(v) for v in vals if v), default=0.0)
        axes[1].set_ylim(0, max(5.0, min(100.0, top * 1.25)))
        init_metric = ((records[0].get("eval_initial") or {}).get("task_metric") or {}).get("value")
        t = f"{metric_name} (%)"
        if init_metric is not None:
            t += f"; {100 * init_metric:.1f}% before training"
        axes[1].set_title(t, fontsize=10)
    return _save(fig, plt, path)


def plot_lengths(records: list[dict[str, Any]], path: str | os.PathLike) -> Path:
    """The training length histogram stored in the records, with the truncation limit."""
    plt = _pyplot()
    data = records[0].get("data") or {}
    hist = data.get("histogram") or {"edges": [0, 1], "counts": [0]}
    summary = data.get("lengths") or {}
    edges, counts = np.asarray(hist["edges"]), np.asarray(hist["counts"])
    fig, ax = plt.subplots(figsize=(8, 4), constrained_layout=True)
    ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="#4c72b0", alpha=0.85)
    if summary:
        ax.axvline(
            summary.get("p50", 0),
            color="#333333",
            linestyle="--",
            linewidth=1,
            label=f"median {summary.get('p50', 0):.0f}",
        )
        ax.axvline(
            summary.get("mean", 0),
            color="#55a868",
            linestyle="--",
            linewidth=1,
            label=f"mean {summary.get('mean', 0):.0f}",
        )
    trunc = data.get("truncation") or {}
    if trunc.get("max_length"):
        ax.axvline(
            trunc["max_length"], color="#c44e52", linewidth=1.5,
            label=f"max_length {trunc['max_length']} ({trunc.get('num_truncated', 0):,} truncated)",
        )  # fmt: skip
    if counts.size and counts.max() > 20 * max(np.median(counts[counts > 0]) if (counts > 0).any() else 1, 1):
        ax.set_yscale("log")
    ax.set_xlabel("tokens per training example (after truncation)")
    ax.set_ylabel("examples")
    ax.set_title(
        f"Training lengths (n={summary.get('n', 0):,}, mean {summary.get('mean', 0):.0f}, max {summary.get('max', 0):,})",
        fontsize=10,
    )
    ax.legend(frameon=False, fontsize=9)
    return _save(fig, plt, path)


def curve_band(
    curves: list[dict[str, Any]], x: str = "wall_seconds", points: int = 60
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Held-out loss of several seeds' ``eval_curve`` on one grid of ``x``: ``(grid, center, low, high)``.

    Each curve is interpolated linearly between its points and left out past its last one; the center
    and band are :func:`spread` over the curves defined at each grid point (mean ± std from 3 seeds).
    """
    xs = [np.asarray(c[x], dtype=np.float64) for c in curves if c and c.get(x)]
    ys = [np.asarray(c["loss"], dtype=np.float64) for c in curves if c and c.get(x)]
    if not xs:
        empty = np.zeros(0)
        return empty, empty, empty, empty
    grid = np.linspace(0.0, max(float(v[-1]) for v in xs), points)
    # values: (curves, points), NaN past a curve's end
    values = np.stack(
        [np.where(grid <= v[-1] + 1e-12, np.interp(grid, v, y), np.nan) for v, y in zip(xs, ys, strict=True)]
    )
    stats = [spread([float(v) for v in col if np.isfinite(v)]) for col in values.T]
    center, low, high = (np.asarray(a) for a in zip(*stats, strict=True))
    return grid, center, low, high


X_LABELS = {
    "wall_seconds": "training wall time, s (evaluations left out)",
    "cpu_seconds": "training process CPU time, s (evaluations left out)",
    "tokens": "real training tokens",
    "step": "optimizer steps",
}


def plot_time_to_quality(
    records: list[dict[str, Any]],
    path: str | os.PathLike,
    *,
    x: str = "wall_seconds",
    target: float | None = None,
    title: str | None = None,
) -> Path:
    """Held-out loss against training time, one line per strategy with its band over seeds.

    Reads each run's ``eval_curve`` (``bench --eval-every``); usable on any records, e.g. a demo's or a
    study's. The dashed line is ``target``, else the mean of ``random``'s final held-out losses (the
    default time-to-target goal).

    Args:
        records: records of one bench (or of benches run alike).
        path: the PNG to write.
        x: the curve column on the x axis: ``"wall_seconds"``, ``"cpu_seconds"``, ``"tokens"``, ``"step"``.
        target: the held-out loss drawn as the goal; None as said above.
        title: the plot title; None names the axis.
    """
    plt = _pyplot()
    groups = _by_strategy(records)
    colors = _colors(list(groups))
    fig, ax = plt.subplots(figsize=(9, 4.8), constrained_layout=True)
    for name, runs in groups.items():
        grid, center, low, high = curve_band([r.get("eval_curve") or {} for r in runs], x)
        if grid.size == 0:
            continue
        ax.plot(
            grid,
            center,
            color=colors[name],
            linewidth=1.8,
            label=f"{name} ({len(runs)} seed{'' if len(runs) == 1 else 's'})",
        )
        if len(runs) > 1:
            ax.fill_between(grid, low, high, color=colors[name], alpha=0.18, linewidth=0)
    if target is None:
        from smart_batching.planners import BASELINE_STRATEGY

        finals = [(r.get("eval") or {}).get("loss") for r in groups.get(BASELINE_STRATEGY, [])]
        finals = [v for v in finals if v is not None]
        target = float(np.mean(finals)) if finals else None
    if target is not None:
        ax.axhline(target, color="#333333", linestyle="--", linewidth=1, label=f"target {target:.4f}")
    ax.set_xlabel(X_LABELS.get(x, x))
    ax.set_ylabel("held-out loss (nats / target token)")
    ax.set_title(title or "Held-out loss during training (line: mean over seeds; band: ± std)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, fontsize=9)
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | os.PathLike) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


__all__ = [
    "curve_band",
    "plot_eval",
    "plot_lengths",
    "plot_loss_curves",
    "plot_throughput",
    "plot_time_to_quality",
    "spread",
]
