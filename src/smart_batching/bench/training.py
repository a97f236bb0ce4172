"""One bench run: train a fresh copy of the model with one strategy and seed, measure, evaluate.

Used by :func:`smart_batching.bench.runner.run_bench`, which owns the set-up (data, model, sizes) and
the loop; see its module docstring for what is held equal between runs. :func:`train_run` is the
training and measuring of one process (one rank under torchrun, see :mod:`.multiprocess`);
:func:`run_one` adds the evaluation and builds the record.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.analysis.randomness import randomness_record
from smart_batching.bench.frozen_prefix import FrozenPrefixCache
from smart_batching.bench.machine import PeakMemory, release_memory
from smart_batching.bench.measure import examples_digest, length_histogram, plan_token_weights
from smart_batching.bench.records import SCHEMA_VERSION
from smart_batching.data.tasks import TrainingData
from smart_batching.distributed import distribute
from smart_batching.errors import ConfigError
from smart_batching.plan import BatchPlan
from smart_batching.planners import Knobs, make_spec, parse_strategy, plan_batches, spec_class


@dataclass
class BenchContext:
    """Everything a run needs that is the same for all runs of a bench."""

    bench_id: str
    model: Any  # TrainingModel
    data: TrainingData
    settings: dict[str, Any]
    device: Any
    machine: dict[str, Any]
    versions: dict[str, str]
    eval_initial: dict[str, Any]
    records_path: Path
    eval_prefix: FrozenPrefixCache = field(default_factory=FrozenPrefixCache)
    """The held-out batches' hidden states before the first trained layer, shared by the bench's models."""


TRAINER_ROW_OPTIONS = ("loss_normalization", "mix_steps")
"""Options a row name may carry for the Trainer rather than the planner:
``packed[loss_normalization=epoch]`` trains ``packed`` with ``SmartBatchingTrainer(loss_normalization="epoch")``;
``group_by_length[mix_steps=2]`` runs each optimizer step as 2 micro-batches of half the row's batch
(``batch_size`` and ``max_tokens`` divided by 2, ``gradient_accumulation_steps=2``) drawn from 2 length
strata, ``SmartBatchingTrainer(mix_steps=True)``: a step holds as many examples as the plain row's."""


def trainer_row_options(name: str) -> dict[str, Any]:
    """The :data:`TRAINER_ROW_OPTIONS` of a row name (``{}`` for most rows), as the Trainer takes them
    (``mix_steps=k`` becomes ``mix_steps=True``; :func:`row_accum_steps` gives ``k``)."""
    _, variant = parse_strategy(name)
    options = {k: v for k, v in variant.items() if k in TRAINER_ROW_OPTIONS}
    if "mix_steps" in options:
        options["mix_steps"] = row_accum_steps(name) > 1
    return options


