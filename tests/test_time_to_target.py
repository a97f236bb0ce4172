"""Held-out loss during training (``eval_every``), time to target, its summary, report and plot."""

from __future__ import annotations

import math

import numpy as np
import pytest

from smart_batching.bench.curve import (
    EvalEvery,
    auto_cadence,
    default_targets,
    parse_eval_every,
    time_to_target,
)
from smart_batching.bench.summary import ratio_interval, time_to_target_rows, time_to_target_table
from smart_batching.errors import ConfigError


def _curve(loss, wall, cpu=None, tokens=None, step=None):
    n = len(loss)
    return {
        "step": step or list(range(n)),
        "tokens": tokens or [100 * i for i in range(n)],
        "examples": [8 * i for i in range(n)],
        "wall_seconds": wall,
        "cpu_seconds": cpu or wall,
        "loss": loss,
    }


def _record(strategy, seed, curve, final=None, bench="b"):
    return {
        "bench_id": bench,
        "strategy": strategy,
        "seed": seed,
        "status": "ok",
        "eval": {"loss": final if final is not None else curve["loss"][-1]},
        "eval_curve": curve,
    }


# --------------------------------------------------------------------------------------------------
# Cadence
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (5, EvalEvery(steps=5)),
        ("5", EvalEvery(steps=5)),
        ("20000tok", EvalEvery(tokens=20000)),
        ("20,000 tokens", EvalEvery(tokens=20000)),
        ("auto", EvalEvery(auto=True)),
        (None, None),
        (0, None),
        ("off", None),
    ],
)
def test_parse_eval_every(value, expected):
    assert parse_eval_every(value) == expected


@pytest.mark.parametrize("value", ["5x", "tok", -3, True, "1.5", "0tok"])
def test_parse_eval_every_refuses(value):
    with pytest.raises(ConfigError, match="eval_every"):
        parse_eval_every(value)


def test_auto_cadence_spends_a_tenth_on_evaluation():
    # 10,000 eval tokens, a forward pass is a third of a training token: every 10,000 / 0.3 tokens.
    every = auto_cadence(train_tokens=100_000, eval_tokens=10_000, num_steps=1000)
    assert every.tokens == math.ceil(10_000 / 0.3)
    assert every.steps is None
    # Never more than 16 evaluations, never more often than once a step.
    assert auto_cadence(1_000_000, 10, 1000).tokens == math.ceil(1_000_000 / 17)
    assert auto_cadence(1000, 1, 4).tokens == 250


def test_bench_config_checks_eval_every_and_target():
    from smart_batching.bench import BenchConfig

    assert BenchConfig(eval_every="20000tok").eval_every == "20000tok"
    with pytest.raises(ConfigError, match="eval_every"):
        BenchConfig(eval_every="every 5")
    with pytest.raises(ConfigError, match="nproc"):
        BenchConfig(eval_every=5, nproc=2)
    with pytest.raises(ConfigError, match="target"):
        BenchConfig(target=-1.0)


# --------------------------------------------------------------------------------------------------
# Time to target, from literal curves
# --------------------------------------------------------------------------------------------------


def test_time_to_target_first_point_at_or_below():
    curve = _curve([10.0, 8.0, 7.0, 7.5, 6.0], [0.0, 1.0, 2.0, 3.0, 4.0], cpu=[0, 2, 4, 6, 8])
    out = time_to_target(curve, 7.0)
    assert out["reached"] and out["wall_seconds"] == 2.0 and out["cpu_seconds"] == 4
    assert out["tokens"] == 200 and out["steps"] == 2 and out["reason"] is None


def test_time_to_target_never_reached_says_why():
    out = time_to_target(_curve([10.0, 8.0], [0.0, 1.0]), 7.0)
    assert not out["reached"] and out["wall_seconds"] is None
    assert "8.0000 > target 7.0000" in out["reason"]
    assert time_to_target(None, 7.0)["reason"] == "no held-out curve in the record"


def test_summary_ratios_paired_by_seed():
    records = []
    # random reaches its own final loss at its end; packed reaches it at half the time on seed 0 and a
    # quarter on seed 1; group_by_length never reaches it on seed 1.
    for seed, (packed_t, final) in enumerate([(2.0, 7.0), (1.0, 6.9)]):
        records.append(_record("random", seed, _curve([10.0, 8.0, final], [0.0, 2.0, 4.0])))
        records.append(
            _record("packed", seed, _curve([10.0, final - 0.1, final - 0.2], [0.0, packed_t, 3.0]))
        )
        gbl_final = final if seed == 0 else final + 0.5
        records.append(_record("group_by_length", seed, _curve([10.0, 9.0, gbl_final], [0.0, 2.0, 4.0])))
    assert default_targets(records) == {("b", 0): 7.0, ("b", 1): 6.9}
    rows = {r["strategy"]: r for r in time_to_target_rows(records)}
    packed = rows["packed"]["wall_seconds"]["ratio"]
    assert packed["median"] == pytest.approx(0.375) and packed["n"] == 2
    # The interval is of the geometric mean of 0.5 and 0.25 (t with 1 degree of freedom).
    logs = np.log([0.5, 0.25])
    half = 12.706 * logs.std(ddof=1) / math.sqrt(2)
    assert packed["low"] == pytest.approx(math.exp(logs.mean() - half))
    assert packed["high"] == pytest.approx(math.exp(logs.mean() + half))
    assert rows["random"]["wall_seconds"]["ratio"]["median"] == 1.0
    gbl = rows["group_by_length"]
    assert gbl["reached"] == [0] and gbl["wall_seconds"]["ratio"]["n"] == 1
    assert "never reached" in gbl["reasons"][0]
    headers, cells = time_to_target_table(list(rows.values()))
    table = dict(zip([c[0] for c in cells], cells, strict=True))
    assert table["group_by_length"][1] == "1/2"
    assert table["packed"][headers.index("x random wall")].startswith("0.38x [")
    # An explicit target replaces random's final loss.
    rows = {r["strategy"]: r for r in time_to_target_rows(records, target=9.5)}
    assert rows["group_by_length"]["reached"] == [0, 1]


