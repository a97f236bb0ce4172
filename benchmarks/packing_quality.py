"""Packed rows against the lower bound on every dataset in ../shared/data, at capacities 1024-4096.

Target for ``auto``: rows ≤ 1.005 × lower bound everywhere (lower bound = max(ceil(total / capacity), #examples
over capacity / 2)). Examples over the capacity are split (``overlong="split"``), so no token is lost.
Compares our ``auto`` (the tightest rows) and ``spread_fit`` (the default: rows of mixed lengths, which
may take more rows where few examples share one) against plain best-fit-decreasing and
first-fit-decreasing on the same lengths.

Long context: ``--long-n`` (default 50k) heavy-tailed lengths (lognormal, median 4,000 tokens, sigma 1)
at capacities 8,192 to 262,143, rows and seconds side by side (``--no-long-context`` to skip).

    python benchmarks/packing_quality.py [--tokenizer smollm2] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

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
LONG_CAPACITIES = (8192, 16384, 32768, 65536, 131072, 262143)
ALGORITHMS = ("auto", "spread_fit", "bfd", "ffd")


def heavy_tailed(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(rng.lognormal(np.log(4000), 1.0, n), 1).astype(np.int64)


def measure(lengths, name: str, capacities: tuple[int, ...] = CAPACITIES) -> list[dict]:
    out = []
    for capacity in capacities:
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
    ap.add_argument(
        "--long-n", type=int, default=50_000, help="heavy-tailed lengths at long-context capacities"
    )
    ap.add_argument("--no-long-context", action="store_true", help="skip the long-context capacities")
    args = ap.parse_args(argv)
    if not DATA.exists():
        print(f"shared data not found at {DATA}", file=sys.stderr)
        return 1
    records = []
    for name, rel in DATASETS.items():
        lengths = compute_lengths(str(DATA / rel), tokenizer=args.tokenizer, progress=not args.json)
        records += measure(lengths, name)
    tables = [(name, CAPACITIES) for name in DATASETS]
    if not args.no_long_context:
        sb.plan_batches(heavy_tailed(1000), "packed", capacity=8192, overlong="split")  # compile warm-up
        records += measure(heavy_tailed(args.long_n), "heavy_tailed", LONG_CAPACITIES)
        tables.append(("heavy_tailed", LONG_CAPACITIES))
    if args.json:
        for r in records:
            print(json.dumps(r))
        return 0
    print(f"tokenizer={args.tokenizer}; rows / lower bound (1.0000 = optimal), overlong examples split")
    print(
        f"{'dataset':<14} {'capacity':>8} "
        + " ".join(f"{a:>14}" for a in ALGORITHMS)
        + f" {'lower bound':>12} "
        + " ".join(f"{a + ' s':>8}" for a in ALGORITHMS)
    )
    for name, capacities in tables:
        for capacity in capacities:
            rows = {r["strategy"]: r for r in records if r["dataset"] == name and r["capacity"] == capacity}
            cells = " ".join(
                f"{rows[f'packed[{a}]']['num_rows']:>6} ({rows[f'packed[{a}]']['rows_over_lower_bound']:.4f})"
                for a in ALGORITHMS
            )
            secs = " ".join(f"{rows[f'packed[{a}]']['seconds']:>8.3f}" for a in ALGORITHMS)
            print(f"{name:<14} {capacity:>8} {cells} {rows['packed[auto]']['lower_bound_rows']:>12} {secs}")
    worst = max(r["rows_over_lower_bound"] for r in records if r["strategy"] == "packed[auto]")
    print(f"worst auto rows / lower bound: {worst:.4f} (target ≤ 1.005)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
