"""The GPU check's dry run (``scripts/device_check.sh OUTDIR --dry-run``) end to end on CPU: every stage
it can run without a GPU (the wheel install into a scratch target where ``make device-bundle`` was run,
collection of the CUDA tier, the GPU benchmark's rows on a tiny model for two steps each) leaves its
records, and the summary is made of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROWS = ("hf_random", "hf_group_by_length", "trl_packing", "token_budget", "packed")


def test_device_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SB_SITE": str(tmp_path / "site"),
        "SB_HF_HOME": str(tmp_path / "hf"),
        "PYTHONPATH": str(REPO / "src"),
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "device_check.sh"), str(out), "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = {s["stage"]: s for s in map(json.loads, (out / "stages.jsonl").read_text().splitlines())}
    assert set(stages) >= {"wheels", "env", "tests", "cpu", "bench"}, stages
    # the CPU tier (collected only in the dry run) names the host CPU, its bf16 flags and its closing line
    assert stages["cpu"]["status"] == "ok", (out / "cuda_tests.log").read_text()[-3000:]
    assert "host CPU:" in stages["cpu"]["note"] and "flags:" in stages["cpu"]["note"], stages["cpu"]
    assert "collected" in stages["cpu"]["note"], stages["cpu"]
    assert "== CPU tier on the host CPU" in (out / "cuda_tests.log").read_text()
    bundle = sorted((REPO / ".device-bundle" / "wheels").glob("*.whl"))
    if bundle:
        assert stages["wheels"]["status"] == "ok", stages["wheels"]
        installed = {p.name.split("-")[0].lower() for p in (tmp_path / "site").glob("*.dist-info")}
        assert {"transformers", "trl", "datasets"} <= installed, installed
    else:
        assert stages["wheels"]["status"] == "skipped" and "no bundle" in stages["wheels"]["note"]
    assert stages["env"]["status"] == "ok", stages["env"]
    if (REPO / "tests" / "cuda").is_dir():
        assert stages["tests"]["status"] == "ok", (out / "cuda_tests.log").read_text()[-3000:]
    else:
        assert stages["tests"]["note"].startswith("no tier")
    assert stages["bench"]["status"] == "ok", (out / "gpu_bench.log").read_text()[-3000:]

    versions = json.loads((out / "env.json").read_text())
    assert versions["device"] == "cpu" and versions["transformers"] and versions["trl"]
    records = [json.loads(line) for line in (out / "gpu.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in records] == list(ROWS)
    for r in records:
        assert "error" not in r, r.get("traceback")
        assert r["model"]["name"] == "tiny" and r["precision"]["setting"] == "bf16"
        assert r["real_tokens_per_s"] > 0 and r["timed_steps"] >= 1
        assert r["segment_length_squares"] >= r["real_tokens"] > 0
        assert 0.0 < r["attention_share"] < 1.0
    by_name = {r["strategy"]: r for r in records}
    assert by_name["packed"]["padding_ratio"] == 0.0 < by_name["hf_random"]["padding_ratio"]
    assert by_name["trl_packing"]["settings"]["padding_free"] is True

    summary = (out / "summary.md").read_text()
    for heading in ("## Versions", "## Stages", "## CUDA tests", "## GPU benchmark", "Targets"):
        assert heading in summary
    table_rows = [line for line in summary.splitlines() if line.startswith("| ") and " | 1 | " in line]
    assert sorted(line.split(" | ")[1] for line in table_rows) == sorted(ROWS)
    assert len(list(out.iterdir())) <= 8  # what a device run brings back: eight files at most
