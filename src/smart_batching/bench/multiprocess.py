"""Bench runs on several processes: one torchrun per run; measurements and weights come back to the bench.

``run_bench(nproc=N)`` (``smart-batching bench --nproc N``) keeps everything but the training in its
own process: set-up, evaluation, records, report, progress lines and Ctrl-C. For each run a
:class:`RankLauncher` starts ``torchrun --standalone --nproc_per_node N -m smart_batching.bench.multiprocess``.
Every rank loads the bench (model, tokenised data, settings: written once per bench to a temporary
folder), warms up, and trains its share of the balanced plan through the same Trainer set-up as a
one-process run (:func:`~.training.train_run`; gloo on CPU, NCCL on GPUs, one GPU per rank). Rank 0
gathers the ranks' measurements (:func:`merge_measurements`) and writes them with the trained
weights; the bench evaluates those weights once, as it evaluates a one-process run::

    bench process                          torchrun, once per (strategy, seed)
    ──────────────────────────────────     ─────────────────────────────────────────────────
    load model, tokenise data
    write <tmp>/bench.pt  ────────────────► ranks 0..N-1: load bench.pt, warm up, train
                                            all_gather measurements on rank 0
    read <tmp>/result-<i>.pt  ◄──────────── rank 0: write result-<i>.pt (measurements, weights)
    evaluate the weights, write the record

A worker that fails writes ``error-<i>-rank<r>.json``; a fixable error (:class:`ConfigError` and the
like, e.g. too few examples for N processes) comes back as the same error, any other as a
``RuntimeError`` with the worker's traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

from smart_batching.bench.training import BenchContext, _skip_reason, bench_options, train_run, warmup
from smart_batching.distributed import shutdown
from smart_batching.errors import ConfigError, SmartBatchingError

WORKER_MODULE = "smart_batching.bench.multiprocess"
JOB_NAME = "bench.pt"


def _add_counts(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + int(v)
    return total


def merge_measurements(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One measurement from every rank's (``parts[r]``: rank ``r``'s, as :func:`~.training.train_run` returns).

    Per optimizer step (one micro-batch per rank) the examples, real tokens and token slots of all
    ranks are added up, and the step and iteration times are the slowest rank's. Wall time is the
    slowest rank's, so tokens/s is the whole job's; CPU time is the sum over ranks; peak memory is
    kept per rank. The logged loss is rank 0's (Trainer averages it over the ranks). The examples
    trained are every rank's share put together. ``rank_balance`` keeps what each rank computed in
    each step (:func:`rank_balance`).
    """

    def add(key: str) -> list[int]:
        return [int(sum(v)) for v in zip_longest(*(p[key] for p in parts), fillvalue=0)]

    def slowest(key: str) -> list[float]:
        return [max(v) for v in zip_longest(*(p[key] for p in parts), fillvalue=0.0)]

    merged = dict(parts[0])
    merged.update(
        world_size=len(parts),
        rank_balance=rank_balance(parts),
        examples=add("examples"),
        real_tokens=add("real_tokens"),
        slots=add("slots"),
        target_tokens=add("target_tokens"),
        wall_seconds=max(p["wall_seconds"] for p in parts),
        cpu_seconds=sum(p["cpu_seconds"] for p in parts),
        step_seconds=slowest("step_seconds"),
        iteration_seconds=slowest("iteration_seconds"),
        peak_memory_mb=[v for p in parts for v in p["peak_memory_mb"]],
        fallbacks=_add_counts(p["fallbacks"] for p in parts),
        memory_start_mb=[v for p in parts for v in p["memory_start_mb"]],
        example_ids=np.concatenate([p["example_ids"] for p in parts]),
        seg_lengths=np.concatenate([p["seg_lengths"] for p in parts]),
    )
    return merged


