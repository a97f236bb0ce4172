"""``benchmarks/ttq_study.py``: the resumable study's bookkeeping. A recorded run is skipped, records are
appended whole (also by concurrent writers and after a writer killed mid-line), a run whose process
fails records nothing, and the report reads the results file."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
sys.path.insert(0, str(ROOT / "benchmarks"))

ttq_study = pytest.importorskip("ttq_study")
from test_time_to_quality import _record  # noqa: E402


def _options(tmp_path, **overrides):
    import argparse

    values = {
        "tasks": "gsm8k", "strategies": "random,packed[spread_fit]", "seed_list": [0, 1], "epochs": 1, "num_examples": 12,
        "eval_examples": 4, "eval_every": None, "humaneval_file": None, "threads": 1, "jobs": 2,
        "budget_hours": None, "device": "cpu", "trainable_layers": 2, "results": str(tmp_path / "results.jsonl"),
        "logs": str(tmp_path / "logs"),
    }  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def _study_record(run, version=None):
    study = {"task": run.task, "row": run.row, "seed": run.seed, "settings_hash": run.settings_hash}
    if version is not None:
        study["row_version"] = version
    return {"strategy": run.row, "seed": run.seed, "status": "ok", "study": study}


@pytest.mark.skipif(not GSM8K.is_file(), reason="../shared/data/gsm8k not present")
def test_recorded_runs_are_skipped_and_settings_change_the_key(tmp_path):
    opts = _options(tmp_path)
    runs, _ = ttq_study.study_runs(opts, tmp_path)
    row = "packed[spread_fit]"
    assert [(r.row, r.seed) for r in runs] == [("random", 0), (row, 0), ("random", 1), (row, 1)]
    # packed's budget is matched over the fixed seeds, whatever seeds this study has
    assert runs[1].settings["budgets"]["rows"][row] == runs[3].settings["budgets"]["rows"][row]
    results = Path(opts.results)
    # Records of another version of spread_fit (2, tried and dropped) do not count as its current runs.
    for run in runs:
        ttq_study.append_result(results, _study_record(run, version=2 if run.row == row else None))
    assert {r.key for r in runs} - ttq_study.done_keys(results) == {r.key for r in runs if r.row == row}
    for run in runs[1::2]:
        ttq_study.append_result(results, _study_record(run, version=ttq_study.ROW_VERSIONS[row]))
    before = results.read_bytes()
    assert ttq_study.run_study(opts) == 0  # everything is recorded: nothing launched
    assert results.read_bytes() == before
    # Another setting is another study: its keys are not done.
    other, _ = ttq_study.study_runs(_options(tmp_path, epochs=2), tmp_path)
    assert not {r.key for r in other} & ttq_study.done_keys(results)


def _append_many(path: str, worker: int) -> None:
    for i in range(50):
        ttq_study.append_result(Path(path), {"worker": worker, "i": i, "pad": "x" * 5000})


def test_records_are_appended_whole_by_concurrent_writers_and_after_a_killed_one(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"study": {"task": "a"}}) + "\n" + '{"study": {"task": "killed mid-li')
    # A killed writer's unfinished line is left out when reading ...
    assert len(ttq_study.read_results(path)) == 1
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(path), w)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        assert p.exitcode == 0
    # ... and the next append starts on a new line: every line but the killed one parses.
    lines = path.read_text().splitlines()
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            assert line.startswith('{"study": {"task": "killed')
    assert len(parsed) == 101
    assert sorted((r["worker"], r["i"]) for r in parsed if "worker" in r) == [
        (w, i) for w in range(2) for i in range(50)
    ]


@pytest.mark.skipif(not GSM8K.is_file(), reason="../shared/data/gsm8k not present")
def test_a_failed_run_records_nothing(tmp_path):
    # The child process fails (no such torch device): no record, its log kept, the study goes on.
    opts = _options(tmp_path, device="no-such-device", strategies="random", seed_list=[0])
    assert ttq_study.run_study(opts) == 1
    assert not Path(opts.results).exists() or ttq_study.read_results(Path(opts.results)) == []
    (log,) = Path(opts.logs).glob("*.log")
    assert "no-such-device" in log.read_text()


def test_report_reads_the_results_file_by_task_and_settings(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    epochs = [0.0, 1.0]
    for seed, shift in enumerate([0.0, 0.1]):
        for row, loss in (("random", 8.0 + shift), ("packed", (8.0 + shift) * 0.99)):
            record = _record(row, seed, [10.0, loss], [0, 3], epochs)
            record["bench_id"] = f"{row}-{seed}"  # each run its own bench process, as the study runs them
            record["study"] = {"task": "gsm8k", "row": row, "seed": seed, "settings_hash": "h1"}
            ttq_study.append_result(path, record)
    rows = {r["strategy"]: r for r in ttq_study.report([str(path)], None, as_json=True)}
    # A bare `packed` record ran `auto`, the default before issue 34 (LEGACY_ROWS).
    assert rows["packed[auto]"]["epochs"][0]["diff_to_random"] == pytest.approx(-0.01)
    assert rows["packed[auto]"]["task"] == "gsm8k" and rows["packed[auto]"]["seeds"] == 2
    # Targets across the runs' own bench ids: packed (1 % below random) reaches random's final loss.
    assert rows["random"]["reached"] == 2 and rows["packed[auto]"]["reached"] == 2
    assert rows["packed[auto]"]["ttt_wall"]["median"] == pytest.approx(1.0)
    assert sum(line.startswith("{") for line in capsys.readouterr().out.splitlines()) == 2


def test_report_keeps_the_current_row_version_and_names_the_others(tmp_path):
    path = tmp_path / "results.jsonl"
    epochs = [0.0, 1.0]
    for seed in range(2):
        for row, loss, version in (("random", 8.0, None), ("packed[spread_fit]", 7.8, None),
                                   ("packed[spread_fit]", 7.9, 2)):  # fmt: skip
            record = _record(row, seed, [10.0, loss + seed / 10], [0, 3], epochs)
            record["bench_id"] = f"{row}-{seed}-{version}"
            record["study"] = {"task": "gsm8k", "row": row, "seed": seed, "settings_hash": "h1"}
            if version:
                record["study"]["row_version"] = version
            ttq_study.append_result(path, record)
    every = {r["strategy"] for r in ttq_study.report([str(path)], None, as_json=True)}
    assert every == {"random", "packed[spread_fit]", "packed[spread_fit] v2"}
    current = {r["strategy"]: r for r in ttq_study.report([str(path)], None, as_json=True, keep={"h1"})}
    assert set(current) == {"random", "packed[spread_fit]"}
    assert current["packed[spread_fit]"]["epochs"][0]["diff_to_random"] == pytest.approx(
        -0.2 / 8.05, abs=0.01
    )


def test_a_row_without_its_algorithm_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="packed\\[auto\\]"):
        ttq_study.study_runs(_options(tmp_path, strategies="random,packed"), tmp_path)


def test_report_keeps_only_the_current_settings_when_asked(tmp_path):
    path = tmp_path / "results.jsonl"
    current = sorted(ttq_study.current_hashes())
    assert len(current) == len(ttq_study.TASKS)  # one per task
    for key, loss in ((current[0], 8.0), ("first-pass", 9.0)):
        for seed in (0, 1):
            for row in ("random", "packed"):
                record = _record(row, seed, [10.0, loss], [0, 3], [0.0, 1.0])
                record["bench_id"] = f"{row}-{seed}-{key}"
                record["study"] = {"task": "gsm8k", "row": row, "seed": seed, "settings_hash": key}
                ttq_study.append_result(path, record)
    both = ttq_study.report([str(path)], None, as_json=True)
    assert sorted({r["task"] for r in both}) == [f"gsm8k ({current[0]})", "gsm8k (first-pass)"]
    kept = ttq_study.report([str(path)], None, as_json=True, keep=set(current))
    assert {r["task"] for r in kept} == {"gsm8k"} and len(kept) == 2