def row_accum_steps(name: str) -> int:
    """The micro-batches per optimizer step of a row: its ``mix_steps=k`` (1 without).

    Raises:
        ConfigError: ``mix_steps`` that is not a whole number of at least 1.
    """
    _, variant = parse_strategy(name)
    k = variant.get("mix_steps", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(
            f"row {name!r}: mix_steps= takes the micro-batches per step, a whole number >= 1 (got {k!r})"
        )
    return k


def row_segment_steps(name: str, plan: BatchPlan, seed: int) -> np.ndarray | None:
    """The optimizer step of each segment of ``plan`` as row ``name`` trains it on one process: None where
    a step is one batch; for a ``[mix_steps=k]`` row, the steps ``SmartBatchingTrainer(mix_steps=True)``
    forms (:func:`~smart_batching.distributed.distribute` with one rank and ``k`` micro-batches a step)."""
    k = row_accum_steps(name)
    if k == 1:
        return None
    return distribute(plan, 1, accum_steps=k, mix_steps=True, seed=seed).segment_steps()


def strategy_options(
    name: str, *, batch_size: int, max_tokens: int, capacity: int, budgets: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """The planner and its options for a strategy name (``group_by_length[megabatch]`` and
    ``token_budget[window=512]`` variants too; :data:`TRAINER_ROW_OPTIONS` are left to the Trainer);
    ``budgets`` maps a name to the budget the bench matched for it (``match_steps``), which wins over
    the shared ``max_tokens`` / ``capacity``."""

    base, variant = parse_strategy(name)
    variant = {k: v for k, v in variant.items() if k not in TRAINER_ROW_OPTIONS}
    k = row_accum_steps(name)
    if batch_size % k:
        raise ConfigError(
            f"row {name!r}: mix_steps={k} cuts a step of batch_size={batch_size} into {k} micro-batches; "
            f"choose a batch size divisible by {k}"
        )
    options = spec_class(base).options_from(
        Knobs(batch_size=batch_size // k, max_tokens=max_tokens // k, capacity=capacity)
    )
    return base, {**options, **variant, **(budgets or {}).get(name, {})}


def bench_options(name: str, settings: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """:func:`strategy_options` under a bench's ``settings`` (its sizes and matched budgets)."""
    s = settings
    return strategy_options(
        name,
        batch_size=s["batch_size"],
        max_tokens=s["max_tokens"],
        capacity=s["capacity"],
        budgets=s.get("budgets"),
    )


# --------------------------------------------------------------------------------------------------
# Evaluation shared by every run
# --------------------------------------------------------------------------------------------------


def evaluate_model(
    bench: BenchContext, model: Any
) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    from smart_batching.bench.evaluate import eval_causal_lm, eval_classifier, generate_texts, inference_mode
    from smart_batching.data.tasks import gsm8k_answer, gsm8k_exact_match

    bm, data, s = bench.model, bench.data, bench.settings
    inference_mode(model, bm.info.get("attn_implementation"))
    tok = bm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    start = time.perf_counter()
    if bm.kind == "classifier":
        ev = eval_classifier(model, data.eval, pad_token_id=pad, device=bench.device)
        ev.pop("predictions")
        from datasets import Dataset

        shown = Dataset.from_dict(
            {
                "input_ids": [p["input_ids"] for p in data.prompts],
                "labels": [p["label"] for p in data.prompts],
            }
        )
        preds = (
            eval_classifier(model, shown, pad_token_id=pad, device=bench.device)["predictions"]
            if data.prompts
            else []
        )
        metric = {
            "name": "accuracy",
            "value": ev["accuracy"],
            "correct": int(round((ev["accuracy"] or 0) * ev["num_examples"])),
            "total": ev["num_examples"],
        }
        gens = [
            {
                "prompt": p["text"],
                "output": str(preds[k]),
                "reference": str(p["label"]),
                "correct": preds[k] == p["label"],
            }
            for k, p in enumerate(data.prompts)
        ]
    else:
        ev = eval_causal_lm(
            model,
            data.eval,
            pad_token_id=pad,
            batch_size=s["eval_batch_size"],
            device=bench.device,
            prefix_cache=bench.eval_prefix,
            packed=True,
        )
        outputs = generate_texts(
            model,
            tok,
            [p["prompt_ids"] for p in data.prompts],
            max_new_tokens=s["max_new_tokens"],
            device=bench.device,
        )
        gens = []
        for p, out in zip(data.prompts, outputs, strict=True):
            g = {"prompt": p["prompt"], "output": out, "reference": p["reference"]}
            if data.task == "gsm8k":
                g["predicted"] = gsm8k_answer(out)
                g["correct"] = gsm8k_exact_match(out, p["reference"] or "")
            gens.append(g)
        metric = None
        if data.task == "gsm8k" and gens:
            correct = sum(bool(g["correct"]) for g in gens)
            metric = {
                "name": "gsm8k_exact_match",
                "value": correct / len(gens),
                "correct": correct,
                "total": len(gens),
            }
    ev["seconds"] = time.perf_counter() - start
    return ev, metric, gens


def held_out_eval(bench: BenchContext, model: Any) -> dict[str, Any]:
    """The held-out loss (and accuracy, for a classifier) of ``model`` in the middle of training: the
    final evaluation's loss on the same examples, without generations; the model's training-time
    attention implementation and KV-cache flag are put back after."""
    from smart_batching import compat
    from smart_batching.bench.evaluate import eval_causal_lm, eval_classifier, inference_mode

    bm, data = bench.model, bench.data
    impl = getattr(model.config, "_attn_implementation", None)
    cache = getattr(model.config, "use_cache", None)
    tok = bm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    inference_mode(model, bm.info.get("attn_implementation"))
    try:
        if bm.kind == "classifier":
            ev = eval_classifier(model, data.eval, pad_token_id=pad, device=bench.device)
            return {"loss": ev["loss"], "accuracy": ev["accuracy"]}
        ev = eval_causal_lm(
            model,
            data.eval,
            pad_token_id=pad,
            batch_size=bench.settings["eval_batch_size"],
            device=bench.device,
            prefix_cache=bench.eval_prefix,
            packed=True,
        )
        return {"loss": ev["loss"]}
    finally:
        if impl is not None and getattr(model.config, "_attn_implementation", None) != impl:
            compat.set_attn_implementation(model, impl)
        if cache is not None:
            model.config.use_cache = cache


def _curve_callback(bench: BenchContext, collator: Any, micro_per_step: int = 1) -> Any:
    """The :class:`~.curve.HeldOutCurve` of a run (its cadence from the settings; ``auto`` resolved from
    the data sizes), with the initial weights' loss as its first point."""
    from smart_batching.bench.curve import auto_cadence, parse_eval_every
    from smart_batching.bench.measure import HeldOutCurve

    s, data = bench.settings, bench.data
    # One of several ranks (nproc > 1): the bench process evaluates the trained weights once, not here.
    rank_of_several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    every = None if rank_of_several else parse_eval_every(s.get("eval_every"))
    if every is not None and every.auto:
        eval_tokens = int(sum(len(x) for x in data.eval["input_ids"]))
        steps = -(-data.num_train // s["batch_size"]) * s["epochs"]
        every = auto_cadence(int(data.lengths.sum()) * s["epochs"], eval_tokens, steps)
    return HeldOutCurve(
        lambda model: held_out_eval(bench, model),
        every,
        real_tokens=collator.real_tokens,
        examples=collator.examples,
        initial_loss=(bench.eval_initial or {}).get("loss"),
        epoch_ends=not rank_of_several,
        micro_per_step=micro_per_step,
    )


# --------------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------------


def _training_args(bench: BenchContext, seed: int, output_dir: str, accum_steps: int = 1) -> Any:
    import torch
    from transformers import TrainingArguments

    from smart_batching.models.zoo import BENCH_MODELS

    s = bench.settings
    cuda = torch.device(bench.device).type == "cuda"
    several = int(os.environ.get("WORLD_SIZE", 1)) > 1
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=s["epochs"],
        per_device_train_batch_size=s["batch_size"],
        gradient_accumulation_steps=accum_steps,
        learning_rate=s["lr"],
        lr_scheduler_type=s.get("lr_schedule", "constant"),
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        # The bench's collators mask each prompt by the data's prompt_length column; HF's default rule
        # would drop it before the collator (it is no forward argument): keep every column.
        remove_unused_columns=False,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        dataloader_pin_memory=cuda,
        use_cpu=not cuda,
        bf16=s.get("precision", "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32") == "bf16",
        ddp_backend="gloo" if several and not cuda else None,
        # The bench models use every parameter in every step; skip DDP's per-step search for unused ones.
        ddp_find_unused_parameters=False if several and bench.model.name in BENCH_MODELS else None,
    )


def _adaptive_options(s: dict[str, Any]) -> dict[str, Any]:
    """The Trainer's adaptive-batching options from the bench settings."""
    from smart_batching.adaptive.schedule import BatchSchedule

    schedule = s.get("batch_schedule")
    if schedule is not None and s.get("schedule_unit"):
        schedule = BatchSchedule.parse(schedule, unit=s["schedule_unit"])
    return {
        "batch_schedule": schedule,
        "lr_scaling": s.get("lr_scaling"),
        "oom_backoff": s.get("oom_backoff") or False,
    }


def _skip_reason(bench: BenchContext, base: str) -> str | None:
    if spec_class(base).packs_rows and bench.model.kind == "classifier":
        return (
            "not applicable to sequence classification: one label per example, but a packed row is pooled "
            "into one vector"
        )
    return None


def run_one(
    bench: BenchContext,
    strategy: str,
    seed: int,
    run_index: int,
    num_runs: int,
    callbacks: Sequence[Any],
    progress: bool,
    launcher: Any = None,
) -> dict[str, Any]:
    """Train, measure and evaluate one run; returns its record.

    Args:
        launcher: None trains in this process; a :class:`~.multiprocess.RankLauncher` trains on its
            processes and hands back the trained weights, which are evaluated here.
    """
    s, bm, data = bench.settings, bench.model, bench.data
    base, options = bench_options(strategy, s)
    record: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "bench_id": bench.bench_id,
        "run_index": run_index,
        "strategy": strategy,
        "strategy_options": options,
        "seed": seed,
        "model": bm.name,
        "task": data.task,
        "world_size": launcher.nproc if launcher is not None else 1,
    }
    common = {
        "data": _data_summary(data),
        "settings": s,
        "versions": bench.versions,
        "machine": bench.machine,
        "eval_initial": bench.eval_initial,
    }
    reason = _skip_reason(bench, base)
    if reason is not None:
        return {**record, "status": "skipped", "skip_reason": reason, **common}

    release_memory()
    label = f"[{run_index + 1}/{num_runs}] {strategy} seed {seed}"
    if launcher is None:
        model, measured = train_run(
            bench, strategy, seed, label=label, callbacks=callbacks, progress=progress
        )
    else:
        model, measured = launcher.train(strategy, seed, run_index=run_index, label=label)
    record = _finish_record(bench, record, common, measured, model)
    # From the strategy's plans for epochs 0 and 1 (planned here, apart from training: the run is untouched):
    # how random its batches are (analysis.batch_randomness) and, on one process (several processes' steps
    # are the balanced plan's), what epoch 0 does to the weight of a token.
    plans = [plan_batches(data.lengths, base, seed=seed, epoch=e, **options) for e in (0, 1)]
    record["randomness"] = randomness_record(*plans)
    steps = row_segment_steps(strategy, plans[0], seed)
    record["token_weights"] = plan_token_weights(data, plans[0], steps) if launcher is None else None
    del model
    release_memory()
    return record


def train_run(
    bench: BenchContext,
    strategy: str,
    seed: int,
    *,
    label: str,
    callbacks: Sequence[Any] = (),
    progress: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """Train a fresh copy of the model with one strategy and seed, on this process (one rank).

    Returns:
        ``(model, measured)``: the trained model and this rank's measurements, a dict of plain values
        and NumPy arrays; ``world_size`` is 1 here (:func:`~.multiprocess.merge_measurements` puts
        the ranks' together).
    """
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from smart_batching.bench.measure import (
        ClassificationCollator,
        CountingCollator,
        LossRecorder,
        ProgressBar,
        StepTimer,
        classification_loss,
    )
    from smart_batching.distributed.sampler import DistributedSmartBatchSampler
    from smart_batching.fallbacks import recorded_fallbacks, reset_fallbacks
    from smart_batching.hf import SmartBatchingTrainer, make_collator

    s, bm, data = bench.settings, bench.model, bench.data
    base, options = bench_options(strategy, s)
    tok = bm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    # max_length plans every row at one width, but the padding collators pad to the longest example of
    # the batch; a multiple of the planned width is exactly that width (no example is longer).
    width = make_spec(base, **options).fixed_width(int(data.lengths.max()))
    if bm.kind == "classifier":
        inner = ClassificationCollator(pad, pad_to_multiple_of=width)
    else:
        inner = make_collator(base, pad_token_id=pad, **({"pad_to_multiple_of": width} if width else {}))
    collator = CountingCollator(inner)
    timer, losses = StepTimer(bench.device), LossRecorder()
    accum = row_accum_steps(strategy)
    curve = _curve_callback(bench, collator, accum)
    # Bars only on a terminal; in logs the per-run lines say enough.
    bar = ProgressBar(label, enabled=progress and sys.stderr.isatty())
    model = bm.fresh(bench.device)
    reset_fallbacks()  # this run's slower paths only
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="smart-batching-bench-") as tmp:
        trainer = SmartBatchingTrainer(
            model=model,
            args=_training_args(bench, seed, tmp, accum),
            train_dataset=data.train,
            data_collator=collator,
            compute_loss_func=classification_loss if bm.kind == "classifier" else None,
            callbacks=[timer, losses, bar, curve, *callbacks],
            strategy=base,
            strategy_options=options,
            seed=seed,
            **_adaptive_options(s),
            **trainer_row_options(strategy),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        try:
            with PeakMemory(bench.device) as mem:
                start, cpu_start = time.perf_counter(), time.process_time()
                curve.start()
                trainer.train()
                # Evaluations during training are timed apart and left out of the training clock.
                wall = time.perf_counter() - start - curve.eval_wall
                cpu = time.process_time() - cpu_start - curve.eval_cpu
        finally:
            bar.close()
    precision = {"setting": s.get("precision"), **trainer.smart_batching.precision}
    guard = trainer.smart_batching.guard
    if guard is not None:
        guard.remove()
    sampler = trainer.smart_batching.sampler
    epochs = range(s["epochs"])
    micro_per_step = None
    if hasattr(sampler, "stepped_plan"):  # a batch schedule: this rank's share of every step
        stepped = [sampler.stepped_plan(e) for e in epochs]
        plans = [sp.base for sp in stepped]
        parts = [sp.rank_order[sampler.rank] for sp in stepped]
        ids = np.concatenate([p.example_ids[seg] for p, seg in zip(plans, parts, strict=True)])
        seg_lengths = np.concatenate([p.seg_lengths[seg] for p, seg in zip(plans, parts, strict=True)])
        imbalance = max(sp.max_step_imbalance for sp in stepped) if sampler.world_size > 1 else None
        micro_per_step = np.concatenate([sp.micro_per_step for sp in stepped]).tolist()
    elif isinstance(sampler, DistributedSmartBatchSampler):
        # This rank's share of each epoch's balanced plan; the ranks' shares together are the plan.
        rank, dists, parts = sampler.world.rank, [sampler.distributed_plan(e) for e in epochs], []
        for d in dists:
            units = [int(u) for u in d.rank_units(rank) if u >= 0]
            parts.append(
                np.concatenate([d.unit_segments(u) for u in units]) if units else np.zeros(0, np.int64)
            )
        imbalance = max([1.0, *(d.max_step_imbalance for d in dists)])
        plans = [d.base for d in dists]
        ids = np.concatenate([p.example_ids[seg] for p, seg in zip(plans, parts, strict=True)])
        seg_lengths = np.concatenate([p.seg_lengths[seg] for p, seg in zip(plans, parts, strict=True)])
    else:
        plans = [sampler.plan_for_epoch(e) for e in epochs]
        ids = np.concatenate([p.example_ids for p in plans])
        seg_lengths = np.concatenate([p.seg_lengths for p in plans])
        imbalance = None
    if micro_per_step is None and accum > 1:
        micro_per_step = [accum] * int(trainer.state.global_step)
    stats = plans[0].stats()
    measured = {
        "world_size": 1,
        "num_steps": int(trainer.state.global_step),
        "examples": list(collator.examples),
        "real_tokens": list(collator.real_tokens),
        "slots": list(collator.slots),
        "target_tokens": list(collator.target_tokens),
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "step_seconds": list(timer.step_seconds),
        "iteration_seconds": list(timer.iteration_seconds),
        "peak_memory_mb": [mem.peak_mb],
        "memory_start_mb": [mem.start_mb],
        "memory_kind": mem.kind,
        "loss_steps": list(losses.steps),
        "losses": list(losses.losses),
        "example_ids": ids,
        "seg_lengths": seg_lengths,
        "planned": {
            "num_batches": stats.num_batches,
            "num_rows": stats.num_rows,
            "efficiency": stats.efficiency,
            "token_slots": stats.token_slots,
            "examples_per_batch": stats.examples_per_batch,
            **({"max_step_imbalance": imbalance} if imbalance is not None else {}),
        },
        "plan_dropped": {
            "num_dropped_by_plan": int(stats.num_dropped),
            "num_truncated_by_plan": int(stats.num_truncated),
            "num_split_by_plan": int(stats.num_split),
        },
        "fallbacks": recorded_fallbacks(),
        "schedule": trainer.realised_schedule(),
        "micro_per_step": micro_per_step,
        "oom_backoff": None
        if trainer.smart_batching.backoff is None
        else trainer.smart_batching.backoff_state.state_dict(),
        "precision": precision,
        "eval_curve": curve.curve(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    del trainer
    return model, measured


def _finish_record(
    bench: BenchContext, record: dict[str, Any], common: dict[str, Any], m: dict[str, Any], model: Any
) -> dict[str, Any]:
    """Evaluate the trained model and complete the record from the (merged) measurements ``m``."""
    from smart_batching.bench.measure import percentiles

    s, data = bench.settings, bench.data
    ev, metric, gens = evaluate_model(bench, model)
    real, slots, examples = int(sum(m["real_tokens"])), int(sum(m["slots"])), int(sum(m["examples"]))
    wall = m["wall_seconds"]
    examples_cum = np.cumsum(m["examples"])
    tokens_cum = np.cumsum(m["real_tokens"])
    if m.get("micro_per_step"):  # a batch schedule: several micro-batches per optimizer step
        ends = np.cumsum(m["micro_per_step"]) - 1
        ends = ends[ends < len(examples_cum)]
        examples_cum, tokens_cum = examples_cum[ends], tokens_cum[ends]
    steps = [st for st in m["loss_steps"] if st <= len(examples_cum)]
    curve_losses = m["losses"][: len(steps)]
    tail = curve_losses[-max(1, len(curve_losses) // 10) :]
    curve = m.get("eval_curve")
    if curve is not None and ev.get("loss") is not None:
        # The final evaluation is the curve's last point, at the end of the training clock (it replaces
        # a point the callback took at the last step, e.g. the end of a shorter last epoch).
        columns = [k for k in curve if isinstance(curve[k], list)]
        if curve["step"] and curve["step"][-1] == m["num_steps"]:
            for key in columns:
                curve[key].pop()
        final = {"step": m["num_steps"], "tokens": real, "examples": examples, "wall_seconds": round(wall, 4),
                 "cpu_seconds": round(m["cpu_seconds"], 4), "epoch": float(s["epochs"]),
                 "loss": float(ev["loss"]), "accuracy": ev.get("accuracy")}  # fmt: skip
        for key in columns:
            curve[key].append(final[key])
    peaks = [v for v in m["peak_memory_mb"] if v is not None]
    starts = [v for v in m["memory_start_mb"] if v is not None]
    record.update(
        status="ok",
        world_size=m["world_size"],
        fallbacks=m["fallbacks"],
        precision=m.get("precision"),
        num_steps=m["num_steps"],
        num_examples_seen=examples,
        real_tokens=real,
        token_slots=slots,
        target_tokens=int(sum(m["target_tokens"])),
        padding_ratio=1.0 - real / slots if slots else 0.0,
        examples_digest=examples_digest(m["example_ids"], m["seg_lengths"]),
        wall_seconds=wall,
        cpu_seconds=m["cpu_seconds"],
        tokens_per_second=real / wall,
        samples_per_second=examples / wall,
        step_seconds=percentiles(m["step_seconds"]),
        iteration_seconds=percentiles(m["iteration_seconds"]),
        peak_memory_mb=max(peaks) if peaks else None,
        peak_memory_mb_per_rank=m["peak_memory_mb"],
        memory_start_mb=max(starts) if starts else None,
        memory_kind=m["memory_kind"],
        loss_curve={
            "step": steps,
            "examples": [int(examples_cum[st - 1]) for st in steps],
            "tokens": [int(tokens_cum[st - 1]) for st in steps],
            "loss": [round(v, 5) for v in curve_losses],
        },
        train_loss_final=float(np.mean(tail)) if tail else None,
        eval=ev,
        eval_curve=curve,
        eval_overhead=None
        if curve is None
        else {
            "wall_seconds": curve["eval_wall_seconds"],
            "cpu_seconds": curve["eval_cpu_seconds"],
            "wall_ratio": curve["eval_wall_seconds"] / wall if wall else None,
        },
        task_metric=metric,
        generations=gens,
        dropped={
            "num_truncated": data.truncation["num_truncated"],
            "truncated_tokens": data.truncation["truncated_tokens"],
            "max_length": data.truncation["max_length"],
            **m["plan_dropped"],
            "num_examples_not_seen": int(data.num_train * s["epochs"] - len(m["example_ids"])),
        },
        planned=m["planned"],
        schedule=m.get("schedule"),
        oom_backoff=m.get("oom_backoff"),
        rank_balance=m.get("rank_balance"),
        load_average_start=m["load_average_start"],
        load_average_end=m["load_average_end"],
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        **common,
    )
    return record


def _data_summary(data: TrainingData) -> dict[str, Any]:
    from smart_batching.analysis import length_summary

    return {
        "source": data.source,
        "eval_source": data.eval_source,
        "task": data.task,
        "format": data.format,
        "num_train": data.num_train,
        "num_eval": len(data.eval),
        "lengths": length_summary(data.lengths),
        "histogram": length_histogram(data.lengths),
        "truncation": data.truncation,
    }


# --------------------------------------------------------------------------------------------------
# Setup and the loop
# --------------------------------------------------------------------------------------------------


def warmup(bench: BenchContext, strategies: Sequence[str]) -> None:
    """Plan every strategy once (numba compiles) and train one padded and one packed batch on a copy."""
    import torch

    from smart_batching.attention import enable_packed_attention
    from smart_batching.bench.measure import ClassificationCollator
    from smart_batching.collate import PackingCollator, PaddingCollator

    s, data, bm = bench.settings, bench.data, bench.model
    for name in strategies:
        base, options = bench_options(name, s)
        plan_batches(data.lengths, base, seed=0, **options)
    rows = [data.train[i] for i in range(min(s["batch_size"], data.num_train))]
    tok = bm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    model = bm.fresh(bench.device)
    collate = ClassificationCollator(pad) if bm.kind == "classifier" else PaddingCollator(pad)
    batches = [collate(rows)]
    if bm.kind == "causal" and any(spec_class(parse_strategy(n)[0]).packs_rows for n in strategies):
        enable_packed_attention(model)
        batches.append(PackingCollator()(rows))
    # One optimizer step too: the first AdamW step allocates its state (seconds for a 135M model).
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for batch in batches:
        inputs = {k: v.to(bench.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
        if bm.kind == "classifier":
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        else:
            loss = logits.float().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer
    release_memory()


__all__ = [
    "BenchContext",
    "evaluate_model",
    "held_out_eval",
    "row_accum_steps",
    "row_segment_steps",
    "run_one",
    "strategy_options",
    "train_run",
    "trainer_row_options",
    "warmup",
]
