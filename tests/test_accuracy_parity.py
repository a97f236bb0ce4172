"""``benchmarks/accuracy_parity.py --quick``: paired differences to random, one JSON line per strategy."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"


def _load():
    spec = importlib.util.spec_from_file_location(
        "accuracy_parity", ROOT / "benchmarks" / "accuracy_parity.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_study_prints_paired_differences(capsys, one_thread, tmp_path):
    if not SST2.is_dir():
        pytest.skip("../shared/data/sst2 not present")
    pytest.importorskip("transformers")
    module = _load()
    try:
        module.main(["--quick", "--json", "--strategies", "random,token_budget", "--out", str(tmp_path)])
    except Exception as exc:  # the MiniLM package may be missing
        if "MissingExtra" in type(exc).__name__:
            pytest.skip(str(exc))
        raise
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["strategy"] for r in rows] == ["random", "token_budget"]
    keys = {
        "task",
        "strategy",
        "default",
        "metric",
        "diff_to_random",
        "ci_low",
        "ci_high",
        "efficiency",
        "seeds",
    }
    assert all(keys <= set(r) for r in rows)
    random, budget = rows
    assert random["diff_to_random"] == 0.0 and random["seeds"] == budget["seeds"] == 2
    assert budget["ci_low"] <= budget["diff_to_random"] <= budget["ci_high"]
    assert budget["efficiency"] > random["efficiency"]  # a token budget pads less than random batches
    # The kept records give the same summary without training again.
    plot = tmp_path / "parity.png"
    records = str(tmp_path / "sst2" / "records.jsonl")
    again = module.main(["--json", "--from-records", records, "--plot", str(plot)])
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert again == [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [{k: r[k] for k in keys} for r in again] == [{k: r[k] for k in keys} for r in rows]


def test_flags_override_a_tasks_own_settings():
    module = _load()
    opts = module.argparse.Namespace(
        num_examples=None, eval_examples=None, batch_size=None, lr=None, max_length=None, quick=False
    )
    lima = module.task_settings("lima", opts)
    spec = module.TASKS["lima"]
    assert (lima.num_examples, lima.batch_size, lima.max_length, lima.lr) == (
        spec["num_examples"],
        spec["batch_size"],
        spec["max_length"],
        spec["lr"],
    )
    sst2 = module.task_settings("sst2", opts)
    assert (sst2.num_examples, sst2.eval_examples, sst2.batch_size, sst2.lr, sst2.max_length) == (
        2000,
        872,
        16,
        None,
        None,
    )
    opts.batch_size, opts.max_length = 4, 128
    lima = module.task_settings("lima", opts)
    assert (lima.batch_size, lima.max_length, lima.num_examples) == (4, 128, spec["num_examples"])


def test_from_records_names_the_task_by_folder(tmp_path):
    module = _load()
    path = tmp_path / "nope" / "records.jsonl"
    path.parent.mkdir()
    path.write_text("")
    with pytest.raises(SystemExit, match="should be a task name"):
        module.main(["--from-records", str(path)])


def test_t_interval():
    import numpy as np

    module = _load()
    mean, half = module.t_interval(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert mean == 3.0 and abs(half - 2.776 * np.std([1, 2, 3, 4, 5], ddof=1) / 5**0.5) < 1e-9


@pytest.mark.slow
def test_quick_trl_task_compares_trl_packing_with_apply_smart_batching(capsys, one_thread):
    """The trl task: TRL's packing=True and apply_smart_batching on that SFTTrainer, paired by seed."""
    if not (SST2.parent / "gsm8k").is_dir():
        pytest.skip("../shared/data/gsm8k not present")
    pytest.importorskip("trl")
    module = _load()
    module.main(["--quick", "--json", "--tasks", "trl", "--seeds", "2"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["strategy"] for r in rows] == ["random", "trl_packing", "sft_packed", "packed"]
    by = {r["strategy"]: r for r in rows}
    assert all(r["task"] == "trl" and r["seeds"] == 2 for r in rows)
    assert by["sft_packed"]["efficiency"] == by["trl_packing"]["efficiency"] == 1.0  # both pad nothing
    assert by["random"]["efficiency"] < 1.0
    for r in rows[1:]:
        assert r["ci_low"] <= r["diff_to_random"] <= r["ci_high"]
