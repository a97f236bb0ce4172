"""Packed rows against the lower bound on every dataset in ../shared/data, at capacities 1024-4096.

Target: rows ≤ 1.005 × lower bound everywhere (lower bound = max(ceil(total / capacity), #examples
over capacity / 2)). Examples over the capacity are split (``overlong="split"``), so no token is lost.
Compares our ``auto`` against plain best-fit-decreasing and first-fit-decreasing on the same lengths.

    python benchmarks/packing_quality.py [--tokenizer smollm2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import smart_batching as sb
from smart_batching.data.lengths import compute_lengths

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
DATASETS = {
    "gsm8k": "gsm8k/train.jsonl",
    "lima": "lima/lima.json",
    "sgd_dialogues": "sgd_dialogues/train.jsonl.gz",
    "sst2": "sst2/train.tsv",
}
CAPACITIES = (1024, 2048, 4096)
ALGORITHMS = ("auto", "bfd", "ffd")


def measure(lengths, name: str) -> list[dict]:
    out = []
    for capacity in CAPACITIES:
        for algorithm in ALGORITHMS:
            t = time.perf_counter()
            plan = sb.plan_batches(
                lengths, "packed", capacity=capacity, algorithm=algorithm, overlong="split"
            )
            s = plan.stats()
            out.append(
                {
                    "dataset": name,
                    "strategy": f"packed[{algorithm}]",
                    "capacity": capacity,
                    "num_rows": s.num_rows,
                    "lower_bound_rows": s.lower_bound_rows,
                    "rows_over_lower_bound": s.rows_over_lower_bound,
                    "efficiency": s.efficiency,
                    "num_split": s.num_split,
                    "seconds": time.perf_counter() - t,
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="smollm2")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not DATA.exists():
        print(f"shared data not found at {DATA}", file=sys.stderr)
        return 1
    records = []
    for name, rel in DATASETS.items():
        lengths = compute_lengths(str(DATA / rel), tokenizer=args.tokenizer, progress=not args.json)
        records += measure(lengths, name)
    if args.json:
        for r in records:
            print(json.dumps(r))
        return 0
    print(f"tokenizer={args.tokenizer}; rows / lower bound (1.0000 = optimal), overlong examples split")
    print(
        f"{'dataset':<14} {'capacity':>8} "
        + " ".join(f"{a:>14}" for a in ALGORITHMS)
        + f" {'lower bound':>12}"
    )
    for name in DATASETS:
        for capacity in CAPACITIES:
            rows = {r["strategy"]: r for r in records if r["dataset"] == name and r["capacity"] == capacity}
            cells = " ".join(
                f"{rows[f'packed[{a}]']['num_rows']:>6} ({rows[f'packed[{a}]']['rows_over_lower_bound']:.4f})"
                for a in ALGORITHMS
            )
            print(f"{name:<14} {capacity:>8} {cells} {rows['packed[auto]']['lower_bound_rows']:>12}")
    worst = max(r["rows_over_lower_bound"] for r in records if r["strategy"] == "packed[auto]")
    print(f"worst auto rows / lower bound: {worst:.4f} (target ≤ 1.005)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
