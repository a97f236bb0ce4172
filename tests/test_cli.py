"""The command line, run for real: `main([...])` in process and `python -m smart_batching` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from smart_batching.analysis import DEFAULT_STRATEGIES
from smart_batching.cli import main

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def lengths_npy(tmp_path):
    lengths = np.random.default_rng(0).lognormal(5, 0.6, 2000).astype(np.int64) + 1
    path = tmp_path / "lengths.npy"
    np.save(path, lengths)
    return path, lengths


def _run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_analyze_npy_table(lengths_npy, capsys):
    path, lengths = lengths_npy
    code, out, err = _run(["analyze", path], capsys)
    assert code == 0, err
    assert f"examples:   {lengths.size:,}" in out
    assert "tokenizer:  none" in out
    assert f"max {int(lengths.max()):,}" in out
    for name in DEFAULT_STRATEGIES:
        assert f"\n{name} " in out
    assert "efficiency" in out and "rel. compute" in out


def test_analyze_json_and_plot(lengths_npy, tmp_path, capsys):
    path, lengths = lengths_npy
    png = tmp_path / "plots" / "a.png"
    code, out, err = _run(
        [
            "analyze",
            path,
            "--json",
            "--batch-size",
            "4",
            "--max-tokens",
            "512",
            "--overlong",
            "split",
            "--plot",
            png,
        ],
        capsys,
    )
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["strategy"] for r in records] == list(DEFAULT_STRATEGIES)
    over = int(np.count_nonzero(lengths > 512))
    for r in records:
        assert 0 < r["efficiency"] <= 1 and r["num_batches"] > 0
        assert r["num_over_limit"] == over and r["num_split"] == over
        assert r["settings"]["batch_size"] == 4 and r["settings"]["max_tokens"] == 512
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"plot: {png}" in err  # stdout holds JSON only


def test_analyze_strategies_option(lengths_npy, capsys):
    path, _ = lengths_npy
    code, out, err = _run(["analyze", path, "--json", "--strategies", "random,packed[ffd]"], capsys)
    assert code == 0, err
    assert [json.loads(x)["strategy"] for x in out.splitlines()] == ["random", "packed[ffd]"]


def test_subprocess_module_entry(lengths_npy):
    path, _ = lengths_npy
    proc = subprocess.run(
        [sys.executable, "-m", "smart_batching", "analyze", str(path), "--json", "--seed", "3"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == len(DEFAULT_STRATEGIES)
    assert all({"strategy", "efficiency", "num_batches"} <= set(r) for r in records)


def test_subprocess_error_exit_code(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "smart_batching", "analyze", str(empty)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_import_is_light():
    code = (
        "import sys, smart_batching.cli as c; c.build_parser(); "
        "print(','.join(m for m in ('transformers', 'datasets', 'matplotlib', 'torch') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, check=True)
    assert proc.stdout.strip() == ""


def test_error_empty_file(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = _run(["analyze", empty], capsys)
    assert "empty" in _one_line_error(code, err)


def test_error_empty_npy(tmp_path, capsys):
    path = tmp_path / "none.npy"
    np.save(path, np.zeros(0, dtype=np.int64))
    code, _, err = _run(["analyze", path], capsys)
    assert "no examples" in _one_line_error(code, err)


def test_error_missing_column(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n{"text": "more words here"}\n')
    code, _, err = _run(["analyze", data, "--column", "nope"], capsys)
    assert "column='nope'" in _one_line_error(code, err)


def test_error_overlong(lengths_npy, capsys):
    path, lengths = lengths_npy
    code, _, err = _run(["analyze", path, "--max-tokens", "64", "--overlong", "error"], capsys)
    line = _one_line_error(code, err)
    assert "max_tokens=64" in line and "overlong=" in line


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--batch-size", "0"], "--batch-size"),
        (["--max-tokens", "abc"], "--max-tokens"),
        (["--overlong", "keep"], "--overlong"),
        (["--strategies", "nope"], "strategies="),
        (["--capacity", "999999"], "capacity="),
    ],
)
def test_error_bad_settings(lengths_npy, capsys, argv, needle):
    path, _ = lengths_npy
    code, _, err = _run(["analyze", path, *argv], capsys)
    assert needle in _one_line_error(code, err)


def test_error_missing_file(tmp_path, capsys):
    code, _, err = _run(["analyze", tmp_path / "missing.jsonl"], capsys)
    _one_line_error(code, err)


def test_no_command_and_help(capsys):
    assert main([]) == 2
    assert main(["--help"]) == 0
    assert "analyze" in capsys.readouterr().out


def test_analyze_default_dataset(capsys):
    pytest.importorskip("transformers")
    code, out, err = _run(["analyze", "default", "--strategies", "random,packed"], capsys)
    assert code == 0, err
    assert "default" in out and "tokenizer:  smollm2" in out
    assert "\npacked " in out


def test_demo_analysis_step(tmp_path, capsys):
    """The demo's first step through its real arguments (the training bench is tested in test_demo.py)."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    from smart_batching.cli import build_parser
    from smart_batching.cli.demo import STEPS, analysis_step

    assert [name for name, _ in STEPS] == ["analysis", "bench"]
    ctx: dict = {}
    analysis_step(build_parser().parse_args(["demo", "--out", str(tmp_path / "demo")]), ctx)
    out = capsys.readouterr().out
    assert ctx["lengths"].size > 0
    png = tmp_path / "demo" / "analysis.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"plot: {png}" in out
    for name in DEFAULT_STRATEGIES:
        assert f"\n{name} " in out


