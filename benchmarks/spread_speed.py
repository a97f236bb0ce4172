"""``packed``'s algorithms side by side on lognormal lengths: planning time, rows and row fill.

Algorithms ``auto``, ``bfd``, ``spread`` and ``spread_fit``.

Lognormal lengths (median 149 tokens, sigma 0.6, capped at the capacity), capacity 4,096, 1M and 10M
examples; each algorithm's best of 2 plans after a warm-up on 10k (compiling the kernels). Run it on
an older checkout (``PYTHONPATH=that/src``) to compare kernels::

    python benchmarks/spread_speed.py
"""

from __future__ import annotations

import time

import numpy as np

from smart_batching import plan_batches


def main() -> int:
    rng = np.random.default_rng(0)
    for n in (1_000_000, 10_000_000):
        lengths = (rng.lognormal(5, 0.6, size=n).astype(np.int64) + 1).clip(max=4096)  # (n,)
        for algorithm in ("auto", "bfd", "spread", "spread_fit"):
            plan_batches(lengths[:10_000], "packed", capacity=4096, algorithm=algorithm, seed=0)
            best, plan = float("inf"), None
            for _ in range(2):
                plan = None
                start = time.perf_counter()
                plan = plan_batches(lengths, "packed", capacity=4096, algorithm=algorithm, seed=0)
                best = min(best, time.perf_counter() - start)
            st = plan.stats()
            print(
                f"n={n:,} {algorithm}: {best:.3f} s, rows {st.num_rows:,} (lower bound "
                f"{st.lower_bound_rows:,}), row fill {100 * st.efficiency:.2f} %",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
