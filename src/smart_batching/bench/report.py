"""Render bench records into a report a person wants to read: Markdown, self-contained HTML, PNGs.

:func:`render_report` reads ``records.jsonl`` and writes, into ``out_dir``:

* ``report.md``: tables and the plots as linked PNG files;
* ``report.html``: the same content with the PNGs embedded (base64), one file to send around;
* ``bench-<id>-{throughput,loss,eval,lengths}.png``: the plots (:mod:`smart_batching.bench.plots`).

Every bench in the file (one ``bench_id`` per ``run_bench`` call) gets its own section: the machine
and versions next to the numbers, the settings, a summary table per strategy (speed as ratios to
``random`` of the same bench, seed by seed; eval with its spread across seeds; what was truncated or
dropped), the plots, sample generations and one row per run. :func:`summary_table` is the same
summary as one screen of plain text.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from smart_batching.bench.plots import plot_eval, plot_lengths, plot_loss_curves, plot_throughput, spread
from smart_batching.planners import BASELINE_STRATEGY


class ReportPaths(NamedTuple):
    """What :func:`render_report` wrote."""

    markdown: Path
    html: Path
    plots: list[Path]


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
        "step p50/p90 ms", "padding", "token slots", "x random slots", "peak MB", "train loss", "eval loss", "ppl", "task metric",
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


SCREEN_COLUMNS = ("strategy", "steps", "wall s", "CPU s", "x random", "x random CPU", "x random slots", "padding", "peak MB",
                  "eval loss", "task metric", "truncated / dropped")  # fmt: skip


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
# Document: one list of blocks, rendered to Markdown and to HTML
# --------------------------------------------------------------------------------------------------


class _Doc:
    def __init__(self) -> None:
        self.blocks: list[tuple[str, Any]] = []

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def ul(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(self, headers: list[str], rows: list[list[str]]) -> None:
        self.blocks.append(("table", (headers, rows)))

    def img(self, path: Path, alt: str) -> None:
        self.blocks.append(("img", (path, alt)))

    def pre(self, text: str) -> None:
        self.blocks.append(("pre", text))

    def markdown(self, base: Path) -> str:
        out = []
        for kind, value in self.blocks:
            if kind == "h":
                out.append(f"{'#' * value[0]} {value[1]}")
            elif kind == "p":
                out.append(value)
            elif kind == "ul":
                out.append("\n".join(f"- {item}" for item in value))
            elif kind == "table":
                headers, rows = value
                esc = [[c.replace("|", "\\|").replace("\n", " ") for c in r] for r in [headers, *rows]]
                out.append("\n".join(["| " + " | ".join(esc[0]) + " |", "|" + "---|" * len(headers)]
                                     + ["| " + " | ".join(r) + " |" for r in esc[1:]]))  # fmt: skip
            elif kind == "img":
                out.append(f"![{value[1]}]({os.path.relpath(value[0], base)})")
            elif kind == "pre":
                out.append("```text\n" + value + "\n```")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body = []
        for kind, value in self.blocks:
            if kind == "h":
                body.append(f"<h{value[0]}>{_inline(value[1])}</h{value[0]}>")
            elif kind == "p":
                body.append(f"<p>{_inline(value)}</p>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in value) + "</ul>")
            elif kind == "table":
                headers, rows = value
                head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
                cells = "".join(
                    "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
                )
                body.append(
                    f"<div class='scroll'><table><thead><tr>{head}</tr></thead><tbody>{cells}</tbody></table></div>"
                )
            elif kind == "img":
                data = base64.b64encode(Path(value[0]).read_bytes()).decode("ascii")
                body.append(f"<img alt='{html.escape(value[1])}' src='data:image/png;base64,{data}'>")
            elif kind == "pre":
                body.append(f"<pre>{html.escape(value)}</pre>")
        return _HTML.format(title=html.escape(title), body="\n".join(body))


def _inline(text: str) -> str:
    """Markdown ``code`` and **bold** to HTML, everything else escaped."""
    import re

    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    return re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)


_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: -apple-system, "Segoe UI", Roboto, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em;
       color: #222; line-height: 1.45; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }}
th, td {{ border: 1px solid #ccc; padding: 3px 7px; text-align: right; white-space: nowrap; }}
th {{ background: #f0f0f0; }} td:first-child, th:first-child {{ text-align: left; }}
.scroll {{ overflow-x: auto; }} img {{ max-width: 100%; margin: 0.5em 0; }}
pre {{ background: #f7f7f7; padding: 0.6em; white-space: pre-wrap; font-size: 0.85em; }}
code {{ background: #f3f3f3; padding: 0 3px; }}
</style></head><body>
{body}
</body></html>
"""


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def _short(text: str | None, limit: int = 400) -> str:
    text = (text or "").strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bench_section(doc: _Doc, bench_id: str, recs: list[dict[str, Any]], out: Path) -> list[Path]:
    from smart_batching.bench.machine import machine_line

    first = recs[0]
    data, s, v = first.get("data") or {}, first.get("settings") or {}, first.get("versions") or {}
    ok = [r for r in recs if r.get("status") == "ok"]
    doc.h(2, f"{first.get('model')} on {data.get('source')}: {first.get('task')} (bench `{bench_id}`)")
    machine = first.get("machine") or {}
    loads = [r.get("load_average_start") for r in ok if r.get("load_average_start") is not None]
    load_note = ""
    if loads and machine.get("cores") and max(loads) > 0.5 * machine["cores"]:
        load_note = (
            f" Load average during the runs: {min(loads):.1f}–{max(loads):.1f} on {machine['cores']} cores: other "
            "processes were running: absolute speeds are low, and wall and CPU times vary from run to run (see the "
            "spread across seeds); token slots and padding do not depend on the machine."
        )
    lengths = data.get("lengths") or {}
    trunc = data.get("truncation") or {}
    info = s.get("model_info") or {}
    doc.ul(
        [
            f"**Machine:** {machine_line(machine)}; {machine.get('memory_gb', '?')} GB RAM.{load_note}",
            f"**Versions:** torch {v.get('torch')}, transformers {v.get('transformers')}, smart_batching "
            f"{v.get('smart_batching')}, Python {v.get('python')}.",
            f"**Model:** `{first.get('model')}` ({info.get('class')}, {info.get('num_parameters', 0):,} parameters, "
            f"{info.get('num_hidden_layers')} layers, hidden {info.get('hidden_size')}), tokenizer `{s.get('tokenizer')}`; "
            "every run starts from the same initial weights.",
            f"**Data:** {data.get('num_train', 0):,} training examples ({data.get('format') or 'text + label'}), "
            f"{s.get('epochs')} epoch(s), same examples for every strategy; tokens per example: mean "
            f"{lengths.get('mean', 0):.0f}, median {lengths.get('p50', 0):.0f}, p90 {lengths.get('p90', 0):.0f}, max "
            f"{lengths.get('max', 0):,}. "
            + (
                f"Truncated at max_length={trunc['max_length']}: {trunc.get('num_truncated', 0):,} examples "
                f"({trunc.get('truncated_tokens', 0):,} tokens), for every strategy alike."
                if trunc.get("max_length")
                else "No truncation (no max_length)."
            ),
            f"**Eval:** {data.get('num_eval')} held-out examples ({data.get('eval_source')}), plain padded batches of "
            f"{s.get('eval_batch_size')} for every strategy; {s.get('num_generations')} greedy generations of up to "
            f"{s.get('max_new_tokens')} tokens.",
            f"**Settings:** batch_size {s.get('batch_size')} (random, max_length, group_by_length), max_tokens "
            f"{s.get('max_tokens')} (token_budget), capacity {s.get('capacity')} (packed, one row per batch), lr "
            f"{s.get('lr')} {s.get('lr_schedule')}, {s.get('optimizer')}, grad clip {s.get('max_grad_norm')}, seeds "
            f"{', '.join(str(x) for x in s.get('seeds', []))}, device {s.get('device')}"
            + (f", {s['nproc']} processes per run." if (s.get("nproc") or 1) > 1 else "."),
        ]
    )
    doc.h(3, "Summary")
    headers, rows = summary_rows(recs)
    doc.table(headers, rows)
    digests = {r.get("examples_digest") for r in ok}
    notes = [
        "Ratios are against `random` of the same bench, seed by seed (>1: better than random): `x random` is the "
        "tokens/s ratio (same tokens, so also the wall-time speed-up), `x random CPU` the ratio of process CPU time "
        "(all threads; with one thread it is the steadier figure on a shared machine, with several, threads that "
        "wait for a descheduled sibling spin and inflate it), `x random slots` the ratio of token slots computed "
        "(deterministic: the compute the batching saves, whatever else runs on the machine). Several seeds: mean "
        "± std (min–max with 2). Step times are optimizer steps (forward, backward, update), without data loading; "
        "wall and CPU time cover everything `trainer.train()` does.",
        "Padding is measured on the batches the model computed (`packed` rows hold no padding); token slots are "
        "rows × width summed over every batch.",
    ]
    if len(digests) == 1 and ok:
        notes.append(
            f"Same data check: every run trained on the identical multiset of (example, tokens), digest "
            f"`{next(iter(digests))}`, {ok[0]['num_examples_seen']:,} examples and {ok[0]['real_tokens']:,} real tokens each."
        )
    elif ok:
        notes.append(
            f"**Warning:** runs trained on different data (digests {', '.join(sorted(map(str, digests)))})."
        )
    for r in recs:
        if r.get("status") == "skipped" and r["strategy"] not in {o["strategy"] for o in ok}:
            notes.append(f"`{r['strategy']}` was skipped: {r.get('skip_reason')}.")
            break
    initial = first.get("eval_initial") or {}
    if initial.get("loss") is not None:
        init_metric = initial.get("task_metric")
        extra = f", {init_metric['name']} {100 * init_metric['value']:.1f}%" if init_metric else ""
        notes.append(f"Before training: eval loss {initial['loss']:.4f}{extra}.")
    nproc = max((r.get("world_size") or 1 for r in recs), default=1)
    if nproc > 1:
        notes.append(
            f"Every run trained on {nproc} processes (torchrun) over one balanced plan, each example once per epoch "
            "across them: tokens/s counts every process's real tokens over the slowest process's wall time, CPU time "
            "is summed over the processes, step times are the slowest process's, peak memory is the largest single "
            "process (`peak_memory_mb_per_rank` in the records). Eval and generations ran once, in the bench "
            "process, on the trained weights."
        )
    if first.get("memory_kind") == "cpu_rss_peak":
        notes.append(
            "Peak memory on CPU is the sampled process RSS (the model, optimizer and everything else the process holds), "
            "not only activations."
        )
    doc.ul(notes)

    plots: list[Path] = []
    if ok:
        ratios = {k: float(np.mean(v)) for k, v in speed_ratios(recs).items()}
        stem = out / f"bench-{bench_id}"
        plots = [
            plot_throughput(ok, f"{stem}-throughput.png", ratios),
            plot_loss_curves(ok, f"{stem}-loss.png"),
            plot_eval(ok, f"{stem}-eval.png"),
            plot_lengths(ok, f"{stem}-lengths.png"),
        ]
        doc.h(3, "Plots")
        for path, alt in zip(
            plots, ("throughput, padding, memory", "loss curves", "eval", "lengths"), strict=True
        ):
            doc.img(path, alt)
        _generations(doc, ok)
    doc.h(3, "Runs")
    run_headers = ["#", "strategy", "seed", "steps", "wall s", "CPU s", "tokens/s", "padding", "step p50 ms", "iter p50 ms",
                   "peak MB", "train loss", "eval loss", "task metric", "load avg start/end"]  # fmt: skip
    run_rows = []
    for r in recs:
        if r.get("status") != "ok":
            run_rows.append([str(r.get("run_index")), r["strategy"], str(r["seed"]), "skipped", *[""] * 11])
            continue
        m = r.get("task_metric")
        la, lb = r.get("load_average_start"), r.get("load_average_end")
        run_rows.append(
            [
                str(r["run_index"]), r["strategy"], str(r["seed"]), str(r["num_steps"]), f"{r['wall_seconds']:.1f}",
                f"{r.get('cpu_seconds') or 0:.1f}",
                f"{r['tokens_per_second']:,.0f}", f"{100 * r['padding_ratio']:.1f}%",
                f"{1000 * (r['step_seconds'].get('p50') or 0):,.0f}", f"{1000 * (r['iteration_seconds'].get('p50') or 0):,.0f}",
                f"{r.get('peak_memory_mb') or 0:,.0f}", f"{r.get('train_loss_final') or float('nan'):.3f}",
                f"{(r.get('eval') or {}).get('loss', float('nan')):.4f}",
                "-" if not m else f"{100 * m['value']:.1f}% ({m['correct']}/{m['total']})",
                "-" if la is None else f"{la:.1f} / {lb:.1f}",
            ]
        )  # fmt: skip
    doc.table(run_headers, run_rows)
    return plots