SHARED_FILES = [
    ("gsm8k/test.jsonl", 1319),
    ("lima/lima.json", 1029),
    ("sgd_dialogues/dev.jsonl.gz", 2098),
    ("sst2/dev.tsv", 872),
]


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"{SHARED_DATA} is absent")
@pytest.mark.parametrize(("rel", "n"), SHARED_FILES, ids=[r for r, _ in SHARED_FILES])
def test_shared_data(rel, n, capsys):
    pytest.importorskip("transformers")
    path = SHARED_DATA / rel
    if not path.exists():
        pytest.skip(f"{path} is absent")
    code, out, err = _run(["analyze", path, "--json"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["strategy"] for r in records] == list(DEFAULT_STRATEGIES)
    for r in records:
        assert r["num_examples"] == n
        assert 0 < r["efficiency"] <= 1
    by = {r["strategy"]: r for r in records}
    assert by["packed"]["efficiency"] > by["random"]["efficiency"]
    assert by["group_by_length"]["efficiency"] >= by["max_length"]["efficiency"]


def test_planner_speed_quick_json():
    pytest.importorskip("trl")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "planner_speed.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    names = {(r["section"], r["strategy"]) for r in records}
    for name in DEFAULT_STRATEGIES:
        assert ("speed", name) in names
    for anchor in ("hf_length_grouped_sampler", "trl_bfd"):
        assert ("anchor", anchor) in names
    assert ("fill", "lower_bound") in names and ("fill", "trl_bfd") in names
    for r in records:
        assert {"strategy", "seconds", "efficiency", "n"} <= set(r)
        assert 0 < r["efficiency"] <= 1
        assert r["seconds"] is None or r["seconds"] >= 0
    speed = [r for r in records if r["section"] == "speed"]
    assert all(r["n"] == 200_000 and r["peak_bytes_per_example"] > 0 for r in speed)


def test_analyze_long_context_defaults_stay_within_the_planner(tmp_path, capsys):
    path = tmp_path / "long.npy"
    np.save(path, np.random.default_rng(0).integers(50_000, 120_000, 30).astype(np.int64))
    code, out, err = _run(["analyze", str(path)], capsys)
    assert code == 0, err
    assert "capacity=262143 (max_tokens, capped at the packed planner's limit)" in out
