"""``benchmarks/time_to_quality.py`` (summary from records) and ``benchmarks/step_weights.py``."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def _load(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(strategy, seed, losses, walls, epochs, pairs=0.5):
    return {
        "bench_id": "b", "strategy": strategy, "seed": seed, "status": "ok", "num_steps": 9,
        "eval": {"loss": losses[-1]}, "padding_ratio": 0.1, "wall_seconds": walls[-1], "cpu_seconds": walls[-1],
        "randomness": {"pair_repeat": pairs, "pair_repeat_random": 0.05},
        "eval_overhead": {"wall_ratio": 0.1}, "load_average_start": 1.0,
        "eval_curve": {"step": list(range(len(losses))), "tokens": [100 * i for i in range(len(losses))],
                       "examples": list(range(len(losses))), "wall_seconds": walls, "cpu_seconds": walls,
                       "epoch": epochs, "loss": losses},
    }  # fmt: skip


def test_summary_from_records_per_epoch_and_time_to_target(tmp_path, capsys):
    module = _load("time_to_quality")
    epochs = [0.0, 1.0, 2.0, 3.0]
    records = []
    for seed, shift in enumerate([0.0, 0.1, -0.05]):
        records.append(
            _record("random", seed, [10.0, 8.0 + shift, 7.0 + shift, 6.0 + shift], [0, 3, 6, 9], epochs)
        )
        # packed: 2 % above random at epoch 3, reaches random's final loss never; at 1 and 2, 1 % below.
        packed = [10.0, (8.0 + shift) * 0.99, (7.0 + shift) * 0.99, (6.0 + shift) * 1.02]
        records.append(_record("packed", seed, packed, [0, 1, 2, 3], epochs, pairs=0.9))
        records.append(_record("group_by_length", seed, [10.0, 6.0, 5.9, 5.8 + shift], [0, 2, 4, 6], epochs))
    folder = tmp_path / "gsm8k"
    folder.mkdir()
    (folder / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = {
        r["strategy"]: r for r in module.main(["--from-records", str(folder / "records.jsonl"), "--json"])
    }
    packed = rows["packed"]
    assert [e["epoch"] for e in packed["epochs"]] == [1, 2, 3]
    assert packed["epochs"][0]["diff_to_random"] == pytest.approx(-0.01)
    assert packed["epochs"][2]["diff_to_random"] == pytest.approx(0.02)
    assert packed["epochs"][2]["ci_low"] == pytest.approx(0.02) == packed["epochs"][2]["ci_high"]
    assert packed["reached"] == 0 and packed["ttt_wall"]["median"] is None
    assert packed["pairs_again"] == pytest.approx(0.9)
    # group_by_length reaches random's final loss at its first point after the start: 2 s of random's 9.
    gbl = rows["group_by_length"]
    assert gbl["reached"] == 3 and gbl["ttt_wall"]["median"] == pytest.approx(2 / 9)
    assert rows["random"]["ttt_wall"]["median"] == 1.0
    # Chance: random's seeds against each other (finals 6.0, 6.1, 5.95, curves falling to the end): a
    # seed reaches another's final loss where its own ends at or below it, 3 of the 6 ordered pairs.
    assert rows["random"]["chance_reach"] == {"reached": 3, "pairs": 6} and packed["chance_reach"] is None
    # A curve that dips below its end reaches more: seed 1, at 5.9 after epoch 2 and 6.1 at its end, now
    # reaches seed 0's 6.0 and seed 2's 5.95 as well: 5 of 6.
    dipped = [dict(r, eval_curve=dict(r["eval_curve"], loss=[10.0, 8.1, 5.9, 6.1])) if r["seed"] == 1 else r
              for r in records if r["strategy"] == "random"]  # fmt: skip
    assert module.chance_reach(dipped) == {"reached": 5, "pairs": 6}
    out = capsys.readouterr().out
    assert sum(line.startswith("{") for line in out.splitlines()) == 3
    table = module.format_table(list(rows.values()))
    assert "epoch 3 loss vs random" in table and "+2.00% [+2.00, +2.00]" in table
    assert "by chance in 3/6 (50%) pairs of random's seeds" in table


def test_step_weights_on_gsm8k_lengths():
    """Length-sorted steps weigh the short examples' tokens up (each step's loss is a mean over its own
    targets); random batches keep every quarter near its share; packing rows of equal tokens does too."""
    if not GSM8K.is_file():
        pytest.skip("../shared/data/gsm8k not present")
    module = _load("step_weights")
    rows = {r["strategy"]: r for r in module.main(["--data", str(GSM8K), "--num-examples", "240", "--json",
                                                   "--strategies", "random,group_by_length,packed"])}  # fmt: skip
    assert all(r["steps"] == 15 for r in rows.values())
    gbl, rnd, packed = rows["group_by_length"], rows["random"], rows["packed"]
    assert gbl["weight_by_quartile"][0] > 1.5 > 1.1 > rnd["weight_by_quartile"][0]
    assert gbl["weight_by_quartile"][3] < 0.8 < 0.9 < rnd["weight_by_quartile"][3]
    assert gbl["cv_targets"] > 3 * rnd["cv_targets"]
    assert np.max(np.abs(np.asarray(packed["weight_by_quartile"]) - 1.0)) < 0.15
    assert gbl["between_step_variance"] > 0.9 and rnd["between_step_variance"] < 0.2
    assert gbl["first_step_length"] > 1.5  # the costliest batch first