def test_ratio_interval_edge_cases():
    assert ratio_interval([]) == (None, None, None)
    assert ratio_interval([0.5]) == (0.5, None, None)
    median, low, high = ratio_interval([0.5, 0.5, 0.5])
    assert median == low == high == pytest.approx(0.5)


def test_plot_time_to_quality_draws_each_strategy(tmp_path):
    pytest.importorskip("matplotlib")
    from smart_batching.bench.plots import curve_band, plot_time_to_quality

    records = [
        _record("random", 0, _curve([10.0, 8.0, 7.0], [0.0, 2.0, 4.0])),
        _record("random", 1, _curve([10.0, 8.5, 7.2], [0.0, 2.0, 5.0])),
        _record("packed", 0, _curve([10.0, 7.0, 6.8], [0.0, 1.0, 2.0])),
    ]
    grid, center, low, high = curve_band([r["eval_curve"] for r in records[:2]], points=6)
    assert grid[-1] == 5.0 and center[0] == 10.0
    # Past 4 s only seed 1's curve is left: no band there.
    assert low[-1] == high[-1] == center[-1] == pytest.approx(7.2)
    assert low[2] < center[2] < high[2]
    path = plot_time_to_quality(records, tmp_path / "ttq.png", x="cpu_seconds")
    assert path.stat().st_size > 10_000


# --------------------------------------------------------------------------------------------------
# Real runs
# --------------------------------------------------------------------------------------------------


def test_eval_causal_lm_scores_target_positions_only_with_the_same_loss():
    """The target-only LM head gives the loss the full logits give (fp32), on a real model and data."""
    import torch

    from smart_batching.bench.evaluate import eval_causal_lm
    from smart_batching.collate import PaddingCollator
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.models.zoo import load_training_model

    torch.manual_seed(0)
    bm = load_training_model("tiny-llama")
    data = prepare_training_data("default", tokenizer=bm.tokenizer, num_examples=8, eval_examples=12)
    model = bm.fresh("cpu").eval()
    fast = eval_causal_lm(model, data.eval, pad_token_id=0, batch_size=5)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(data.eval)):
            batch = PaddingCollator(0)([data.eval[i]])
            labels = batch.pop("labels")
            logits = model(**batch).logits[0, :-1].float()
            target = labels[0, 1:]
            total += float(
                torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
            )
            count += int((target != -100).sum())
    assert count > 50 and fast["num_tokens"] == count
    assert fast["loss"] == pytest.approx(total / count, rel=1e-5)


def test_bench_eval_every_curve_and_time_to_target(tmp_path):
    """A real bench, 2 epochs, evaluations every 4 steps: the curve's points (cadence and epoch ends),
    the training clock without them, the time to random's final loss in the records, and the report's
    section and plot."""
    pytest.importorskip("matplotlib")
    from smart_batching.bench import run_bench
    from smart_batching.bench.curve import epoch_losses

    records = run_bench(
        "default", model="tiny-llama", strategies=("random", "packed"), seeds=(0,), max_steps=6,
        batch_size=4, epochs=2, eval_every=4, eval_examples=8, num_generations=0, out_dir=tmp_path,
        progress=False, threads=1, lr=3e-3,
    )  # fmt: skip
    by = {r["strategy"]: r for r in records}
    assert by["random"]["num_steps"] == 12
    for r in records:
        curve = r["eval_curve"]
        n, steps = r["num_steps"], curve["step"]
        epoch_end = steps[curve["epoch"].index(1.0)]  # packed epochs may differ in steps by a batch
        assert 0 < epoch_end < n
        assert steps == sorted({0, *range(4, n, 4), epoch_end, n}), r["strategy"]
        assert curve["loss"][0] == pytest.approx(r["eval_initial"]["loss"])
        assert (
            curve["loss"][-1] == r["eval"]["loss"]
        )  # exactly: random's time to its own final loss is its end
        assert curve["tokens"][-1] == r["real_tokens"]
        assert curve["epoch"][-1] == 2.0
        assert sorted(epoch_losses(curve)) == [1, 2]
        assert all(a < b for a, b in zip(curve["wall_seconds"], curve["wall_seconds"][1:], strict=False))
        assert curve["wall_seconds"][-1] == pytest.approx(r["wall_seconds"], abs=1e-3)
        assert curve["eval_wall_seconds"] > 0 and r["eval_overhead"]["wall_ratio"] > 0
        # The model trained on after each evaluation: the loss went down from the start.
        assert curve["loss"][-1] < curve["loss"][1] < curve["loss"][0]
    assert by["random"]["time_to_target"]["reached"]
    assert by["random"]["time_to_target"]["steps"] <= by["random"]["num_steps"]
    assert by["random"]["time_to_target"]["target"] == pytest.approx(by["random"]["eval"]["loss"])
    assert by["packed"]["time_to_target"]["target"] == by["random"]["time_to_target"]["target"]
    report = (tmp_path / "report.md").read_text()
    assert "### Time to target" in report and "x random wall" in report
    assert list(tmp_path.glob("bench-*-time-to-target.png"))


def test_cli_bench_refuses_a_malformed_cadence(capsys):
    from smart_batching.cli import main

    assert main(["bench", "--eval-every", "5x", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "eval_every='5x'" in err and "'20000tok'" in err
