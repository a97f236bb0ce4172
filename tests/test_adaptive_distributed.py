"""Adaptive batching on 2 real processes (torchrun, gloo, DDP through the HF Trainer): the
out-of-memory back-off when only rank 1 fails (in forward; slow: in backward), and a batch schedule
balanced at every step of its ramp. One launch runs several trainings one after the other."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from launched import run_launcher

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


WORKER = Path(__file__).resolve().parent / "adaptive_ddp_worker.py"


def launch(out: Path, runs: list[dict], *args: str, nproc: int = 2) -> list[list[dict]]:
    """Run ``runs`` on ``nproc`` ranks; returns each run's records, one per rank."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        str(WORKER), "--out", str(out), "--runs", json.dumps(runs), *args,
    ]  # fmt: skip
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SMART_BATCHING_FAIL_")}
    full_env = {**clean, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # A hang (a rank waiting in a collective the other never reaches) fails here instead of blocking.
    proc = run_launcher(cmd, env=full_env, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [
        [torch.load(out / f"run{i}_rank{r}.pt", weights_only=False) for r in range(nproc)]
        for i in range(len(runs))
    ]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check_backoff(failing: list[dict], planned: list[dict]) -> None:
    rank0, rank1 = (r["backoff"] for r in failing)
    assert rank1["num_failures"] >= 1 and rank0["num_failures"] == 0  # only rank 1 failed ...
    assert rank0["budget"] == rank1["budget"] is not None  # ... and both ranks learned its budget
    assert rank0["num_backoffs"] == rank1["num_backoffs"] >= 1
    assert any(e["stage"] == "other rank" for e in rank0["events"])
    assert failing[0]["global_step"] == failing[1]["global_step"] == 6
    assert max_diff(failing[0]["weights"], failing[1]["weights"]) == 0.0  # DDP kept them identical
    assert planned[0]["backoff"]["num_failures"] == planned[1]["backoff"]["num_failures"] == 0
    assert max_diff(failing[0]["weights"], planned[0]["weights"]) < 5e-5
    assert planned[0]["global_step"] == 6


def check_schedule(run: list[dict]) -> None:
    stepped = run[0]["stepped"]
    assert stepped == run[1]["stepped"]  # every rank computed the same steps
    assert len(run[0]["tokens"]) == len(run[1]["tokens"])  # as many micro-batches on both ranks
    per_step = stepped["micro_per_step"][:6]
    # What each rank trained, step by step, is the plan's share; shares within one example of each other
    # and of half the schedule's size, at every step of the ramp.
    trained = np.array(
        [[sum(r["tokens"][sum(per_step[:s]) : sum(per_step[: s + 1])]) for r in run] for s in range(6)]
    )
    np.testing.assert_array_equal(trained, np.asarray(stepped["rank_step_tokens"][:6]))
    targets = np.asarray(stepped["targets"][:6])
    assert targets[0] < targets[5]  # a ramp
    assert np.all(np.abs(trained - targets[:, None] / 2) <= stepped["longest"])
    assert np.all(trained.max(axis=1) - trained.min(axis=1) <= stepped["longest"])
    assert max_diff(run[0]["weights"], run[1]["weights"]) == 0.0


def check_stream(run: list[dict]) -> None:
    """Each rank groups its own shard at half of every step's size: within about one example. (The
    stream's loader is not prepared by accelerate, so it collates no step ahead: marks split steps.)"""
    assert run[0]["global_step"] == run[1]["global_step"] == 6
    steps = [np.diff([0, *r["marks"]]) for r in run]
    tokens = np.array([[sum(r["tokens"][a : a + n]) for a, n in zip(np.cumsum([0, *s[:-1]]), s, strict=True)]
                       for r, s in zip(run, steps, strict=True)])  # fmt: skip
    assert tokens[:, 0].max() < 300 and tokens[:, -1].min() > 400  # the ramp (300 -> 1500 in all)
    assert np.all(np.abs(tokens[0] - tokens[1]) <= 2 * 90)  # examples are under 90 tokens
    assert max_diff(run[0]["weights"], run[1]["weights"]) == 0.0


def test_backoff_when_only_rank_1_fails_and_a_schedule(tmp_path: Path) -> None:
    """Rank 1's micro-batches over the limit run out of memory in forward; rank 0's never do. The run
    finishes (no rank waits for a collective the other skipped), both ranks end with the same weights,
    equal to the run split that way from the start. Then a batch schedule on the same 2 ranks, on the
    dataset and on a stream of it."""
    fault = {"fail_over_tokens": 160, "fail_ranks": [1], "fail_stage": "forward"}
    schedule = {"batch_schedule": "linear:300->1500@5000", "accum": 1}
    failing, planned, scheduled, streamed = launch(
        tmp_path, [{"oom_backoff": fault}, {"budget_of": 0}, schedule, {**schedule, "stream": True}]
    )
    check_backoff(failing, planned)
    check_schedule(scheduled)
    check_stream(streamed)


@pytest.mark.slow
def test_backoff_in_backward_when_only_rank_1_fails(tmp_path: Path) -> None:
    fault = {"fail_over_tokens": 160, "fail_ranks": [1], "fail_stage": "backward"}
    failing, planned = launch(tmp_path, [{"oom_backoff": fault}, {"budget_of": 0}])
    check_backoff(failing, planned)
