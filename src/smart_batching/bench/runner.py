"""``run_bench``: fine-tune one model once per strategy and seed, and record what each run cost and learned.

Only the batching differs between runs:

* **Same start.** Every run loads the same initial ``state_dict`` (taken once, :class:`~.models.TrainingModel`).
* **Same data, same number of times.** The examples are tokenised and truncated once
  (:func:`~.tasks.prepare_training_data`); every run trains ``epochs`` full epochs over all of them, so
  every strategy sees every example exactly ``epochs`` times. ``max_steps=N`` is read as
  ``num_examples = N * batch_size`` (N steps for the fixed-size baselines); a step count would give
  ``token_budget`` and ``packed``, whose batches vary, different data. A digest of the
  ``(example, tokens)`` multiset each run trained on is recorded and compared by the report.
* **Same loop.** The real ``transformers.Trainer`` through :class:`~smart_batching.hf.SmartBatchingTrainer`,
  for the baselines ``random`` and ``max_length`` too, with identical hyperparameters (constant
  learning rate, no warm-up, no weight decay, gradient clipping at 1.0, one batch per optimizer step).
* **Comparable batches.** ``max_tokens`` (token_budget) and ``capacity`` (packed) default to
  ``batch_size`` × the mean length, rounded up to 64 tokens (at least the longest example), so those
  strategies take about as many steps as the fixed-size ones; the step counts are recorded.
* **Same eval.** Held-out loss on plain padded batches in a fixed order, greedy generations on
  fixed prompts, all with the model's original attention and KV cache.
* **Several processes.** ``nproc=N`` trains every run on N processes (torchrun, gloo on CPU, one GPU
  per process with NCCL; :mod:`~.multiprocess`) over one balanced plan per epoch, so each example is
  still trained exactly ``epochs`` times, on one of the processes. This process keeps the set-up, the
  evaluation (once, on the trained weights), the records, the report and Ctrl-C. Records say
  ``world_size``; ``tokens_per_second`` is all processes' real tokens over the slowest one's wall time;
  ``peak_memory_mb`` is the largest process's.

Times: ``wall_seconds`` and ``cpu_seconds`` (process CPU time, all threads) of ``trainer.train()``;
on a machine shared with other work the CPU time is the steadier of the two. ``step_seconds`` and
``iteration_seconds`` are percentiles over optimizer steps (:class:`~.measure.StepTimer`).

Measuring is separate from rendering: each finished run is appended to ``records.jsonl`` at once (one
JSON object per line, see :data:`RECORD_FIELDS`), so Ctrl-C keeps the finished runs; the report is then
rendered from the file (:mod:`smart_batching.bench.report`).

Warm-up before the timed runs: every strategy is planned once (the planners compile with numba on
first use) and one padded and one packed batch are trained (forward, backward, AdamW step) on a
throwaway copy of the model, so no run pays for compilation or first-touch allocation. With
``nproc > 1`` every process warms up for its run before training.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.bench.machine import machine_info, usable_cores, versions
from smart_batching.bench.records import RECORD_FIELDS, RECORDS_NAME, append_record, read_records
from smart_batching.bench.training import BenchContext, evaluate_model, run_one, strategy_options, warmup
from smart_batching.data.tasks import prepare_training_data
from smart_batching.errors import ConfigError
from smart_batching.planners import STRATEGIES, spec_class

DEFAULT_STRATEGIES = STRATEGIES
DEFAULT_LR = {"causal": 1e-3, "smollm2": 5e-5, "classifier": 1e-4}
TOKEN_ROUNDING = 64


def _round_up(value: float, multiple: int) -> int:
    return max(multiple, int(math.ceil(value / multiple)) * multiple)


def _resolve_sizes(
    lengths: np.ndarray, batch_size: int, max_tokens: int | None, capacity: int | None
) -> tuple[int, int]:
    longest = int(lengths.max())
    default = max(_round_up(batch_size * float(lengths.mean()), TOKEN_ROUNDING), _round_up(longest, 8))
    for name, value in (("max_tokens", max_tokens), ("capacity", capacity)):
        if value is not None and value < longest:
            raise ConfigError(
                f"{name}={value} is below the longest training example ({longest} tokens); raise {name}= "
                "or truncate with max_length="
            )
    return (max_tokens or default), (capacity or default)


def matched_budgets(
    lengths: np.ndarray,
    strategies: Sequence[str],
    batch_size: int,
    max_tokens: int,
    capacity: int,
    seeds: Sequence[int],
) -> dict[str, dict[str, int]]:
    """Per strategy with a token budget (its spec's ``budget_option``), the smallest budget whose plan
    for every seed (epoch 0) has at most ``ceil(n / batch_size)`` batches, the fixed-size strategies'
    step count. A plan's batch count can depend on its seed (``window=`` packs or cuts within shuffled
    windows), and a run with more steps than the fixed batches learns more from the same examples.
    Bisection over plans: O(seeds × log(n × longest)) plans per strategy."""
    from smart_batching.planners import option_limit, plan_batches

    target = -(-lengths.shape[0] // batch_size)
    longest = int(lengths.max())
    budgets: dict[str, dict[str, int]] = {}
    for name in strategies:
        base, options = strategy_options(
            name, batch_size=batch_size, max_tokens=max_tokens, capacity=capacity
        )
        option = spec_class(base).budget_option
        if option is None:
            continue
        lo, hi = longest, lengths.shape[0] * longest  # one batch of everything fits the top
        limit = option_limit(option)
        hi = min(hi, limit) if limit is not None else hi
        while lo < hi:
            mid = (lo + hi) // 2
            plans = (plan_batches(lengths, base, seed=seed, **{**options, option: mid}) for seed in seeds)
            if all(len(plan) <= target for plan in plans):
                hi = mid
            else:
                lo = mid + 1
        budgets[name] = {option: lo}
    return budgets


def run_bench(
    data: Any = "default",
    *,
    model: Any = "tiny-llama",
    tokenizer: Any = None,
    strategies: Sequence[str] = DEFAULT_STRATEGIES,
    seeds: Sequence[int] = (0,),
    max_steps: int | None = None,
    num_examples: int | None = None,
    epochs: int = 1,
    batch_size: int = 8,
    max_tokens: int | None = None,
    capacity: int | None = None,
    max_length: int | None = None,
    lr: float | None = None,
    lr_schedule: str = "constant",
    match_steps: bool = False,
    eval_data: Any = None,
    eval_examples: int = 64,
    eval_batch_size: int = 8,
    num_generations: int | None = None,
    max_new_tokens: int | None = None,
    out_dir: str | os.PathLike = "out/bench",
    append: bool = False,
    render: bool = True,
    progress: bool = True,
    device: Any = None,
    threads: int | None = None,
    nproc: int = 1,
    model_options: dict[str, Any] | None = None,
    callbacks: Sequence[Any] = (),
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Fine-tune ``model`` on ``data`` once per strategy and seed; write and return one record per run.

    Args:
        data: ``"default"`` (embedded dataset), a data file or folder, or a ``datasets.Dataset``.
        model: ``"tiny-llama"``, ``"smollm2"``, ``"minilm"`` or a transformers model object.
        tokenizer: tokenizer name or object; None means the model's own (``smollm2`` for the Llamas).
        strategies: strategy names, in run order (``random`` first: speed ratios are against it).
        seeds: planner and Trainer seeds; every strategy runs once per seed. The initial weights are
            the same for all.
        max_steps: train on ``max_steps * batch_size`` examples (ignored when ``num_examples`` is given).
        num_examples: training examples (the first ones); None (and no ``max_steps``) means all.
        epochs: full passes over the training examples, the same for every strategy.
        batch_size: examples per batch for ``random``, ``max_length``, ``group_by_length``.
        max_tokens: padded tokens per ``token_budget`` batch; None means ``batch_size`` × mean length
            rounded up to 64 (at least the longest example).
        capacity: tokens per ``packed`` row (one row per batch); None as ``max_tokens``.
        max_length: truncate examples to this many tokens, once, for every strategy; None keeps all.
        lr: peak learning rate; None means 1e-3 (tiny-llama), 5e-5 (smollm2), 1e-4 (minilm).
        lr_schedule: the Trainer's ``lr_scheduler_type`` (``"constant"``, ``"linear"`` decay to 0, ...),
            the same for every run.
        match_steps: give ``token_budget`` and ``packed`` rows (and their variants) the smallest budget
            (``max_tokens`` / ``capacity``, found by bisection over their plans for every seed) whose
            plans have no more batches than fixed batches of ``batch_size``: every strategy then takes
            about the same optimizer steps (never more) with about the same tokens each (the budgets
            are in the records' ``strategy_options``). False: ``max_tokens`` and ``capacity`` as given
            or derived.
        eval_data: held-out data; None picks a dev/test split or sibling file, else holds out the
            last ``eval_examples`` records.
        eval_examples: held-out examples for eval loss (and accuracy).
        eval_batch_size: examples per padded eval batch.
        num_generations: held-out prompts to generate for (GSM8K: the exact-match sample); None means
            16 for GSM8K, 4 for other text, 8 sample predictions for classification.
        max_new_tokens: greedy generation length; None means 256 for GSM8K, 48 otherwise.
        out_dir: folder for ``records.jsonl`` and the report.
        append: add to an existing ``records.jsonl`` (the report shows every bench in it) instead of
            starting a new one.
        render: render the report when done (also after Ctrl-C).
        progress: a line per step of the setup and per finished run on stderr, and a tqdm bar per run
            when stderr is a terminal.
        device: torch device; None means CUDA when available, else CPU.
        threads: torch CPU threads during the bench (restored afterwards); None leaves torch's setting.
            On a machine shared with other work, 1 thread makes ``cpu_seconds`` a clean measure of work.
            With ``nproc > 1``: threads of each process; None means the usable cores / ``nproc``.
        nproc: processes each run trains on (torchrun; gloo on CPU, NCCL with one GPU per process),
            all over one balanced plan (:mod:`.multiprocess`). 1 trains in this process.
        model_options: ``LlamaConfig`` overrides for ``tiny-llama`` (e.g. ``{"hidden_size": 64}``), or
            ``{"num_hidden_layers": k}`` for ``smollm2`` (its first ``k`` layers).
        callbacks: extra ``TrainerCallback`` objects for every run (``nproc=1`` only: they live in this
            process).
        on_record: called with each record as soon as it is written.

    Returns:
        The records of the runs that finished (all of them unless interrupted with Ctrl-C).
    """
    import torch

    strategies = list(strategies)
    seeds = [int(x) for x in seeds]
    if not strategies:
        raise ConfigError("strategies= is empty; name at least one strategy")
    if not seeds:
        raise ConfigError("seeds= is empty; give at least one seed")
    for name, value in (("batch_size", batch_size), ("epochs", epochs), ("eval_examples", eval_examples)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    for name in strategies:
        strategy_options(name, batch_size=batch_size, max_tokens=1, capacity=1)  # unknown names fail here
    if num_examples is None and max_steps is not None:
        num_examples = max_steps * batch_size
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"threads={threads!r} must be a positive integer or None")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"nproc={nproc!r} must be a positive integer (processes per run)")
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if nproc > 1 and callbacks:
        raise ConfigError("callbacks= run in this process only; they cannot be combined with nproc > 1")
    if nproc > 1 and dev.type == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"nproc={nproc} needs one GPU per process, but {torch.cuda.device_count()} are visible; "
            "lower nproc or train on the CPU (device='cpu')"
        )
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_bench(
            data, model=model, tokenizer=tokenizer, strategies=strategies, seeds=seeds, num_examples=num_examples,
            max_steps=max_steps, epochs=epochs, batch_size=batch_size, max_tokens=max_tokens, capacity=capacity,
            max_length=max_length, lr=lr, lr_schedule=lr_schedule, match_steps=match_steps, eval_data=eval_data, eval_examples=eval_examples,
            eval_batch_size=eval_batch_size, num_generations=num_generations, max_new_tokens=max_new_tokens,
            out_dir=out_dir, append=append, render=render, progress=progress, dev=dev, nproc=nproc,
            threads=threads, model_options=model_options, callbacks=callbacks, on_record=on_record,
        )  # fmt: skip
    finally:
        torch.set_num_threads(previous_threads)


