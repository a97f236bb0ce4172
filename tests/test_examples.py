"""The examples run end to end (in-process, so the heavy imports are paid once per test session)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("strategy", ["packed", "token_budget"])
def test_accelerate_loop_sees_every_example_each_epoch_and_learns(strategy):
    summary = load_example("accelerate_loop").main(["--quick", "--strategy", strategy])
    assert summary["examples_per_epoch"] == [summary["num_examples"]] * 2
    assert np.isfinite(summary["final_loss"])
    assert summary["final_loss"] < summary["first_loss"] - 0.5


def test_trl_sft_example_trains_with_packed_batches(tmp_path):
    pytest.importorskip("trl")
    summary = load_example("trl_sft").main(
        ["--steps", "6", "--examples", "80", "--output-dir", str(tmp_path)]
    )
    assert summary["trainer"] == "SmartBatchingSFTTrainer"
    assert summary["attn_implementation"] == "smart_batching_packed"
    assert np.isfinite(summary["train_loss"])
    assert summary["mean_token_accuracy"] is not None


def test_trl_sft_example_with_token_budget(tmp_path):
    pytest.importorskip("trl")
    summary = load_example("trl_sft").main(
        ["--strategy", "token_budget", "--steps", "4", "--examples", "60", "--output-dir", str(tmp_path)]
    )
    assert summary["attn_implementation"] != "smart_batching_packed"
    assert np.isfinite(summary["train_loss"])


def test_train_throughput_benchmark_smoke(capsys):
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "train_throughput.py"
    if (
        not bench.is_file()
        or not (EXAMPLES.parents[1] / "shared" / "data" / "gsm8k" / "train.jsonl").is_file()
    ):
        pytest.skip("benchmark or GSM8K data not available")
    spec = importlib.util.spec_from_file_location("train_throughput", bench)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        records = module.main(
            [
                "--examples",
                "12",
                "--vocab",
                "4096",
                "--hidden",
                "64",
                "--layers",
                "2",
                "--strategies",
                "hf_random,packed,trl_packing,sft_packed",
                "--json",
                "--warmup",
                "0",
            ]
        )
    except Exception as exc:  # the SmolLM2/GPT-2 tokenizer packages may be missing
        if "MissingExtra" in type(exc).__name__:
            pytest.skip(str(exc))
        raise
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    # Both precision settings by default, fp32 first; each record names its own.
    assert [r["strategy"] for r in lines] == ["hf_random", "packed", "trl_packing", "sft_packed"] * 2
    assert [r["precision"]["setting"] for r in lines] == ["fp32"] * 4 + ["bf16"] * 4
    assert {(r["precision"]["autocast"], r["precision"]["checkpointing"]) for r in lines[4:]} == {
        ("bfloat16", True)
    }  # TRL's SFTConfig defaults, for HF's and our rows too
    assert all(r["real_tokens_per_s"] > 0 and np.isfinite(r["final_loss"]) for r in lines)
    assert all(r["peak_memory_mb"] > 0 for r in lines)
    assert lines[1]["padding_ratio"] == 0.0 and records[0]["ratio_vs_random"] == 1.0
    # Ratios only against the row of the same setting.
    assert records[4]["ratio_vs_random"] == 1.0
    assert records[7]["ratio_vs_trl"] == records[7]["real_tokens_per_s"] / records[6]["real_tokens_per_s"]
    # TRL's packing and ours on TRL's trainer are padding-free too, over the same examples' tokens.
    assert lines[2]["padding_ratio"] == 0.0 and lines[3]["padding_ratio"] == 0.0
