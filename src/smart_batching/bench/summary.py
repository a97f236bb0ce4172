"""The summary of a bench: per strategy, speed as ratios to the baseline of the same bench (seed by
seed), eval with its spread across seeds, what was cut; as rows, and as one screen of plain text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from smart_batching.analysis.randomness import pairs_cell
from smart_batching.bench.plots import spread
from smart_batching.planners import BASELINE_STRATEGY

# --------------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------------


def group_benches(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records by ``bench_id``, in file order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(str(r.get("bench_id", "?")), []).append(r)
    return out


def _strategies(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault(r["strategy"], []).append(r)
    return out


def speed_ratios(
    records: Sequence[dict[str, Any]], baseline: str = BASELINE_STRATEGY, *, key: str = "wall_seconds"
) -> dict[str, list[float]]:
    """Per strategy, the speed-up over ``baseline`` for each seed that both ran (same bench).

    Every run of a bench trains on the same tokens, so the speed-up is ``baseline time / run time``
    (``key="wall_seconds"``: the tokens/s ratio; ``key="cpu_seconds"``: process CPU time;
    ``key="token_slots"``: the padded compute, which no other process on the machine can disturb).
    """
    base = {r["seed"]: r.get(key) for r in records if r["strategy"] == baseline and r.get("status") == "ok"}
    out: dict[str, list[float]] = {}
    for r in records:
        if r.get("status") == "ok" and base.get(r["seed"]) and r.get(key):
            out.setdefault(r["strategy"], []).append(base[r["seed"]] / r[key])
    return out


def fmt_spread(values: Sequence[float | None], fmt: str = "{:.3f}", *, compact: bool = False) -> str:
    """``v`` for one value, ``v (lo–hi)`` for two, ``mean ± std`` for more; ``-`` for none.

    ``compact=True`` writes ``v±d`` in every case (``d``: half the range for two values, the std for more).
    """
    vals = [v for v in values if v is not None and np.isfinite(v)]
    if not vals:
        return "-"
    center, lo, hi = spread(vals)
    if len(vals) == 1:
        return fmt.format(center)
    if compact:
        return f"{fmt.format(center)}±{fmt.format((hi - lo) / 2)}"
    if len(vals) == 2:
        return f"{fmt.format(center)} ({fmt.format(lo)}–{fmt.format(hi)})"
    return f"{fmt.format(center)} ± {fmt.format(hi - center)}"


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _cut_cell(r: dict[str, Any]) -> str:
    d = r.get("dropped") or {}
    parts = []
    if d.get("num_truncated"):
        parts.append(f"{d['num_truncated']:,} truncated ({d.get('truncated_tokens', 0):,} tok)")
    for key, word in (("num_dropped_by_plan", "dropped"), ("num_split_by_plan", "split")):
        if d.get(key):
            parts.append(f"{d[key]:,} {word}")
    if d.get("num_examples_not_seen"):
        parts.append(f"{d['num_examples_not_seen']:,} not seen")
    return ", ".join(parts) or "none"


def _pairs_cell(runs: list[dict[str, Any]]) -> str:
    """``pair_repeat`` (mean over seeds) with its random baseline: ``41% (r 2%)``; ``-`` without."""
    rand = [r.get("randomness") or {} for r in runs]
    return pairs_cell(
        _mean([x.get("pair_repeat") for x in rand]), _mean([x.get("pair_repeat_random") for x in rand]), "-"
    )


def _metric_cell(runs: list[dict[str, Any]], compact: bool = False) -> str:
    metrics = [r.get("task_metric") for r in runs if r.get("task_metric")]
    if not metrics:
        return "-"
    values = [100 * m["value"] for m in metrics]
    cell = fmt_spread(values, "{:.1f}", compact=compact) + "%"
    if len(metrics) == 1:
        cell += f" ({metrics[0]['correct']}/{metrics[0]['total']})"
    return cell


def summary_rows(
    records: Sequence[dict[str, Any]], *, compact: bool = False
) -> tuple[list[str], list[list[str]]]:
    """Headers and one row per strategy of one bench (strings, ready for any table format).

    ``compact=True`` writes spreads across seeds as ``v±d`` (see :func:`fmt_spread`).
    """

    def cell(values: Sequence[float | None], fmt: str) -> str:
        return fmt_spread(values, fmt, compact=compact)

    headers = [
        "strategy", "seeds", "steps", "examples", "wall s", "CPU s", "tokens/s", "x random", "x random CPU", "samples/s",
        "step p50/p90 ms", "padding", "pairs again", "token slots", "x random slots", "peak MB", "train loss", "eval loss", "ppl", "task metric",
        "truncated / dropped",
    ]  # fmt: skip
    ratios = speed_ratios(records)
    cpu_ratios = speed_ratios(records, key="cpu_seconds")
    slot_ratios = speed_ratios(records, key="token_slots")
    rows = []
    for name, runs in _strategies(records).items():
        ok = [r for r in runs if r.get("status") == "ok"]
        if not ok:
            rows.append(
                [
                    name,
                    str(len(runs)),
                    *["-"] * (len(headers) - 3),
                    "skipped: " + str(runs[0].get("skip_reason", "")).split(":")[0],
                ]
            )
            continue
        steps = sorted({r["num_steps"] for r in ok})
        p50 = _mean([(r.get("step_seconds") or {}).get("p50") for r in ok])
        p90 = _mean([(r.get("step_seconds") or {}).get("p90") for r in ok])
        ppl = [(r.get("eval") or {}).get("perplexity") for r in ok]
        rows.append(
            [
                name,
                ",".join(str(r["seed"]) for r in ok),
                "/".join(str(s) for s in steps),
                f"{_mean([r['num_examples_seen'] for r in ok]):,.0f}",
                cell([r["wall_seconds"] for r in ok], "{:.1f}"),
                cell([r.get("cpu_seconds") for r in ok], "{:.1f}"),
                cell([r["tokens_per_second"] for r in ok], "{:,.0f}"),
                cell(ratios.get(name, []), "{:.2f}") + ("x" if ratios.get(name) else ""),
                cell(cpu_ratios.get(name, []), "{:.2f}") + ("x" if cpu_ratios.get(name) else ""),
                cell([r["samples_per_second"] for r in ok], "{:.2f}"),
                "-" if p50 is None else f"{1000 * p50:,.0f} / {1000 * (p90 or 0):,.0f}",
                cell([100 * r["padding_ratio"] for r in ok], "{:.1f}") + "%",
                _pairs_cell(ok),
                f"{_mean([r['token_slots'] for r in ok]):,.0f}",
                cell(slot_ratios.get(name, []), "{:.2f}") + ("x" if slot_ratios.get(name) else ""),
                cell([r.get("peak_memory_mb") for r in ok], "{:,.0f}"),
                cell([r.get("train_loss_final") for r in ok], "{:.3f}"),
                cell([(r.get("eval") or {}).get("loss") for r in ok], "{:.4f}"),
                cell([p for p in ppl if p is not None], "{:,.2f}"),
                _metric_cell(ok, compact),
                _cut_cell(ok[0]),
            ]
        )
    return headers, rows


def _text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


SCREEN_COLUMNS = ("strategy", "steps", "wall s", "CPU s", "x random", "x random CPU", "x random slots", "padding",
                  "pairs again", "peak MB", "eval loss", "task metric", "truncated / dropped")  # fmt: skip


def summary_table(records: Sequence[dict[str, Any]]) -> str:
    """One screen of plain text per bench: a header line and one row per strategy."""
    from smart_batching.bench.machine import machine_line

    blocks = []
    for bench_id, recs in group_benches(records).items():
        headers, rows = summary_rows(recs, compact=True)
        keep = [headers.index(c) for c in SCREEN_COLUMNS]
        first = recs[0]
        data = first.get("data") or {}
        s = first.get("settings") or {}
        head = (
            f"bench {bench_id}: {first.get('model')} on {data.get('source')} ({first.get('task')}), "
            f"{s.get('num_examples')} examples x {s.get('epochs')} epoch(s), batch_size {s.get('batch_size')}, "
            f"max_tokens/capacity {s.get('max_tokens')}/{s.get('capacity')}"
            + (f", {s['nproc']} processes per run" if (s.get("nproc") or 1) > 1 else "")
            + "\n"
            f"machine: {machine_line(first.get('machine') or {})}"
        )
        table = _text_table([headers[i] for i in keep], [[r[i] for i in keep] for r in rows])
        blocks.append(f"{head}\n{table}")
    return "\n\n".join(blocks)


# --------------------------------------------------------------------------------------------------
# Time to target
# --------------------------------------------------------------------------------------------------

# Two-sided 95 % Student t quantiles by degrees of freedom (no scipy in the base install).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_quantile(dof: int) -> float:
    """The two-sided 95 % Student t quantile for ``dof`` degrees of freedom (close above 10)."""
    return _T975.get(dof, 1.96 + 2.4 / max(dof, 1))


TTT_MEASURES = (("wall_seconds", "wall"), ("cpu_seconds", "CPU"), ("tokens", "tokens"), ("steps", "steps"))


def ratio_interval(ratios: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """``(median, low, high)`` of per-seed ratios: the median, and a 95 % t-interval of the geometric
    mean (on the log ratios); the interval is None with fewer than 2 ratios."""
    vals = np.asarray([r for r in ratios if r is not None and r > 0 and np.isfinite(r)], dtype=np.float64)
    if vals.size == 0:
        return None, None, None
    median = float(np.median(vals))
    if vals.size < 2:
        return median, None, None
    logs = np.log(vals)
    half = t_quantile(vals.size - 1) * float(logs.std(ddof=1)) / np.sqrt(vals.size)
    return median, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def time_to_target_rows(
    records: Sequence[dict[str, Any]], target: float | None = None, baseline: str = BASELINE_STRATEGY
) -> list[dict[str, Any]]:
    """Per strategy of one bench: time to target for each seed and its ratio to ``baseline``'s.

    Each run's target is ``target``, else the final held-out loss of ``baseline`` with the same seed;
    the time is read from the run's ``eval_curve`` (:func:`~smart_batching.bench.curve.time_to_target`).

    Returns:
        One dict per strategy: ``strategy``, ``seeds``, ``reached`` (seeds that reached the target),
        ``reasons`` (why the others did not), and for each of ``wall_seconds``, ``cpu_seconds``,
        ``tokens``, ``steps``: ``median`` (over the seeds that reached it) and ``ratio`` ``{"median",
        "low", "high", "n"}`` (per seed, run over baseline, both reached; interval: 95 % of the
        geometric mean).
    """
    from smart_batching.bench.curve import run_target, time_to_target

    ok = [r for r in records if r.get("status") == "ok"]
    ttt: dict[tuple[str, int], dict[str, Any]] = {}
    for r in ok:
        goal = run_target(r, ok, target)
        ttt[(r["strategy"], r["seed"])] = (
            time_to_target(r.get("eval_curve"), goal)
            if goal is not None
            else {"reached": False, "reason": f"no target: no {baseline} run with seed {r['seed']}"}
        )
    rows = []
    for name, runs in _strategies(ok).items():
        seeds = [r["seed"] for r in runs]
        reached = [s for s in seeds if ttt[(name, s)]["reached"]]
        row: dict[str, Any] = {
            "strategy": name,
            "seeds": seeds,
            "reached": reached,
            "reasons": sorted({str(ttt[(name, s)].get("reason")) for s in seeds if s not in reached}),
            "targets": {s: ttt[(name, s)].get("target") for s in seeds},
        }
        for key, _ in TTT_MEASURES:
            values = [ttt[(name, s)][key] for s in reached]
            pairs = [
                ttt[(name, s)][key] / ttt[(baseline, s)][key]
                for s in reached
                if (baseline, s) in ttt and ttt[(baseline, s)]["reached"] and ttt[(baseline, s)][key]
            ]
            median, low, high = ratio_interval(pairs)
            row[key] = {
                "median": float(np.median(values)) if values else None,
                "ratio": {"median": median, "low": low, "high": high, "n": len(pairs)},
            }
        rows.append(row)
    return rows


def _ratio_cell(ratio: dict[str, Any]) -> str:
    if ratio["median"] is None:
        return "-"
    if ratio["low"] is None:
        return f"{ratio['median']:.2f}x"
    return f"{ratio['median']:.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}]"


def time_to_target_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and one row of strings per strategy of :func:`time_to_target_rows` (ratios: median over
    seeds and the 95 % interval, below 1 reaches the target sooner than the baseline)."""
    headers = ["strategy", "reached", "wall s", "x random wall", "CPU s", "x random CPU", "tokens",
               "x random tokens", "steps", "x random steps"]  # fmt: skip
    out = []
    for row in rows:
        cells = [row["strategy"], f"{len(row['reached'])}/{len(row['seeds'])}"]
        for key, fmt in (
            ("wall_seconds", "{:.1f}"),
            ("cpu_seconds", "{:.1f}"),
            ("tokens", "{:,.0f}"),
            ("steps", "{:.0f}"),
        ):
            median = row[key]["median"]
            cells += ["-" if median is None else fmt.format(median), _ratio_cell(row[key]["ratio"])]
        out.append(cells)
    return headers, out