def _generations(doc: _Doc, ok: list[dict[str, Any]]) -> None:
    by_strategy: dict[str, dict[str, Any]] = {}
    for r in ok:
        by_strategy.setdefault(r["strategy"], r)  # the first seed of each strategy
    first = next(iter(by_strategy.values()))
    gens = first.get("generations") or []
    if not gens:
        return
    classification = first.get("task") == "classification"
    doc.h(3, "Sample predictions" if classification else "Sample generations")
    doc.p(
        "Held-out inputs, the same for every strategy; greedy decoding after training (first seed of each strategy)."
        if not classification
        else "Held-out sentences, predicted label per strategy (first seed of each strategy)."
    )
    for k, g in enumerate(gens):
        doc.p(f"**Prompt {k + 1}:**")
        doc.pre(_short(g.get("prompt"), 600))
        if g.get("reference"):
            doc.p("Reference: " + _short(g["reference"], 300).replace("\n", " "))
        lines = []
        for name, r in by_strategy.items():
            rg = r.get("generations") or []
            if k < len(rg):
                mark = ""
                if "correct" in rg[k]:
                    mark = " [correct]" if rg[k]["correct"] else " [wrong]"
                lines.append(f"{name}{mark}: {_short(rg[k].get('output'), 500)!r}")
        doc.pre("\n".join(lines))


