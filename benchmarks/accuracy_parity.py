"""Does the model learn the same thing? Accuracy (or held-out loss) per batching strategy, paired by seed.

Every strategy trains the same model from the same initial weights on the same examples with the same
learning rate, once per seed, with the real transformers ``Trainer`` (:func:`smart_batching.bench.run_bench`);
seed ``k`` gives every strategy the same examples and initial weights, so the difference to ``random``
is taken seed by seed (a paired t-interval, 95 %). The token-budget and packed batches hold about the
tokens of a fixed batch (``batch size x mean length``), so every strategy takes about as many optimizer
steps with about as many tokens each; only batch composition differs.

Tasks:

* ``sst2``: all-MiniLM-L6-v2 + a linear head on ``../shared/data/sst2`` (train.tsv), accuracy on the
  dev set (872 sentences; ``--eval-examples``). Difference in accuracy points.
* ``gsm8k``: a small model initialised from SmolLM2-135M-Instruct (its embeddings, tied head and first
  4 of 30 decoder layers: 42M parameters) fine-tuned on 240 GSM8K examples (batch 16, lr 3e-4),
  held-out loss per target token on 64 GSM8K test examples. Difference as a relative fraction of
  random's loss.
* ``lima``: the same model on 64 LIMA examples truncated to 1,024 tokens (batch 8), held-out loss on the
  last 48 LIMA examples.
* ``gsm8k-tiny``: a tiny Llama (random init, hidden 128, SmolLM2 tokenizer) on GSM8K (the earlier study).
* ``trl``: the anchor TRL users pick, on the path they take: TRL's ``SFTTrainer`` with
  ``packing=True`` (``trl_packing``) and ``apply_smart_batching(sft_trainer, "packed")`` on that same
  ``SFTTrainer`` (``sft_packed``), beside ``SmartBatchingTrainer`` packed and the HF ``Trainer`` with
  random batches (``random``), through ``benchmarks/train_throughput.py``'s runs (its model and data:
  a Llama of hidden size 256 with SmolLM2's vocabulary on GSM8K; held-out loss on GSM8K test).

Output: a table per task; ``--json`` prints one line per (task, strategy) with ``task``, ``strategy``,
``default`` (the strategy's default setting), ``metric``, ``metric_ci`` (half-width), ``diff_to_random``,
``ci_low``, ``ci_high``, ``efficiency``, ``speedup``, ``seeds``. ``--plot PATH`` draws accuracy gap
against padding efficiency. ``--quick`` runs a tiny version (for the tests).

Usage::

    python benchmarks/accuracy_parity.py --tasks sst2 --seeds 5 --num-examples 2000 --threads 1
    python benchmarks/accuracy_parity.py --tasks gsm8k,lima --seeds 5 --threads 1 --out out/parity
    python benchmarks/accuracy_parity.py --from-records out/parity/*/records.jsonl --plot parity.png
    python benchmarks/accuracy_parity.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.planners import split_strategies

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
# Each task's data, model and the settings its runs take unless a flag names others.
SMOLLM2_4 = {"model": "smollm2", "model_options": {"num_hidden_layers": 4}, "lr": 3e-4}
TASKS: dict[str, dict[str, Any]] = {
    "sst2": {"data": SHARED / "sst2", "model": "minilm", "metric": "accuracy"},
    "gsm8k": {
        "data": SHARED / "gsm8k" / "train.jsonl", "metric": "eval_loss", **SMOLLM2_4,
        "num_examples": 240, "eval_examples": 64,
    },
    "lima": {
        "data": SHARED / "lima" / "lima.json", "metric": "eval_loss", **SMOLLM2_4,
        "num_examples": 64, "eval_examples": 48, "batch_size": 8, "max_length": 1024,
    },
    "gsm8k-tiny": {"data": SHARED / "gsm8k" / "train.jsonl", "model": "tiny-llama", "metric": "eval_loss"},
    "trl": {"data": SHARED / "gsm8k" / "train.jsonl", "model": "train_throughput", "metric": "eval_loss"},
}  # fmt: skip
# Settings a task may fix and a flag may override (None on the command line: the task's, else the flag's
# default).
TASK_SETTINGS = {"num_examples": 2000, "eval_examples": 872, "batch_size": 16, "lr": None, "max_length": None}
# The trl task's rows and the train_throughput.py strategy each runs.
TRL_RUNS = {
    "random": "hf_random",
    "trl_packing": "trl_packing",
    "sft_packed": "sft_packed",
    "packed": "packed",
}
STRATEGIES = ("random", "group_by_length", "token_budget", "packed")
# Two-sided 95 % Student t quantiles by degrees of freedom (no scipy here).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_interval(values: np.ndarray) -> tuple[float, float]:
    """Mean and 95 % half-width of ``values`` (half-width NaN for a single value)."""
    n = values.shape[0]
    mean = float(values.mean())
    if n < 2:
        return mean, float("nan")
    t = _T975.get(n - 1, 1.96 + 2.4 / (n - 1))  # close to the t quantile above 10 degrees of freedom
    return mean, t * float(values.std(ddof=1)) / math.sqrt(n)


def metric_of(record: dict[str, Any], metric: str) -> float:
    if metric == "accuracy":
        return float(record["eval"]["accuracy"])
    return float(record["eval"]["loss"])


def is_default(name: str) -> bool:
    """Whether a row runs its strategy's default setting: its options change no field of the spec but
    the budget the bench sets (rows that are no library strategy, such as ``trl_packing``, run their
    own defaults)."""
    from smart_batching.errors import ConfigError
    from smart_batching.planners import make_spec, parse_strategy, spec_class

    try:
        base, options = parse_strategy(name)
    except ConfigError:
        return True
    budget = spec_class(base).budget_option
    options = {k: v for k, v in options.items() if k != budget}
    return make_spec(base, **options) == make_spec(base)


def _steps(record: dict[str, Any]) -> float:
    return float(record.get("num_steps", record.get("optimizer_steps", float("nan"))))


def summarise(task: str, records: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """One row per strategy: metric, paired difference to random with its interval, efficiency, speed."""
    by = {(r["strategy"], r["seed"]): r for r in records if r.get("status") == "ok"}
    strategies = list(dict.fromkeys(r["strategy"] for r in records))
    seeds = sorted({s for _, s in by})
    rows = []
    for name in strategies:
        paired = [s for s in seeds if (name, s) in by and ("random", s) in by]
        if not paired:
            continue
        values = np.array([metric_of(by[(name, s)], metric) for s in paired])
        base = np.array([metric_of(by[("random", s)], metric) for s in paired])
        # Accuracy in points; held-out loss as a fraction of random's.
        diffs = 100.0 * (values - base) if metric == "accuracy" else (values - base) / base
        mean, half = t_interval(values)
        diff, dhalf = t_interval(diffs)
        speed = np.array(
            [by[(name, s)]["tokens_per_second"] / by[("random", s)]["tokens_per_second"] for s in paired]
        )
        rows.append(
            {
                "task": task,
                "strategy": name,
                "default": is_default(name),
                "metric_name": metric,
                "metric": mean,
                "metric_ci": half,
                "diff_to_random": diff,
                "ci_low": diff - dhalf if name != "random" else 0.0,
                "ci_high": diff + dhalf if name != "random" else 0.0,
                "efficiency": float(np.mean([1.0 - by[(name, s)]["padding_ratio"] for s in paired])),
                "speedup": float(np.exp(np.mean(np.log(speed)))),
                "seeds": len(paired),
                "steps": float(np.mean([_steps(by[(name, s)]) for s in paired])),
            }
        )
    return rows


def trl_records(opts: argparse.Namespace, seeds: range) -> list[dict[str, Any]]:
    """The ``trl`` task: each of :data:`TRL_RUNS` once per seed through train_throughput.py's runs, as
    records :func:`summarise` reads."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_throughput as tt

    vocab = 49152
    ds, info = tt.load_examples(TASKS["trl"]["data"], opts.num_examples, vocab)
    eval_ds, _ = tt.load_examples(SHARED / "gsm8k" / "test.jsonl", opts.eval_examples, vocab)
    budget, capacity = tt.budgets(info, opts.batch_size)
    run_opts = argparse.Namespace(
        batch_size=opts.batch_size, vocab=vocab, hidden=256, layers=4, warmup=1, steps=None,
        lr_schedule=opts.lr_schedule,
    )  # fmt: skip
    names = [n for n in split_strategies(opts.strategies or ",".join(TRL_RUNS)) if n in TRL_RUNS]
    if "random" not in names:
        raise SystemExit(
            f"the trl task compares with random: name it in --strategies ({', '.join(TRL_RUNS)})"
        )
    records = []
    with tempfile.TemporaryDirectory() as out:
        for seed in seeds:
            for name in names:
                r = tt.run_strategy(
                    TRL_RUNS[name], ds, run_opts, budget, capacity, out, seed=seed, eval_ds=eval_ds
                )
                records.append(
                    {
                        "strategy": name,
                        "seed": seed,
                        "status": "ok",
                        "eval": {"loss": r["eval_loss"]},
                        "tokens_per_second": r["real_tokens_per_s"],
                        "padding_ratio": r["padding_ratio"],
                        "optimizer_steps": r["optimizer_steps"],
                    }
                )
                if not opts.json:
                    print(f"  trl {name} seed {seed}: eval loss {r['eval_loss']:.4f}", file=sys.stderr)
    return records


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        sub = [r for r in rows if r["task"] == task]
        unit = "points" if sub[0]["metric_name"] == "accuracy" else "rel."
        lines.append(f"{task} ({sub[0]['metric_name']}, {sub[0]['seeds']} seeds)")
        lines.append(
            f"  {'strategy':<24} {'metric':>16} {'diff to random (' + unit + ')':>30} {'efficiency':>10} {'speed-up':>8}"
        )
        for r in sub:
            scale = 100.0 if r["metric_name"] == "accuracy" else 1.0
            fmt = ".2f" if scale == 100.0 else ".4f"
            metric = f"{scale * r['metric']:{fmt}} ± {scale * r['metric_ci']:{fmt}}"
            dfmt = ".2f" if scale == 100.0 else ".4f"
            diff = f"{r['diff_to_random']:+{dfmt}} [{r['ci_low']:+{dfmt}}, {r['ci_high']:+{dfmt}}]"
            lines.append(
                f"  {r['strategy']:<24} {metric:>16} {diff:>30} {r['efficiency']:>9.1%} {r['speedup']:>7.2f}x"
            )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Accuracy gap against padding efficiency, one panel per task (the trade-off curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        sub = [r for r in rows if r["task"] == task and r["strategy"] != "random"]
        # Accuracy differences are in points already; loss differences are fractions, drawn in %.
        accuracy = bool(sub) and sub[0]["metric_name"] == "accuracy"
        scale = 1.0 if accuracy else 100.0
        for r in sub:
            diff = scale * r["diff_to_random"]
            err = [[diff - scale * r["ci_low"]], [scale * r["ci_high"] - diff]]
            style = "o" if r["default"] else "s"
            ax.errorbar([r["efficiency"]], [diff], yerr=err, fmt=style, capsize=3)
            ax.annotate(r["strategy"], (r["efficiency"], diff), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")  # fmt: skip
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_title(f"{task} ({sub[0]['seeds'] if sub else 0} seeds)", fontsize=10)
        ax.set_xlabel("padding efficiency (real tokens / token slots)")
        ax.set_ylabel(
            "accuracy difference to random, points (95 % CI)"
            if accuracy
            else "held-out loss difference to random, % (95 % CI)"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def task_settings(task: str, opts: argparse.Namespace) -> argparse.Namespace:
    """``opts`` with the task's own settings where no flag named one (:data:`TASK_SETTINGS`)."""
    spec = TASKS[task]
    settings = vars(opts).copy()
    for key, default in TASK_SETTINGS.items():
        if settings[key] is None:
            settings[key] = spec.get(key, default)
    if opts.quick:
        settings.update(num_examples=32, eval_examples=32)
    return argparse.Namespace(**settings)


def task_records(task: str, opts: argparse.Namespace, seeds: range) -> list[dict[str, Any]]:
    """Train every strategy of ``task`` once per seed; the records (also in ``--out``/TASK when given)."""
    from smart_batching.bench import run_bench

    spec = TASKS[task]
    if not Path(spec["data"]).exists():
        raise SystemExit(f"{spec['data']} not found (the shared datasets)")
    if task == "trl":
        return trl_records(opts, seeds)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(opts.out) / task if opts.out else Path(tmp)
        return run_bench(
            str(spec["data"]), model=spec["model"], model_options=spec.get("model_options"),
            strategies=split_strategies(opts.strategies or ",".join(STRATEGIES)),
            seeds=seeds, num_examples=opts.num_examples, batch_size=opts.batch_size,
            max_length=opts.max_length, lr=opts.lr,
            eval_examples=opts.eval_examples, num_generations=1 if spec["metric"] == "accuracy" else 0,
            out_dir=out, render=False, append=bool(opts.out),
            lr_schedule=opts.lr_schedule, match_steps=not opts.no_match_steps,
            progress=not opts.json, threads=opts.threads,
        )  # fmt: skip


def read_records(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Records of earlier runs (``records.jsonl`` files written with ``--out``), by task: the folder
    a file lies in names its task."""
    from smart_batching.bench.records import read_records as read_file

    by_task: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        task = Path(path).resolve().parent.name
        if task not in TASKS:
            raise SystemExit(f"{path}: its folder should be a task name ({', '.join(TASKS)})")
        by_task.setdefault(task, []).extend(read_file(path))
    return by_task


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="sst2", help=f"comma-separated: {', '.join(TASKS)}")
    parser.add_argument(
        "--strategies", default=None,
        help=f"comma-separated rows (default: {','.join(STRATEGIES)}; for trl: {','.join(TRL_RUNS)})",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1, the same for every strategy")
    parser.add_argument(
        "--first-seed", type=int, default=0, help="start the seeds here (more seeds for an earlier run)"
    )
    parser.add_argument(
        "--num-examples", type=int, default=None, help="training examples, one epoch (default: the task's)"
    )
    parser.add_argument(
        "--eval-examples", type=int, default=None, help="held-out examples (default: the task's; SST-2 dev: 872)"
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=None, help="default: the task's, else 16")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the task's)")
    parser.add_argument(
        "--max-length", type=int, default=None, help="truncate examples (default: the task's, else none)"
    )
    parser.add_argument(
        "--lr-schedule", default="linear", help="the Trainer's lr_scheduler_type, the same for every run"
    )
    parser.add_argument(
        "--no-match-steps", action="store_true",
        help="keep token_budget/packed budgets at batch size x mean length instead of matching the step count",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--out", default=None,
        help="keep each task's records in OUT/TASK/records.jsonl (appended: runs of several sessions add up)",
    )  # fmt: skip
    parser.add_argument(
        "--from-records", nargs="+", default=None, metavar="FILE",
        help="summarise these records.jsonl files (written with --out) instead of training",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a tiny run for the tests")
    parser.add_argument("--json", action="store_true", help="one JSON line per (task, strategy)")
    parser.add_argument("--plot", default=None, help="write the accuracy-gap / efficiency plot here")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.seeds = 2
    seeds = range(opts.first_seed, opts.first_seed + opts.seeds)
    if opts.from_records:
        done = read_records(opts.from_records)
        tasks = list(done)
    else:
        tasks = [t.strip() for t in opts.tasks.split(",") if t.strip()]
        for task in tasks:
            if task not in TASKS:
                raise SystemExit(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    rows = []
    for task in tasks:
        records = done[task] if opts.from_records else task_records(task, task_settings(task, opts), seeds)
        task_rows = summarise(task, records, TASKS[task]["metric"])
        rows += task_rows
        if opts.json:  # each task as soon as it is done: a later task may run for long
            for r in task_rows:
                print(json.dumps(r), flush=True)
    if not opts.json:
        print(format_table(rows))
    if opts.plot:
        plot(rows, opts.plot)
        print(f"plot: {opts.plot}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
