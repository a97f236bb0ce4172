"""``smart-batching bench --nproc 2``: every run trains on two real processes (torchrun, gloo on CPU).

Slow tier: one bench through the real command line (a subprocess, so its stdout is checked as the
user sees it): the embedded default data, 16 examples, the tiny Llama, ``random`` and ``packed``, two
steps each. 50 s on 2 CPU cores with little else running, 105 s at load average 3-6; most of it is
starting Python, torch and transformers in the bench and in every worker process.

Default tier: the argument checks and the refusal of too many processes (no process started), and
how the ranks' measurements are put together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("matplotlib")

from smart_batching.bench.measure import examples_digest  # noqa: E402
from smart_batching.bench.multiprocess import merge_measurements  # noqa: E402
from smart_batching.bench.records import RECORD_FIELDS, read_records  # noqa: E402
from smart_batching.bench.runner import run_bench  # noqa: E402
from smart_batching.cli import main  # noqa: E402
from smart_batching.data.tasks import prepare_training_data  # noqa: E402
from smart_batching.errors import ConfigError  # noqa: E402

NUM_TRAIN = 16
MAX_LENGTH = 256
STRATEGIES = ["random", "packed"]


@pytest.fixture(scope="module")
def bench_two_procs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str]:
    out = tmp_path_factory.mktemp("bench-nproc") / "out"
    cmd = [
        sys.executable, "-m", "smart_batching", "bench", "--data", "default", "--num-examples", str(NUM_TRAIN),
        "--max-length", str(MAX_LENGTH), "--strategies", ",".join(STRATEGIES), "--batch-size", "4",
        "--eval-examples", "4", "--num-generations", "1", "--max-new-tokens", "4", "--nproc", "2",
        "--out", str(out), "--json", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # --json: stdout holds the records and nothing else (the workers' output goes elsewhere).
    printed = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return out, printed, proc.stderr


@pytest.mark.slow
def test_records_state_two_processes(bench_two_procs):
    out, printed, _ = bench_two_procs
    records = read_records(out / "records.jsonl")
    assert [r["strategy"] for r in records] == STRATEGIES
    assert [r["strategy"] for r in printed] == STRATEGIES
    for r in records:
        assert r["status"] == "ok"
        missing = [f for f in RECORD_FIELDS if f not in r]
        assert not missing, missing
        assert r["world_size"] == 2 and r["settings"]["nproc"] == 2 and r["machine"]["processes"] == 2
        # Throughput is every process's real tokens over the (slowest process's) wall time.
        assert r["wall_seconds"] > 0 and r["tokens_per_second"] > 0
        assert r["tokens_per_second"] == pytest.approx(r["real_tokens"] / r["wall_seconds"])
        assert r["samples_per_second"] == pytest.approx(NUM_TRAIN / r["wall_seconds"])
        assert r["step_seconds"]["n"] == r["num_steps"] >= 1
        per_rank = r["peak_memory_mb_per_rank"]
        assert len(per_rank) == 2 and min(per_rank) > 0 and r["peak_memory_mb"] == max(per_rank)
        assert len(r["loss_curve"]["loss"]) == r["num_steps"]
        assert r["loss_curve"]["examples"][-1] == NUM_TRAIN  # per-step counts add up every process's batch
        assert r["planned"]["max_step_imbalance"] < 1.5
        # Evaluated once, on the trained weights.
        assert r["eval"]["loss"] > 0 and r["eval"]["num_examples"] == 4
        assert r["eval"]["loss"] != r["eval_initial"]["loss"]
        assert len(r["generations"]) == 1


@pytest.mark.slow
def test_every_strategy_sees_every_example_once_across_processes(bench_two_procs):
    out, _, _ = bench_two_procs
    records = read_records(out / "records.jsonl")
    assert {r["num_examples_seen"] for r in records} == {NUM_TRAIN}
    assert len({r["real_tokens"] for r in records}) == 1
    assert {r["dropped"]["num_examples_not_seen"] for r in records} == {0}
    # The ranks' shares put together are every example, whole, exactly once.
    from smart_batching.data.tokenizers import load_tokenizer

    data = prepare_training_data(
        "default", tokenizer=load_tokenizer("smollm2"), model_kind="causal", num_examples=NUM_TRAIN,
        eval_examples=4, max_length=MAX_LENGTH, num_prompts=1,
    )  # fmt: skip
    expected = examples_digest(np.arange(NUM_TRAIN), data.lengths)
    assert {r["examples_digest"] for r in records} == {expected}
    assert records[0]["real_tokens"] == int(data.lengths.sum())


@pytest.mark.slow
def test_report_renders_for_two_processes(bench_two_procs, tmp_path):
    out, _, stderr = bench_two_procs
    text = (out / "report.md").read_text()
    assert "2 processes per run" in text and "trained on 2 processes" in text
    assert "random" in text and "packed" in text
    assert (out / "report.html").is_file()
    # The one-screen summary went to stderr (stdout was the records).
    assert "x random" in stderr and "2 processes x" in stderr
    assert main(["report", str(out / "records.jsonl"), "--out", str(tmp_path)]) == 0


def test_nproc_must_be_positive(capsys):
    assert main(["bench", "--nproc", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--nproc" in err and "positive integer" in err
    with pytest.raises(ConfigError, match="nproc=0"):
        run_bench(nproc=0)
    with pytest.raises(ConfigError, match="callbacks"):
        run_bench(nproc=2, callbacks=[object()])


def test_too_many_processes_for_the_data_is_refused_before_launching(tmp_path):
    # 2 examples cannot fill 4 processes' batches: refused with a message naming nproc, no torchrun started.
    with pytest.raises(ConfigError, match="nproc=4 is too many"):
        run_bench(
            "default", model="tiny-llama", model_options={"hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}, strategies=("random",),
            num_examples=2, batch_size=4, eval_examples=2, num_generations=0, nproc=4, out_dir=tmp_path,
            progress=False,
        )  # fmt: skip


def _rank(rank: int, examples: list[int], tokens: list[int], step_s: list[float], peak: float) -> dict:
    ids = np.arange(rank * 10, rank * 10 + sum(examples))
    return {
        "world_size": 1, "num_steps": len(examples), "examples": examples, "real_tokens": tokens,
        "slots": [2 * t for t in tokens], "target_tokens": [t // 2 for t in tokens], "wall_seconds": 1.0 + rank,
        "cpu_seconds": 2.0, "step_seconds": step_s,
        "iteration_seconds": step_s, "peak_memory_mb": [peak], "memory_start_mb": [peak / 2],
        "losses": [float(rank)] * len(examples), "example_ids": ids, "seg_lengths": ids + 1,
        "fallbacks": {"attention.varlen": 3} if rank else {},
    }  # fmt: skip


def test_merge_measurements_adds_tokens_per_step_and_keeps_the_slowest():
    merged = merge_measurements(
        [_rank(0, [2, 3], [20, 30], [0.5, 0.1], 100.0), _rank(1, [1, 4], [25, 26], [0.2, 0.3], 120.0)]
    )
    assert merged["world_size"] == 2
    assert merged["examples"] == [3, 7] and merged["real_tokens"] == [45, 56] and merged["slots"] == [90, 112]
    assert merged["target_tokens"] == [22, 28]
    assert merged["step_seconds"] == [0.5, 0.3]  # a step lasts as long as its slowest rank
    assert merged["wall_seconds"] == 2.0 and merged["cpu_seconds"] == 4.0
    assert merged["peak_memory_mb"] == [100.0, 120.0] and merged["memory_start_mb"] == [50.0, 60.0]
    assert merged["losses"] == [0.0, 0.0]  # rank 0's: Trainer already averages the loss over ranks
    assert merged["example_ids"].tolist() == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14]
    assert merged["fallbacks"] == {"attention.varlen": 3}  # any rank's slower path shows in the record
    # Per step, the busiest rank's token slots over the mean rank's: 40/45 and 60/52 of 90 and 112.
    balance = merged["rank_balance"]
    assert balance["slots"] == [[40, 50], [60, 52]] and balance["real_tokens"] == [[20, 25], [30, 26]]
    assert balance["per_step"] == [pytest.approx(50 / 45, abs=1e-4), pytest.approx(60 / 56, abs=1e-4)]
    assert balance["max"] == pytest.approx(50 / 45) and balance["measure"] == "token_slots"
    assert balance["mean"] == pytest.approx((50 / 45 + 60 / 56) / 2)


def test_rank_balance_counts_a_step_a_rank_missed_as_zero():
    from smart_batching.bench.multiprocess import rank_balance

    balance = rank_balance([_rank(0, [2, 3], [20, 30], [0.1, 0.1], 1.0), _rank(1, [1], [20], [0.1], 1.0)])
    assert balance["slots"] == [[40, 40], [60, 0]]
    assert balance["per_step"] == [1.0, 2.0] and balance["max"] == 2.0
