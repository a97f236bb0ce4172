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

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from smart_batching.bench._doc import _Doc
from smart_batching.bench.plots import plot_eval, plot_lengths, plot_loss_curves, plot_throughput
from smart_batching.bench.summary import (
    fmt_spread,
    group_benches,
    speed_ratios,
    summary_rows,
    summary_table,
)


class ReportPaths(NamedTuple):
    """What :func:`render_report` wrote."""

    markdown: Path
    html: Path
    plots: list[Path]


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
            f"{', '.join(str(x) for x in s.get('seeds', []))}, device {s.get('device')}, precision "
            f"{s.get('precision', 'fp32')}"
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
        "`pairs again` is what the padding saved costs in randomness: of the examples next to each other in a batch "
        "(a row, when packing) of epoch 0, the share that meet in one again in epoch 1, from the strategy's plans "
        "with the run's seed; `(r ...)` is what random batches of the same sizes give.",
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
        balances = [r["rank_balance"] for r in ok if r.get("rank_balance")]
        if balances:
            notes.append(
                "Rank balance (`rank_balance` in the records): per step, the busiest process's token slots over the "
                f"mean process's (1.00 is even): mean {np.mean([b['mean'] for b in balances]):.2f}, worst step "
                f"{max(b['max'] for b in balances):.2f}."
            )
    if s.get("batch_schedule"):
        unit = s.get("schedule_unit") or "tokens for token_budget and packed, examples for the others"
        notes.append(
            f"Batch schedule `{s['batch_schedule']}` ({unit} per optimizer step), learning-rate scaling "
            f"{s.get('lr_scaling') or 'none'}: each step ran as many micro-batches of the strategy's budget as its "
            "size needed (the plot shows the realised sizes against the schedule)."
        )
    backoffs = {
        r["strategy"]: (r.get("oom_backoff") or {}).get("num_backoffs", 0) for r in ok if r.get("oom_backoff")
    }
    if backoffs:
        notes.append(
            "Out-of-memory back-off on: "
            + ", ".join(f"`{k}` {v} back-off(s)" for k, v in backoffs.items())
            + " (a micro-batch that failed was split within its step; `oom_backoff` in the records has the events)."
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
        alts = ["throughput, padding, memory", "loss curves", "eval", "lengths"]
        scheduled = [r for r in ok if r.get("schedule")]
        if scheduled:  # the batch schedule as each run realised it
            from smart_batching.analysis.plots import plot_schedule

            unit = s.get("schedule_unit") or "each strategy's unit"
            series = [
                {"label": f"{r['strategy']} seed {r['seed']}", "size": r["schedule"]["size"],
                 "target": r["schedule"]["target"], "unit": s.get("schedule_unit") or "tokens or examples"}
                for r in scheduled
            ]  # fmt: skip
            plots.append(
                plot_schedule(
                    series, f"{stem}-schedule.png", title=f"batch schedule {s.get('batch_schedule')} ({unit})"
                )
            )
            alts.append("batch schedule")
        doc.h(3, "Plots")
        for path, alt in zip(plots, alts, strict=True):
            doc.img(path, alt)
        plots += _time_to_target_section(doc, ok, s, stem)
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


def _time_to_target_section(doc: _Doc, ok: list[dict[str, Any]], s: dict[str, Any], stem: Path) -> list[Path]:
    """Time to target (table) and held-out loss against training time (plot), where the runs have a
    held-out curve with points between the start and the end (``--eval-every``)."""
    if not any(len((r.get("eval_curve") or {}).get("step") or []) > 2 for r in ok):
        return []
    from smart_batching.bench.plots import plot_time_to_quality
    from smart_batching.bench.summary import time_to_target_rows, time_to_target_table

    target = s.get("target")
    doc.h(3, "Time to target")
    goal = (
        f"held-out loss {target:.4f} (`--target`)"
        if target is not None
        else "the final held-out loss of `random` with the same seed"
    )
    overhead = [
        r["eval_overhead"]["wall_ratio"] for r in ok if (r.get("eval_overhead") or {}).get("wall_ratio")
    ]
    doc.ul(
        [
            f"Target: {goal}. Each run's time is read at the first evaluation at or below the target "
            f"(evaluations every {s.get('eval_every')}); wall and CPU seconds are of training only, evaluations "
            "left out. Ratios are per seed against `random`: the median over seeds and a 95 % interval "
            "(geometric mean); below 1 reaches the target sooner.",
            *(
                [
                    f"Evaluation during training took {100 * min(overhead):.1f}–{100 * max(overhead):.1f} % of the "
                    "training wall time, kept off the clock."
                ]
                if overhead
                else []
            ),
        ]
    )
    rows = time_to_target_rows(ok, target)
    headers, cells = time_to_target_table(rows)
    doc.table(headers, cells)
    never = [f"`{r['strategy']}`: {'; '.join(r['reasons'])}" for r in rows if r["reasons"]]
    if never:
        doc.ul(never)
    path = plot_time_to_quality(ok, f"{stem}-time-to-target.png", target=target)
    doc.img(path, "held-out loss against training wall time")
    return [path]


def _generations(doc: _Doc, ok: list[dict[str, Any]]) -> None:
    by_strategy: dict[str, dict[str, Any]] = {}
    for r in ok:
        by_strategy.setdefault(r["strategy"], r)  # the first seed of each strategy
    first = next(iter(by_strategy.values()))
    gens = first.get("generations") or []
    if not gens:
        return
    before = (first.get("eval_initial") or {}).get("generations") or []
    classification = first.get("task") == "classification"
    doc.h(3, "Sample predictions" if classification else "Sample generations")
    doc.p(
        "Held-out inputs, the same for every strategy; greedy decoding after training (first seed of each strategy)"
        + (", and of the initial weights (`before training`)." if before else ".")
        if not classification
        else "Held-out sentences, predicted label per strategy (first seed of each strategy)."
    )
    for k, g in enumerate(gens):
        doc.p(f"**Prompt {k + 1}:**")
        doc.pre(_short(g.get("prompt"), 600))
        if g.get("reference"):
            doc.p("Reference: " + _short(g["reference"], 300).replace("\n", " "))
        lines = []
        if k < len(before):
            lines.append(f"before training: {_short(before[k].get('output'), 500)!r}")
        for name, r in by_strategy.items():
            rg = r.get("generations") or []
            if k < len(rg):
                mark = ""
                if "correct" in rg[k]:
                    mark = " [correct]" if rg[k]["correct"] else " [wrong]"
                lines.append(f"{name}{mark}: {_short(rg[k].get('output'), 500)!r}")
        doc.pre("\n".join(lines))


Lead = Callable[[_Doc, list[dict[str, Any]], Path], list[Path]]
"""A report's opening sections: ``lead(doc, records, out_dir)`` adds blocks to ``doc`` (``h``, ``p``, ``ul``,
``table``, ``img``, ``pre``) and returns the plots it wrote (the demo's headline: :mod:`~.demo`)."""


def render_report(
    records_path: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    *,
    title: str = "smart-batching bench report",
    lead: Lead | None = None,
) -> ReportPaths:
    """Render the Markdown and HTML report (and its PNG plots) from a ``records.jsonl`` file.

    Args:
        records_path: JSON lines written by :func:`~smart_batching.bench.runner.run_bench`.
        out_dir: where to write; None means the folder of ``records_path``.
        title: the report's heading and HTML title.
        lead: sections placed before the benches' own (see :data:`Lead`); None: none.

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
    doc.h(1, title)
    plots: list[Path] = lead(doc, records, out) if lead is not None else []
    doc.p(
        f"Rendered from `{path.name}`: {len(records)} run(s) in {len(benches)} bench(es). Each bench fine-tunes one "
        "model from the same initial weights on the same examples once per batching strategy and seed; only the "
        "batching differs. Re-render with `smart-batching report " + str(path) + "`."
    )
    for bench_id, recs in benches.items():
        plots += _bench_section(doc, bench_id, recs, out)
    md_path, html_path = out / "report.md", out / "report.html"
    md_path.write_text(doc.markdown(out), encoding="utf-8")
    html_path.write_text(doc.html(title), encoding="utf-8")
    return ReportPaths(md_path, html_path, plots)


__all__ = [
    "Lead",
    "ReportPaths",
    "fmt_spread",
    "group_benches",
    "render_report",
    "speed_ratios",
    "summary_rows",
    "summary_table",
]
