"""Adaptive batch size: what a ramp of tokens per step costs and gives, and what an out-of-memory
back-off costs.

Two studies, each a set of bench runs (:func:`smart_batching.bench.run_bench`: a tiny Llama trained by
``SmartBatchingTrainer`` on the first ``--examples`` GSM8K train records, evaluated on held-out GSM8K
test records; the embedded default data when GSM8K is absent), side by side in one process:

1. **Ramp against the final size.** ``packed`` (rows of ``--capacity`` tokens, examples truncated to
   ``--max-length``) with
   ``batch_schedule="linear:START->FINAL@RAMP%"`` against the same run with a constant schedule of
   ``FINAL`` tokens per step (``"0:FINAL"``), same examples, same epochs, same seeds, linear learning
   rate decay to 0 over each run's own step count. Reported: optimizer steps, real tokens/s (wall and
   process CPU time) and the held-out loss, with the ramp's ratios to the final-size run, seed by seed.
2. **Back-off cost.** ``packed`` without a schedule, ``gradient_accumulation_steps=1``: the plain run,
   the run with ``oom_backoff=True`` and nothing failing (its overhead), runs whose micro-batches over
   ``--fail-over`` token slots fail (an injected fault at the middle layer, in forward, and half-way
   through backward, which also re-runs what the step had done), and the run planned from the start
   with the budget the failing runs ended with. The extra time of a failed micro-batch is the time
   spent in failed attempts and re-runs (``failed_seconds``) per failure; the rest of the difference to
   the plain run is the cost of running smaller pieces afterwards (the planned run shows it alone).
   These runs use the first seed only: they train the same weights by construction (the held-out loss
   column shows it); only their time differs.

Every record (``--json``: one JSON line each) names its ``strategy`` (``packed``) and ``variant``. Timings
on a shared machine are noisy: the table gives CPU time next to wall time and the load average, and
ratios are taken within one process, run by run.

Usage::

    python benchmarks/adaptive_batching.py --quick     # 96 examples, 1 seed
    python benchmarks/adaptive_batching.py --json      # 384 examples, 3 seeds, JSON lines
    python benchmarks/adaptive_batching.py --overhead 4 --examples 96   # back-off overhead alone, 4 pairs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def bench(common: dict[str, Any], variant: str, **settings: Any) -> list[dict[str, Any]]:
    """One bench run per seed of ``packed`` with ``settings``; its records, tagged with ``variant``."""
    from smart_batching.bench import run_bench

    with tempfile.TemporaryDirectory(prefix="adaptive-bench-") as out:
        records = run_bench(**common, **settings, out_dir=out, render=False, progress=False)
    for r in records:
        r["variant"] = variant
    return records


def summarise(r: dict[str, Any]) -> dict[str, Any]:
    """The fields this benchmark reports of a bench record."""
    back = r.get("oom_backoff") or {}
    sched = r.get("schedule") or {}
    return {
        "strategy": r["strategy"],
        "variant": r["variant"],
        "seed": r["seed"],
        "num_steps": r["num_steps"],
        "real_tokens": r["real_tokens"],
        "wall_seconds": r["wall_seconds"],
        "cpu_seconds": r["cpu_seconds"],
        "tokens_per_second": r["tokens_per_second"],
        "tokens_per_cpu_second": r["real_tokens"] / r["cpu_seconds"] if r["cpu_seconds"] else None,
        "eval_loss": (r.get("eval") or {}).get("loss"),
        "train_loss_final": r.get("train_loss_final"),
        "first_step_tokens": sched.get("tokens", [None])[0] if sched else None,
        "last_step_tokens": sched.get("tokens", [None, None])[-2]
        if len(sched.get("tokens", [])) > 1
        else None,
        "num_failures": back.get("num_failures"),
        "num_backoffs": back.get("num_backoffs"),
        "budget": back.get("budget"),
        "failed_seconds": back.get("failed_seconds"),
        "seconds_per_failure": back["failed_seconds"] / back["num_failures"]
        if back.get("num_failures")
        else None,
        "peak_memory_mb": r.get("peak_memory_mb"),
        "load_average_start": r.get("load_average_start"),
        "machine": r.get("machine"),
        "batch_schedule": (r.get("settings") or {}).get("batch_schedule"),
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    values = [x[key] for x in rows if x.get(key) is not None]
    return float(np.mean(values)) if values else float("nan")


def _ratio(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> str:
    """Mean ± std over seeds of row / base, paired by seed."""
    by_seed = {b["seed"]: b for b in base}
    r = [x[key] / by_seed[x["seed"]][key] for x in rows if x.get(key) and by_seed.get(x["seed"], {}).get(key)]
    if not r:
        return "-"
    return f"{np.mean(r):.3f}" + (f" ± {np.std(r):.3f}" if len(r) > 1 else "")


def _diff(rows: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> str:
    by_seed = {b["seed"]: b for b in base}
    d = [x[key] - by_seed[x["seed"]][key] for x in rows if x.get(key) is not None and x["seed"] in by_seed]
    if not d:
        return "-"
    return f"{np.mean(d):+.4f}" + (f" ± {np.std(d):.4f}" if len(d) > 1 else "")


def table(rows: list[dict[str, Any]], base_variant: str, variants: list[str]) -> str:
    base = [x for x in rows if x["variant"] == base_variant]
    head = ("variant", "steps", "tokens/s", "x base", "x base CPU", "eval loss", "- base", "failures",
            "s / failure", "first -> last step tokens")  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for v in variants:
        sel = [x for x in rows if x["variant"] == v]
        if not sel:
            continue
        fails = _mean(sel, "num_failures")
        spf = _mean(sel, "seconds_per_failure")
        steps_tokens = (
            f"{_mean(sel, 'first_step_tokens'):,.0f} -> {_mean(sel, 'last_step_tokens'):,.0f}"
            if sel[0].get("first_step_tokens") is not None
            else "-"
        )
        lines.append(" | ".join([
            v, f"{_mean(sel, 'num_steps'):.0f}", f"{_mean(sel, 'tokens_per_second'):,.0f}",
            _ratio(sel, base, "tokens_per_second"), _ratio(sel, base, "tokens_per_cpu_second"),
            f"{_mean(sel, 'eval_loss'):.4f}", _diff(sel, base, "eval_loss"),
            "-" if np.isnan(fails) else f"{fails:.1f}", "-" if np.isnan(spf) else f"{spf:.3f}", steps_tokens,
        ]))  # fmt: skip
    return "\n".join(lines)


def overhead(common: dict[str, Any], seed: int, pairs: int, as_json: bool, say: Any) -> int:
    """``pairs`` × (plain run, run with ``oom_backoff=True`` and nothing failing), alternated; prints
    each pair's ratio of real tokens per CPU second and per wall second, and their median."""
    common = {**common, "seeds": (seed,)}
    rows: list[dict[str, Any]] = []
    for k in range(pairs):
        for variant, extra in (("plain", {}), ("backoff on, no failure", {"oom_backoff": True})):
            (record,) = bench(common, variant, **extra)
            row = summarise(record)
            row["pair"] = k
            rows.append(row)
            if as_json:
                print(json.dumps(row), flush=True)
    ratios = []
    for k in range(pairs):
        plain, on = (r for r in rows if r["pair"] == k)
        ratios.append((on["tokens_per_cpu_second"] / plain["tokens_per_cpu_second"],
                       on["tokens_per_second"] / plain["tokens_per_second"], on["num_steps"], on["load_average_start"]))  # fmt: skip
    say("\npair | back-off on / plain, per CPU s | per wall s | steps | load")
    say("---|---|---|---|---")
    for k, (cpu, wall, steps, load) in enumerate(ratios):
        say(f"{k} | {cpu:.3f} | {wall:.3f} | {steps} | {load}")
    cpu = np.array([r[0] for r in ratios])
    say(
        f"median per CPU s {np.median(cpu):.3f} (min {cpu.min():.3f}, max {cpu.max():.3f}) over {pairs} pairs"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=384, help="training examples (default 384)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the examples (default 2)")
    ap.add_argument("--capacity", type=int, default=1024, help="packed row tokens (default 1024)")
    ap.add_argument("--max-length", type=int, default=256, help="examples truncated to this (default 256)")
    ap.add_argument("--start", type=int, default=512, help="the ramp's first tokens per step (default 512)")
    ap.add_argument("--final", type=int, default=4096, help="the final tokens per step (default 4096)")
    ap.add_argument(
        "--ramp", type=float, default=50.0, help="ramp length, %% of the first epoch (default 50)"
    )
    ap.add_argument(
        "--fail-over", type=int, default=600,
        help="injected failure over these token slots (default 600: rows of up to 1024 fail, and their halves "
        "still hold the longest example)",
    )  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady CPU times)")
    ap.add_argument(
        "--overhead", type=int, default=0, metavar="K",
        help="only the back-off's overhead with nothing failing: K pairs of runs, plain then oom_backoff=True "
        "(first seed), alternated so that drift in the machine's speed falls on both; the ratio per pair",
    )  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="96 examples, 1 seed, 1 epoch")
    ap.add_argument("--json", action="store_true", help="one JSON record per run per line")
    args = ap.parse_args(argv)
    if args.quick:
        args.examples, args.seeds, args.epochs = 96, "0", 1
    seeds = tuple(int(s) for s in args.seeds.split(","))
    data = str(GSM8K) if GSM8K.exists() else "default"
    common = {
        "data": data, "model": "tiny-llama", "strategies": ("packed",), "seeds": seeds,
        "num_examples": args.examples, "epochs": args.epochs, "capacity": args.capacity, "max_length": args.max_length,
        "lr_schedule": "linear", "eval_examples": 64, "num_generations": 0, "threads": args.threads,
    }  # fmt: skip
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    say(
        f"data {data}, {args.examples} examples x {args.epochs} epoch(s), seeds {list(seeds)}, load {os.getloadavg()[0]:.1f}"
    )
    started = time.perf_counter()
    if args.overhead:
        return overhead(common, seeds[0], args.overhead, args.json, say)

    ramp_text = f"linear:{args.start}->{args.final}@{args.ramp:g}%"
    runs = bench(common, "final size", batch_schedule=f"0:{args.final}", schedule_unit="tokens")
    runs += bench(common, "ramp", batch_schedule=ramp_text, schedule_unit="tokens")
    runs += bench(
        common, "ramp, lr sqrt", batch_schedule=ramp_text, schedule_unit="tokens", lr_scaling="sqrt"
    )
    fault = {"fail_over_tokens": args.fail_over}
    common = {**common, "seeds": seeds[:1]}  # back-off: the same weights by construction; one seed times it
    runs += bench(common, "plain")
    runs += bench(common, "backoff on, no failure", oom_backoff=True)
    runs += bench(common, "failure in forward", oom_backoff={**fault, "fail_stage": "forward"})
    backward = bench(common, "failure in backward", oom_backoff={**fault, "fail_stage": "backward"})
    runs += backward
    budget = (backward[0].get("oom_backoff") or {}).get("budget")
    runs += bench(common, "planned at that budget", oom_backoff={"max_tokens": budget})
    rows = [summarise(r) for r in runs]

    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    machine = rows[0]["machine"] or {}
    say(
        f"\nmachine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores; {time.perf_counter() - started:.0f} s in all"
    )
    say(
        f"\n1. ramp {ramp_text} against the final size ({args.final} tokens per step), packed rows of {args.capacity}:\n"
    )
    say(table(rows, "final size", ["final size", "ramp", "ramp, lr sqrt"]))
    say(
        f"\n2. out-of-memory back-off (micro-batches over {args.fail_over} token slots fail; budget after: {budget}):\n"
    )
    say(table(rows, "plain", ["plain", "backoff on, no failure", "failure in forward", "failure in backward",
                             "planned at that budget"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
