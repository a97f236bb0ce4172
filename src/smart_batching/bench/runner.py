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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.bench.config import DEFAULT_LR, BenchConfig
from smart_batching.bench.curve import attach_time_to_target
from smart_batching.bench.machine import machine_info, usable_cores, versions
from smart_batching.bench.records import RECORD_FIELDS, RECORDS_NAME, append_record, read_records
from smart_batching.bench.training import (
    BenchContext,
    evaluate_model,
    row_accum_steps,
    run_one,
    strategy_options,
    warmup,
)
from smart_batching.data.tasks import prepare_training_data
from smart_batching.errors import ConfigError
from smart_batching.planners import STRATEGIES, spec_class

DEFAULT_STRATEGIES = STRATEGIES
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
    step count (``k`` times that for a ``mix_steps=k`` row, whose steps are ``k`` batches). A plan's batch count can depend on its seed (``window=`` packs or cuts within shuffled
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
        most = target * row_accum_steps(name)
        lo, hi = longest, lengths.shape[0] * longest  # one batch of everything fits the top
        limit = option_limit(option)
        hi = min(hi, limit) if limit is not None else hi
        while lo < hi:
            mid = (lo + hi) // 2
            plans = (plan_batches(lengths, base, seed=seed, **{**options, option: mid}) for seed in seeds)
            if all(len(plan) <= most for plan in plans):
                hi = mid
            else:
                lo = mid + 1
        budgets[name] = {option: lo}
    return budgets