def render_report(records_path: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> ReportPaths:
    """Render the Markdown and HTML report (and its PNG plots) from a ``records.jsonl`` file.

    Args:
        records_path: JSON lines written by :func:`~smart_batching.bench.runner.run_bench`.
        out_dir: where to write; None means the folder of ``records_path``.

    Returns:
        The paths of ``report.md``, ``report.html`` and the plots.

    Raises:
        DataError: the file holds no records or a malformed line.
    """
    from smart_batching.bench.records import read_records
    from smart_batching.errors import DataError

    path = Path(records_path)
    records = read_records(path)
    if not records:
        raise DataError(f"{path} holds no bench records")
    out = Path(out_dir) if out_dir is not None else path.parent
    out.mkdir(parents=True, exist_ok=True)
    doc = _Doc()
    benches = group_benches(records)
    doc.h(1, "smart-batching bench report")
    doc.p(
        f"Rendered from `{path.name}`: {len(records)} run(s) in {len(benches)} bench(es). Each bench fine-tunes one "
        "model from the same initial weights on the same examples once per batching strategy and seed; only the "
        "batching differs. Re-render with `smart-batching report " + str(path) + "`."
    )
    plots: list[Path] = []
    for bench_id, recs in benches.items():
        plots += _bench_section(doc, bench_id, recs, out)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(doc.markdown(out), encoding="utf-8")
    html_path.write_text(doc.html("smart-batching bench report"), encoding="utf-8")
    return ReportPaths(md_path, html_path, plots)


__all__ = [
    "ReportPaths",
    "fmt_spread",
    "group_benches",
    "render_report",
    "speed_ratios",
    "summary_rows",
    "summary_table",
]