def rank_balance(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How evenly the ranks' work was spread, step by step, from the batches each rank computed.

    A step waits for its slowest rank, so the figure per step is the largest rank's token slots
    (rows × padded width: the compute) over the mean rank's; 1.0 is perfect balance, 1.5 means the
    busiest rank computed 50% more than the average one.

    Returns:
        ``{"per_step": [...], "mean": ..., "max": ..., "measure": "token_slots", "slots": [[rank 0, rank
        1, ...] per step], "real_tokens": [[...] per step]}``; a step a rank did not take counts 0.
    """
    slots = np.array(list(zip_longest(*(p["slots"] for p in parts), fillvalue=0)), dtype=np.int64)
    real = np.array(list(zip_longest(*(p["real_tokens"] for p in parts), fillvalue=0)), dtype=np.int64)
    slots = slots.reshape(-1, len(parts))  # (num_steps, world_size)
    mean = slots.mean(axis=1)
    per_step = np.divide(slots.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
    return {
        "per_step": [round(float(v), 4) for v in per_step],
        "mean": float(per_step.mean()) if per_step.size else 1.0,
        "max": float(per_step.max()) if per_step.size else 1.0,
        "measure": "token_slots",
        "slots": slots.tolist(),
        "real_tokens": real.reshape(-1, len(parts)).tolist(),
    }


def check_world(bench: BenchContext, strategies: Sequence[str], seeds: Sequence[int], nproc: int) -> None:
    """Refuse, before anything is launched, a plan that would leave some process a step without a batch.

    Also plans every strategy once here (the planners compile with numba on first use).

    Raises:
        ConfigError: fewer batches (or examples, where batches can be split) than processes.
    """
    from smart_batching.distributed import distribute
    from smart_batching.planners import plan_batches

    s, data = bench.settings, bench.data
    for name in strategies:
        base, options = bench_options(name, s)
        if _skip_reason(bench, base) is not None:
            continue
        for seed in seeds:
            plan = plan_batches(data.lengths, base, seed=seed, **options)
            if distribute(plan, nproc, accum_steps=1, seed=seed).num_empty_slots:
                raise ConfigError(
                    f"nproc={nproc} is too many for {data.num_train} training examples with strategy {name!r}: "
                    "some processes would get no batch in a step; lower nproc or train on more examples "
                    "(num_examples / max_steps)"
                )


class RankLauncher:
    """Trains bench runs on ``nproc`` processes, one torchrun per run (a context manager).

    Args:
        bench: the bench; its model, data and settings are written once to a temporary folder.
        nproc: processes per run.
        threads_per_rank: ``OMP_NUM_THREADS`` and torch CPU threads of every process.
        progress: the worker's tqdm bar (rank 0, on a terminal) and its output go to stderr;
            otherwise the output goes to a log whose end is shown if the run fails.
    """

    def __init__(self, bench: BenchContext, nproc: int, *, threads_per_rank: int, progress: bool) -> None:
        import torch

        self.bench, self.nproc, self.threads, self.progress = (
            bench,
            int(nproc),
            int(threads_per_rank),
            progress,
        )
        self._tmp = tempfile.TemporaryDirectory(prefix="smart-batching-ranks-")
        self.job = Path(self._tmp.name)
        # The base model is untouched, so its weights are the initial ones: ship them once, not twice.
        shipped = dataclasses.replace(bench, model=dataclasses.replace(bench.model, initial_state={}))
        torch.save({"bench": shipped, "threads": self.threads}, self.job / JOB_NAME)

    def __enter__(self) -> RankLauncher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._tmp.cleanup()

    def train(self, strategy: str, seed: int, *, run_index: int, label: str) -> tuple[Any, dict[str, Any]]:
        """Train one run on the processes; returns ``(model, measured)`` as :func:`~.training.train_run`
        does, the model holding rank 0's trained weights, on the bench's device."""
        import torch

        from smart_batching.distributed.launch import run_torchrun, torchrun_env

        args = [str(self.job), "--strategy", strategy, "--seed", str(seed), "--run-index", str(run_index)]
        args += ["--label", label, *(["--progress"] if self.progress else [])]
        out, log_path = self._output(run_index)
        try:
            code = run_torchrun(
                self.nproc, WORKER_MODULE, args, env=torchrun_env(self.threads), stdout=out, stderr=out
            )
        finally:
            if log_path is not None:
                out.close()
        result = self.job / f"result-{run_index}.pt"
        if code != 0 or not result.is_file():
            raise self._failure(run_index, label, code, log_path)
        payload = torch.load(result, map_location="cpu", weights_only=False)
        result.unlink()
        model = self.bench.model.fresh(self.bench.device)
        model.load_state_dict(payload["state"], strict=True)
        return model, payload["measured"]

    def _output(self, run_index: int) -> tuple[Any, Path | None]:
        if self.progress:
            try:
                return sys.stderr.fileno(), None  # workers' stdout too: ours may be --json records
            except (AttributeError, OSError, ValueError):  # stderr replaced by an object without a file
                pass
        path = self.job / f"run-{run_index}.log"
        return open(path, "wb"), path

    def _failure(self, run_index: int, label: str, code: int, log_path: Path | None) -> Exception:
        where = f"{label} on {self.nproc} processes"
        errors = sorted(self.job.glob(f"error-{run_index}-rank*.json"))
        if errors:
            info = json.loads(errors[0].read_text())
            if info["user_error"]:
                return ConfigError(f"{where}: {info['message']}")
            return RuntimeError(
                f"{where} failed on rank {info['rank']}: {info['type']}: {info['message']}\n{info['traceback']}"
            )
        tail = ""
        if log_path is not None and log_path.is_file():
            tail = "; its last output:\n" + log_path.read_text(errors="replace")[-3000:]
        return RuntimeError(f"{where}: torchrun exited with status {code}{tail}")


# --------------------------------------------------------------------------------------------------
# The worker: one rank of one run
# --------------------------------------------------------------------------------------------------


def _work(args: argparse.Namespace, rank: int) -> None:
    import torch

    job = torch.load(args.job / JOB_NAME, map_location="cpu", weights_only=False)
    bench: BenchContext = job["bench"]
    bench.model.initial_state = bench.model.base.state_dict()
    if bench.device.type == "cuda":
        bench.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(bench.device)
    else:
        bench.device = torch.device("cpu")
    torch.set_num_threads(job["threads"])
    warmup(bench, [args.strategy])
    model, measured = train_run(
        bench, args.strategy, args.seed, label=args.label, progress=args.progress and rank == 0
    )
    dist = torch.distributed
    parts: list[Any] = [measured]
    if dist.is_available() and dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, measured)
    if rank == 0:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        path = args.job / f"result-{args.run_index}.pt"
        partial = path.with_suffix(".partial")
        torch.save({"measured": merge_measurements(parts), "state": state}, partial)
        os.replace(partial, path)  # the bench never reads half a file
    del model  # DDP's reducer goes before the process group (see smart_batching.distributed.shutdown)
    shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of one bench run (started by :class:`RankLauncher` under torchrun)."""
    p = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("job", type=Path, help="the launcher's folder (bench.pt)")
    p.add_argument("--strategy", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--run-index", type=int, required=True)
    p.add_argument("--label", default="")
    p.add_argument("--progress", action="store_true")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        _work(args, rank)
    except KeyboardInterrupt:  # Ctrl-C: the bench says what it kept; no traceback per process
        return 130
    except Exception as exc:
        info = {
            "rank": rank,
            "type": type(exc).__name__,
            "message": " ".join(str(exc).split()),
            "user_error": isinstance(exc, SmartBatchingError),
            "traceback": traceback.format_exc()[-4000:],
        }
        (args.job / f"error-{args.run_index}-rank{rank}.json").write_text(json.dumps(info))
        print(info["traceback"], file=sys.stderr, flush=True)
        return 2 if info["user_error"] else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["JOB_NAME", "RankLauncher", "check_world", "merge_measurements", "rank_balance"]
