"""benchmarks/grpo_train.py in quick mode: every row is present, times the same completions, and returns
TRL's log-probabilities (packed rows included), on a tiny Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]


def test_grpo_train_benchmark_quick(one_thread):
    spec = importlib.util.spec_from_file_location("grpo_train", ROOT / "benchmarks" / "grpo_train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if not bench.GSM8K.is_file():
        pytest.skip(f"{bench.GSM8K} is absent")
    records = bench.main(["--quick", "--threads", "1", "--json"])
    assert [(r["dataset"], r["strategy"]) for r in records] == [
        (s, r) for s in ("gsm8k", "gsm8k+system") for r in ("trl", "token_budget", "packed")
    ]
    for r in records:
        trl = next(t for t in records if t["dataset"] == r["dataset"] and t["strategy"] == "trl")
        assert r["completions"] == trl["completions"] == 8 and r["completions_per_s"] > 0
        assert r["max_abs_diff"] <= 1e-4, r  # the same log-probabilities as TRL's padded forward
        assert r["logps_mean"] == pytest.approx(trl["logps_mean"], abs=1e-5)
        assert r["logps_mean"] < -1.0  # real log-probabilities were compared (not zeros)
        assert r["rss_peak_mb"] > 0
    packed = {r["dataset"]: r for r in records if r["strategy"] == "packed"}
    trl = {r["dataset"]: r for r in records if r["strategy"] == "trl"}
    for name in packed:  # each prompt once per group, no padding
        assert packed[name]["model_tokens"] < trl[name]["model_tokens"]


def test_grpo_rank_balance_benchmark():
    """benchmarks/grpo_rank_balance.py: every token kept, the balanced deal no more uneven than TRL's on
    every world size, and TRL's deal of whole prompt groups uneven at all (else nothing was measured)."""
    spec = importlib.util.spec_from_file_location(
        "grpo_rank_balance", ROOT / "benchmarks" / "grpo_rank_balance.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if not bench.GSM8K.is_file():
        pytest.skip(f"{bench.GSM8K} is absent")
    records = bench.main(["--worlds", "2,4", "--steps", "20", "--json"])
    assert [r["world"] for r in records] == [2, 4]
    for r in records:
        assert r["tokens_equal"]
        assert 1.0 <= r["balanced"]["imbalance"] <= r["trl"]["imbalance"]
        assert r["balanced"]["worst_step"] <= r["trl"]["worst_step"]
        assert r["trl"]["imbalance"] > 1.01
    assert "| 2 | 32 |" in bench.table(records)