def _run_bench(
    data: Any,
    *,
    model: Any,
    tokenizer: Any,
    strategies: list[str],
    seeds: list[int],
    num_examples: int | None,
    max_steps: int | None,
    epochs: int,
    batch_size: int,
    max_tokens: int | None,
    capacity: int | None,
    max_length: int | None,
    lr: float | None,
    lr_schedule: str,
    match_steps: bool,
    eval_data: Any,
    eval_examples: int,
    eval_batch_size: int,
    num_generations: int | None,
    max_new_tokens: int | None,
    out_dir: str | os.PathLike,
    append: bool,
    render: bool,
    progress: bool,
    dev: Any,
    nproc: int,
    threads: int | None,
    model_options: dict[str, Any] | None,
    callbacks: Sequence[Any],
    on_record: Callable[[dict[str, Any]], None] | None,
) -> list[dict[str, Any]]:
    from smart_batching.zoo import DEFAULT_TOKENIZERS, load_training_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / RECORDS_NAME
    if not append and records_path.exists():
        records_path.unlink()

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    say(f"loading model {model if isinstance(model, str) else type(model).__name__} ...")
    bm = load_training_model(model, tokenizer=tokenizer, model_options=model_options)
    say(f"preparing data {data if isinstance(data, (str, os.PathLike)) else type(data).__name__} ...")
    bench_data = prepare_training_data(
        data,
        tokenizer=bm.tokenizer,
        model_kind=bm.kind,
        eval_data=eval_data,
        num_examples=num_examples,
        eval_examples=eval_examples,
        max_length=max_length,
        num_prompts=num_generations,
    )
    task = bench_data.task
    mt, cap = _resolve_sizes(bench_data.lengths, batch_size, max_tokens, capacity)
    if lr is None:
        lr = DEFAULT_LR["smollm2"] if bm.name == "smollm2" else DEFAULT_LR[bm.kind]
    tok_name = (
        tokenizer if isinstance(tokenizer, str) else DEFAULT_TOKENIZERS.get(bm.name, bm.info["tokenizer"])
    )
    settings = {
        "model": bm.name,
        "model_info": bm.info,
        "tokenizer": tok_name,
        "strategies": strategies,
        "seeds": seeds,
        "num_examples": bench_data.num_train,
        "max_steps": max_steps,
        "epochs": epochs,
        "batch_size": batch_size,
        "max_tokens": mt,
        "capacity": cap,
        "max_length": max_length,
        "lr": lr,
        "lr_schedule": lr_schedule,
        "budgets": matched_budgets(bench_data.lengths, strategies, batch_size, mt, cap, seeds)
        if match_steps
        else {},
        "optimizer": "adamw_torch",
        "max_grad_norm": 1.0,
        "eval_examples": len(bench_data.eval),
        "eval_batch_size": eval_batch_size,
        "num_generations": len(bench_data.prompts),
        "max_new_tokens": max_new_tokens or (256 if task == "gsm8k" else 48),
        "device": dev.type,
        "nproc": nproc,
    }
    machine = machine_info(dev)
    threads_per_rank = threads or max(1, usable_cores() // nproc)
    if nproc > 1:
        machine.update(processes=nproc, torch_threads=threads_per_rank)
    bench = BenchContext(
        bench_id=f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
        model=bm,
        data=bench_data,
        settings=settings,
        device=dev,
        machine=machine,
        versions=versions(),
        eval_initial={},
        records_path=records_path,
    )
    if nproc == 1:
        say("warming up (planner compilation, first batches) ...")
        warmup(bench, strategies)
    else:
        from smart_batching.bench.multiprocess import RankLauncher, check_world

        check_world(bench, strategies, seeds, nproc)  # before any process starts
    say("evaluating the initial weights ...")
    initial_model = bm.fresh(dev)
    ev, metric, _ = evaluate_model(bench, initial_model)
    bench.eval_initial = {**ev, "task_metric": metric}
    del initial_model

    runs = [(strategy, seed) for seed in seeds for strategy in strategies]
    records: list[dict[str, Any]] = []
    launcher = None
    if nproc > 1:
        say(f"each run trains on {nproc} processes (torchrun, {threads_per_rank} CPU thread(s) each) ...")
        launcher = RankLauncher(bench, nproc, threads_per_rank=threads_per_rank, progress=progress)
    try:
        for i, (strategy, seed) in enumerate(runs):
            rec = run_one(bench, strategy, seed, i, len(runs), callbacks, progress, launcher)
            append_record(records_path, rec)
            records.append(rec)
            say(_run_line(rec))
            if on_record is not None:
                on_record(rec)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: kept {len(records)} finished run(s) of {len(runs)} in {records_path}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        if launcher is not None:
            launcher.close()
    if render and records:
        from smart_batching.bench.report import render_report

        render_report(records_path, out)
    return records


def _run_line(rec: dict[str, Any]) -> str:
    if rec.get("status") != "ok":
        return f"  {rec['strategy']} seed {rec['seed']}: skipped ({rec.get('skip_reason')})"
    ev = rec.get("eval") or {}
    metric = rec.get("task_metric")
    metric_s = f", {metric['name']} {metric['value']:.3f}" if metric else ""
    procs = f" on {rec['world_size']} processes" if rec.get("world_size", 1) > 1 else ""
    return (
        f"  {rec['strategy']} seed {rec['seed']}: {rec['num_steps']} steps{procs} in {rec['wall_seconds']:.1f} s, "
        f"{rec['tokens_per_second']:,.0f} tokens/s, padding {100 * rec['padding_ratio']:.1f}%, "
        f"eval loss {ev.get('loss', float('nan')):.4f}{metric_s}"
    )


__all__ = [
    "DEFAULT_STRATEGIES",
    "RECORDS_NAME",
    "RECORD_FIELDS",
    "append_record",
    "read_records",
    "run_bench",
    "strategy_options",
]