def run_bench(config: BenchConfig | Any = None, /, **fields: Any) -> list[dict[str, Any]]:
    """Fine-tune one model once per strategy and seed; write and return one record per run.

    Args:
        config: a :class:`~smart_batching.bench.config.BenchConfig`, or the data (``"default"``, a
            file or folder, a ``datasets.Dataset``); None means the defaults.
        **fields: :class:`~smart_batching.bench.config.BenchConfig` fields, applied over ``config``
            (``run_bench("gsm8k/train.jsonl", max_steps=40)``, ``run_bench(config, seeds=(0, 1))``).

    Returns:
        The records of the runs that finished (all of them unless interrupted with Ctrl-C).

    Raises:
        ConfigError: a field out of range (named), before anything loads.
    """
    import torch

    config = BenchConfig.of(config, **fields)
    dev = torch.device(
        config.device if config.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if config.nproc > 1 and dev.type == "cuda" and config.nproc > torch.cuda.device_count():
        raise ConfigError(
            f"nproc={config.nproc} needs one GPU per process, but {torch.cuda.device_count()} are visible; "
            "lower nproc or train on the CPU (device='cpu')"
        )
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _run_bench(config, dev)
    finally:
        torch.set_num_threads(previous_threads)


def resolve_precision(precision: str, device: Any) -> str:
    """``"fp32"`` or ``"bf16"`` for a :attr:`BenchConfig.precision` on ``device`` (``"auto"``: bf16 on a
    CUDA GPU that supports it, else fp32).

    Raises:
        ConfigError: ``"bf16"`` on a CUDA GPU without bf16 support.
    """
    import torch

    cuda = torch.device(device).type == "cuda"
    if precision == "auto":
        return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision='bf16': this GPU does not support bf16; use precision='fp32' or 'auto'")
    return precision


def _run_bench(config: BenchConfig, dev: Any) -> list[dict[str, Any]]:
    from smart_batching.models.zoo import DEFAULT_TOKENIZERS, TrainingModel, load_training_model

    c = config
    out = Path(c.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / RECORDS_NAME
    if not c.append and records_path.exists():
        records_path.unlink()

    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if c.progress else (lambda msg: None)
    loaded = isinstance(c.model, TrainingModel)
    name = c.model if isinstance(c.model, str) else c.model.name if loaded else type(c.model).__name__
    say(f"{'using the loaded model' if loaded else 'loading model'} {name} ...")
    model_options = dict(c.model_options) if c.model_options is not None else None
    bm = load_training_model(c.model, tokenizer=c.tokenizer, model_options=model_options)
    say(f"preparing data {c.data if isinstance(c.data, (str, os.PathLike)) else type(c.data).__name__} ...")
    bench_data = prepare_training_data(
        c.data,
        tokenizer=bm.tokenizer,
        model_kind=bm.kind,
        eval_data=c.eval_data,
        num_examples=c.train_examples,
        eval_examples=c.eval_examples,
        max_length=c.max_length,
        num_prompts=c.num_generations,
        loss_on=c.loss_on,
    )
    task = bench_data.task
    strategies, seeds = list(c.strategies), list(c.seeds)
    mt, cap = _resolve_sizes(bench_data.lengths, c.batch_size, c.max_tokens, c.capacity)
    lr = c.lr
    if lr is None:
        lr = DEFAULT_LR["smollm2"] if bm.name == "smollm2" else DEFAULT_LR[bm.kind]
    tok_name = (
        c.tokenizer if isinstance(c.tokenizer, str) else DEFAULT_TOKENIZERS.get(bm.name, bm.info["tokenizer"])
    )
    settings = {
        "model": bm.name,
        "model_info": bm.info,
        "tokenizer": tok_name,
        "strategies": strategies,
        "seeds": seeds,
        "num_examples": bench_data.num_train,
        "max_steps": c.max_steps,
        "epochs": c.epochs,
        "batch_size": c.batch_size,
        "max_tokens": mt,
        "capacity": cap,
        "max_length": c.max_length,
        "loss_on": c.loss_on,
        "lr": lr,
        "lr_schedule": c.lr_schedule,
        "budgets": {
            **(
                matched_budgets(bench_data.lengths, strategies, c.batch_size, mt, cap, seeds)
                if c.match_steps
                else {}
            ),
            **(c.budgets or {}),
        },
        "optimizer": "adamw_torch",
        "max_grad_norm": 1.0,
        "eval_examples": len(bench_data.eval),
        "eval_batch_size": c.eval_batch_size,
        "eval_every": None if c.eval_every is None else str(c.eval_every),
        "target": c.target,
        "num_generations": len(bench_data.prompts),
        "max_new_tokens": c.max_new_tokens or (256 if task == "gsm8k" else 48),
        "device": dev.type,
        "nproc": c.nproc,
        "batch_schedule": c.batch_schedule,
        "schedule_unit": c.schedule_unit,
        "lr_scaling": c.lr_scaling,
        "oom_backoff": dict(c.oom_backoff) if isinstance(c.oom_backoff, Mapping) else c.oom_backoff,
        "precision": resolve_precision(c.precision, dev),
    }
    machine = machine_info(dev)
    threads_per_rank = c.threads or max(1, usable_cores() // c.nproc)
    if c.nproc > 1:
        machine.update(processes=c.nproc, torch_threads=threads_per_rank)
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
    if c.nproc == 1:
        say("warming up (planner compilation, first batches) ...")
        warmup(bench, strategies)
    else:
        from smart_batching.bench.multiprocess import RankLauncher, check_world

        check_world(bench, strategies, seeds, c.nproc)  # before any process starts
    say("evaluating the initial weights ...")
    initial_model = bm.fresh(dev)
    ev, metric, gens = evaluate_model(bench, initial_model)
    bench.eval_initial = {**ev, "task_metric": metric, "generations": gens}
    del initial_model

    runs = [(strategy, seed) for seed in seeds for strategy in strategies]
    records: list[dict[str, Any]] = []
    launcher = None
    if c.nproc > 1:
        say(f"each run trains on {c.nproc} processes (torchrun, {threads_per_rank} CPU thread(s) each) ...")
        launcher = RankLauncher(bench, c.nproc, threads_per_rank=threads_per_rank, progress=c.progress)
    try:
        for i, (strategy, seed) in enumerate(runs):
            rec = run_one(bench, strategy, seed, i, len(runs), c.callbacks, c.progress, launcher)
            attach_time_to_target(rec, records, c.target)  # random of this seed ran first (run order)
            append_record(records_path, rec)
            records.append(rec)
            say(_run_line(rec))
            if c.on_record is not None:
                c.on_record(rec)
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: kept {len(records)} finished run(s) of {len(runs)} in {records_path}",
            file=sys.stderr,
            flush=True,
        )
    finally:
        if launcher is not None:
            launcher.close()
    if c.render and records:
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
    "BenchConfig",
    "RECORDS_NAME",
    "RECORD_FIELDS",
    "append_record",
    "read_records",
    "run_bench",
    "strategy_options",
]
