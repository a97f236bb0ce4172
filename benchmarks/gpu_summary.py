"""The markdown summary of a GPU check (``scripts/device_check.sh``) from the records it left in OUTDIR.

Reads ``env.json`` (versions), ``stages.jsonl`` (each stage's status, exit code, seconds and note),
``cuda_tests.xml`` (the CUDA tier's JUnit report) and ``gpu.jsonl`` (``benchmarks/gpu_train.py``'s
records), whichever exist, and writes ``summary.md``: versions, stages, test counts with the reason of
each failure, the benchmark table and its ratios against ``hf_random`` and ``trl_packing`` next to the
issue's targets (``packed`` >= 2x ``hf_random`` and >= 1.2x ``trl_packing`` in real tokens per second,
at no more peak memory than TRL's).

Usage::

    python benchmarks/gpu_summary.py OUTDIR
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TARGETS = {"ratio_vs_random": 2.0, "ratio_vs_trl": 1.2, "memory_vs_trl": 1.0}


def add_ratios(records: list[dict[str, Any]]) -> None:
    """``ratio_vs_random`` / ``ratio_vs_trl`` (real tokens per second) and ``memory_vs_trl`` (peak memory)
    of every measured record against ``hf_random`` / ``trl_packing`` on the same data; None where either
    is missing."""

    def measured(r: dict[str, Any]) -> bool:
        return "error" not in r and "skipped" not in r and r.get("real_tokens_per_s") is not None

    for r in records:
        for key, other_name in (("random", "hf_random"), ("trl", "trl_packing")):
            other = next(
                (
                    o
                    for o in records
                    if o["strategy"] == other_name and o["data"]["name"] == r["data"]["name"] and measured(o)
                ),
                None,
            )
            ok = other is not None and measured(r)
            r[f"ratio_vs_{key}"] = r["real_tokens_per_s"] / other["real_tokens_per_s"] if ok else None
            if key == "trl":
                peak, theirs = r.get("peak_memory_mb"), other.get("peak_memory_mb") if other else None
                r["memory_vs_trl"] = peak / theirs if ok and peak and theirs else None


def _f(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(records: list[dict[str, Any]]) -> str:
    """One markdown row per record (errors and skipped rows say why)."""
    head = (
        "| data | strategy | steps | real tok/step | padding | real tok/s | step p50 s | step p90 s | "
        "peak MiB | MFU | attention | vs hf_random | vs trl_packing | mem vs trl | attention path |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        data = r["data"]["name"]
        if "error" in r or "skipped" in r:
            why = r.get("error") or r.get("skipped")
            lines.append(
                f"| {data} | {r['strategy']} | {'error' if 'error' in r else 'skipped'}: {why[:300]} |"
            )
            continue
        per_step = r["real_tokens"] / r["timed_steps"] if r.get("timed_steps") else None
        lines.append(
            f"| {data} | {r['strategy']} | {r['timed_steps']} | {_f(per_step, ',.0f')} | "
            f"{_f(r['padding_ratio'], '.1%')} | {_f(r['real_tokens_per_s'], ',.0f')} | "
            f"{_f(r['step_time_p50_s'], '.3f')} | {_f(r['step_time_p90_s'], '.3f')} | "
            f"{_f(r.get('peak_memory_mb'), ',.0f')} | {_f(r.get('mfu'), '.1%')} | "
            f"{_f(r.get('attention_share'), '.0%')} | {_f(r.get('ratio_vs_random'), '.2f')}x | "
            f"{_f(r.get('ratio_vs_trl'), '.2f')}x | {_f(r.get('memory_vs_trl'), '.2f')}x | "
            f"{r.get('attn_implementation')}: {', '.join(list(dict.fromkeys(k[:60] for k in r.get('attention_kernels', [])))[:2])} |"
        )
    return "\n".join(lines)


def targets(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        if r["strategy"] != "packed" or "error" in r or "skipped" in r:
            continue
        checks = []
        for key, want in TARGETS.items():
            got = r.get(key)
            if key == "memory_vs_trl":
                verdict = "-" if got is None else ("met" if got <= want else "MISSED")
                checks.append(f"peak memory vs TRL {_f(got, '.2f')}x (target <= {want}x: {verdict})")
            else:
                verdict = "-" if got is None else ("met" if got >= want else "MISSED")
                checks.append(f"{key} {_f(got, '.2f')}x (target >= {want}x: {verdict})")
        out.append(f"- {r['data']['name']}: packed " + "; ".join(checks))
    return out


def junit(path: Path) -> tuple[dict[str, int], list[str]]:
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    reasons = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag: child for child in case}
        if "failure" in kinds or "error" in kinds:
            tag = "failure" if "failure" in kinds else "error"
            counts["failed" if tag == "failure" else "error"] += 1
            msg = (kinds[tag].get("message") or (kinds[tag].text or "")).strip().splitlines()
            reasons.append(f"- {tag}: `{name}`: {(msg[0] if msg else '')[:300]}")
        elif "skipped" in kinds:
            counts["skipped"] += 1
            msg = (kinds["skipped"].get("message") or "").strip().splitlines()
            reasons.append(f"- skipped: `{name}`: {(msg[0] if msg else '')[:200]}")
        else:
            counts["passed"] += 1
    return counts, reasons


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def summary(out: Path) -> str:
    lines = ["# GPU check", ""]
    env_path = out / "env.json"
    env = json.loads(env_path.read_text()) if env_path.is_file() else {}
    lines += ["## Versions", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()] or ["- env.json missing"]
    lines += ["", "## Stages", "", "| stage | status | exit | seconds | note |", "|---|---|---|---|---|"]
    for s in read_jsonl(out / "stages.jsonl"):
        lines.append(
            f"| {s.get('stage')} | {s.get('status')} | {s.get('rc', '-')} | {s.get('seconds', '-')} | "
            f"{s.get('note', '')} |"
        )
    lines += ["", "## CUDA tests", ""]
    xml = out / "cuda_tests.xml"
    if xml.is_file():
        try:
            counts, reasons = junit(xml)
            lines.append(", ".join(f"{v} {k}" for k, v in counts.items()))
            lines += ["", *reasons] if reasons else []
        except ET.ParseError as exc:
            lines.append(f"cuda_tests.xml unreadable: {exc}")
    else:
        lines.append("no JUnit report (see the stages above and cuda_tests.log)")
    records = read_jsonl(out / "gpu.jsonl")
    add_ratios(records)
    lines += ["", "## GPU benchmark", ""]
    if records:
        first = next((r for r in records if "model" in r), records[0])
        m = first.get("model", {})
        lines.append(
            f"Model {m.get('name')} ({_f(m.get('parameters'), ',')} parameters), precision "
            f"{first.get('precision_setting')}, peak {first.get('peak_tflops')} TFLOP/s; "
            f"MFU = (6 N tokens + 6 layers hidden sum(len^2)) / time / peak over real segments; "
            f"attention = profiled kernel time matching flash|attention|attn|sdpa|varlen|fmha."
        )
        lines += [
            "",
            table(records),
            "",
            "Targets (ours `packed`):",
            "",
            *(targets(records) or ["- no packed row"]),
        ]
    else:
        lines.append("no records (see gpu_bench.log)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0])
    (out / "summary.md").write_text(summary(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
