"""Planning speed, fill and memory of our planners against the pip-installable anchors, in one run.

Data: ``--n`` lengths (default 10M) resampled with a fixed seed from the GSM8K train lengths (SmolLM2
tokenizer, ``../shared/data/gsm8k/train.jsonl`` from the repository root). Without that file a
lognormal sample (median 170 tokens) is used instead, and every record says so.

Three sections, all on the same lengths:

* ``speed``: each of our strategies (batch size 8, ``max_tokens`` = ``capacity`` = 4096), best of
  ``--repeat`` runs after a compile warm-up on 10k examples, with efficiency and memory: the
  tracemalloc peak of one extra run (numpy and numba allocations both go through it) and the
  bytes of the plan itself, both per example. Each is also given as a ratio to numpy's stable
  argsort of the same lengths, timed in the same run (best of ``--repeat``, before and after the
  strategies), in wall time and in process CPU time (steadier on a shared machine). Target:
  every strategy at most :data:`TARGET_OVER_ARGSORT` x argsort at 10M lengths.
* ``anchor``: transformers' ``LengthGroupedSampler`` (the same algorithm as our
  ``group_by_length``; time of ``list(iter(sampler))`` at ``--n``, the Python list of lengths built
  beforehand) and TRL's ``pack_dataset(..., strategy="bfd")`` (``trl.data_utils``, on a
  ``datasets.Dataset`` with an ``input_ids`` column). TRL's BFD is a Python loop per example (143 s
  at 10M), so it runs on the first ``--anchor-n`` lengths (default 1M), next to our ``packed`` on
  the same subset; its time scaled linearly to ``--n`` is reported as such, not as a measurement.
  TRL packs within ``Dataset.map`` batches of 1,000 examples, as ``SFTTrainer`` calls it.
* ``long_context``: ``packed`` with ``algorithm="auto"`` and ``"bfd"`` side by side at capacities 8,192
  to 262,143 on ``--long-n`` heavy-tailed lengths (lognormal, median 4,000 tokens, sigma 1; examples
  over the capacity truncated): best of ``--repeat`` seconds, rows over the lower bound, and the time
  ratio auto / bfd (target: ≤ 1 s and ≤ 1.005 x the bound at 32,768 on 50k lengths, ≤ 10x bfd at
  every capacity). ``--long-context`` runs this section alone.
* ``fill``: rows and efficiency at capacity 2048 on the real GSM8K lengths (7,473 examples): ours
  (``auto`` and plain ``bfd``), TRL's BFD (map batches of 1,000, and one batch of everything) and the
  lower bound ``max(ceil(total / capacity), #examples > capacity / 2)``.

Usage::

    python benchmarks/planner_speed.py                 # table, 10M lengths (about 2 minutes on 2 cores)
    python benchmarks/planner_speed.py --quick         # 200k lengths, TRL on 50k (well under a minute)
    python benchmarks/planner_speed.py --json          # one JSON record per line
    python benchmarks/planner_speed.py --long-context  # long-context capacities only (seconds)
    python benchmarks/planner_speed.py --also "packed[algorithm=bfd]"   # more rows, timed alike
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np

from smart_batching import packing_lower_bound, plan_batches
from smart_batching.analysis import DEFAULT_STRATEGIES, parse_strategy

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
WARMUP_N = 10_000
TARGET_OVER_ARGSORT = 0.75
"""Most time any strategy may take, as a multiple of ``np.argsort(lengths, kind="stable")`` on the
same lengths in the same run, at :data:`TARGET_N` lengths (issue 23)."""
TARGET_N = 10_000_000


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def base_lengths(seed: int) -> tuple[np.ndarray, str]:
    """GSM8K train lengths (SmolLM2), or a lognormal stand-in when the data or tokenizer is absent."""
    if GSM8K.is_file():
        try:
            from smart_batching.data.lengths import compute_lengths

            lengths = compute_lengths(GSM8K, "smollm2", progress=False)
            return lengths, f"gsm8k train ({lengths.size:,} examples, smollm2 tokenizer)"
        except Exception as exc:  # noqa: BLE001 - any failure falls back, and says why
            log(f"note: could not tokenise {GSM8K} ({exc}); using a lognormal sample instead")
    else:
        log(f"note: {GSM8K} not found; using a lognormal sample instead of GSM8K lengths")
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(170), 0.4, 7473), 16, 2048).astype(np.int64)
    return lengths, "lognormal stand-in (median 170, sigma 0.4; GSM8K data absent)"


def spec_options(name: str, batch_size: int, capacity: int, longest: int) -> tuple[str, dict[str, Any]]:
    """Spec of a row name on shared settings: every example limited to ``capacity`` tokens (truncated)."""
    base, variant = parse_strategy(name)
    opts: dict[str, Any] = {
        "random": {"batch_size": batch_size},
        "max_length": {"batch_size": batch_size},
        "group_by_length": {"batch_size": batch_size},
        "token_budget": {"max_tokens": capacity},
        "packed": {"capacity": capacity},
    }.get(base, {})
    opts["overlong"] = "truncate"
    if base in ("random", "group_by_length", "token_budget"):
        opts["max_length"] = capacity
    elif base == "max_length":  # pad to the longest example (or the limit), as a tokenizer would
        opts["max_length"] = max(1, min(capacity, longest))
    return base, {**opts, **variant}


def plan_nbytes(plan: Any) -> int:
    arrays = (
        plan.example_ids,
        plan.seg_starts,
        plan.seg_lengths,
        plan.row_offsets,
        plan.batch_offsets,
        plan.batch_width,
    )
    return sum(a.nbytes for a in arrays)


def time_ours(
    lengths: np.ndarray, name: str, batch_size: int, capacity: int, repeat: int, memory: bool
) -> dict:
    base, opts = spec_options(name, batch_size, capacity, int(lengths.max()))
    plan_batches(lengths[:WARMUP_N], base, seed=0, **opts)  # compile / load the numba kernels
    best = best_cpu = float("inf")
    plan = None
    for _ in range(repeat):
        plan = None  # free the previous plan before timing the next
        start, cpu = time.perf_counter(), time.process_time()
        plan = plan_batches(lengths, base, seed=0, **opts)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    st = plan.stats()
    rec = {
        "section": "speed",
        "strategy": name,
        "implementation": "smart_batching",
        "n": int(lengths.size),
        "seconds": best,
        "cpu_seconds": best_cpu,
        "efficiency": st.efficiency,
        "num_batches": st.num_batches,
        "num_rows": st.num_rows,
        "rows_over_lower_bound": st.rows_over_lower_bound,
        "plan_bytes_per_example": plan_nbytes(plan) / lengths.size,
        "peak_bytes_per_example": None,
    }
    del plan
    if memory:
        tracemalloc.start()
        plan = plan_batches(lengths, base, seed=0, **opts)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del plan
        rec["peak_bytes_per_example"] = peak / lengths.size
    return rec


def time_argsort(lengths: np.ndarray, repeat: int) -> tuple[float, float]:
    """Best wall and process CPU seconds of ``np.argsort(lengths, kind="stable")`` over ``repeat`` runs."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        start, c = time.perf_counter(), time.process_time()
        np.argsort(lengths, kind="stable")
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - c)
    return wall, cpu


def with_argsort_ratio(rec: dict, argsort: tuple[float, float]) -> dict:
    """``rec`` with its time as a multiple of numpy's stable argsort of the same lengths (same run)."""
    wall, cpu = argsort
    rec["argsort_seconds"], rec["argsort_cpu_seconds"] = wall, cpu
    rec["seconds_over_argsort"] = rec["seconds"] / wall
    rec["cpu_over_argsort"] = rec["cpu_seconds"] / cpu
    rec["target_over_argsort"] = TARGET_OVER_ARGSORT
    # The target is for 10M lengths: below a few million `packed` fills rows exactly and refines them.
    rec["meets_target"] = rec["seconds_over_argsort"] <= TARGET_OVER_ARGSORT if rec["n"] >= TARGET_N else None
    rec["ratio_note"] = (
        f"{rec['seconds_over_argsort']:.2f}x argsort (cpu {rec['cpu_over_argsort']:.2f}x; target "
        f"<= {TARGET_OVER_ARGSORT}x)"
    )
    return rec


def padded_efficiency(lengths: np.ndarray, order: np.ndarray, batch_size: int) -> tuple[float, int]:
    """Efficiency of fixed-size batches of consecutive ``order`` positions, each padded to its longest."""
    ordered = lengths[order]  # (n,)
    starts = np.arange(0, ordered.size, batch_size)
    widths = np.maximum.reduceat(ordered, starts)
    sizes = np.diff(np.append(starts, ordered.size))
    return float(ordered.sum() / (widths * sizes).sum()), int(starts.size)


def hf_length_grouped(lengths: np.ndarray, batch_size: int, seed: int) -> dict:
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    as_list = lengths.tolist()  # the sampler takes a Python list; building it is not timed
    sampler = LengthGroupedSampler(batch_size, lengths=as_list, generator=torch.Generator().manual_seed(seed))
    start = time.perf_counter()
    order = list(iter(sampler))
    seconds = time.perf_counter() - start
    eff, num_batches = padded_efficiency(lengths, np.asarray(order, dtype=np.int64), batch_size)
    return {
        "section": "anchor",
        "strategy": "hf_length_grouped_sampler",
        "implementation": "transformers.trainer_pt_utils.LengthGroupedSampler",
        "n": int(lengths.size),
        "seconds": seconds,
        "efficiency": eff,
        "num_batches": num_batches,
        "num_rows": int(lengths.size),
        "compared_with": "group_by_length",
    }


def input_ids_dataset(lengths: np.ndarray) -> Any:
    """A ``datasets.Dataset`` with an ``input_ids`` column of the given lengths (zeros as token ids)."""
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    return Dataset(InMemoryTable(pa.table({"input_ids": column})))


def trl_bfd(lengths: np.ndarray, capacity: int, *, one_batch: bool = False, ds: Any = None) -> dict:
    import datasets
    from trl.data_utils import pack_dataset

    datasets.disable_progress_bars()
    ds = input_ids_dataset(lengths) if ds is None else ds
    map_kwargs = {"batch_size": None} if one_batch else None
    start = time.perf_counter()
    packed = pack_dataset(ds, capacity, strategy="bfd", map_kwargs=map_kwargs)
    seconds = time.perf_counter() - start
    num_rows = len(packed)
    total = int(np.minimum(lengths, capacity).sum())  # TRL's bfd truncates examples over seq_length
    lb = packing_lower_bound(np.minimum(lengths, capacity), capacity)
    return {
        "section": "anchor",
        "strategy": "trl_bfd[one_map_batch]" if one_batch else "trl_bfd",
        "implementation": "trl.data_utils.pack_dataset(strategy='bfd')"
        + (" map batch_size=None" if one_batch else " (map batches of 1,000)"),
        "n": int(lengths.size),
        "seconds": seconds,
        "efficiency": total / (num_rows * capacity) if num_rows else 1.0,
        "num_batches": num_rows,
        "num_rows": num_rows,
        "rows_over_lower_bound": num_rows / lb if lb else None,
        "compared_with": "packed",
    }


def fill_comparison(lengths: np.ndarray, capacity: int, source: str, *, with_trl: bool = True) -> list[dict]:
    """Rows and efficiency of packing the real lengths at ``capacity``: ours, TRL, the lower bound."""
    recs = []
    clipped = np.minimum(lengths, capacity)
    lb = packing_lower_bound(clipped, capacity)
    for name in ("packed", "packed[bfd]"):
        base, opts = spec_options(name, 8, capacity, int(lengths.max()))
        plan_batches(lengths[:100], base, **opts)
        start = time.perf_counter()
        plan = plan_batches(lengths, base, seed=0, **opts)
        seconds = time.perf_counter() - start
        st = plan.stats()
        recs.append(
            {
                "strategy": name,
                "implementation": "smart_batching",
                "seconds": seconds,
                "efficiency": st.efficiency,
                "num_rows": st.num_rows,
                "num_batches": st.num_batches,
                "rows_over_lower_bound": st.rows_over_lower_bound,
            }
        )
    ds = input_ids_dataset(lengths) if with_trl else None
    for one_batch in (False, True) if with_trl else ():
        r = trl_bfd(lengths, capacity, one_batch=one_batch, ds=ds)
        recs.append(
            {
                k: r[k]
                for k in (
                    "strategy",
                    "implementation",
                    "seconds",
                    "efficiency",
                    "num_rows",
                    "num_batches",
                    "rows_over_lower_bound",
                )
            }
        )
    recs.append(
        {
            "strategy": "lower_bound",
            "implementation": "max(ceil(total / capacity), #over half)",
            "seconds": None,
            "efficiency": int(clipped.sum()) / (lb * capacity),
            "num_rows": lb,
            "num_batches": lb,
            "rows_over_lower_bound": 1.0,
        }
    )
    for r in recs:
        r.update(section="fill", n=int(lengths.size), capacity=capacity, data=source)
    return recs


LONG_CAPACITIES = (8192, 16384, 32768, 65536, 131072, 262143)


def long_context(n: int, repeat: int, seed: int) -> list[dict]:
    """``packed`` auto against bfd at long-context capacities on heavy-tailed lengths (best of ``repeat``)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(rng.lognormal(np.log(4000), 1.0, n), 1).astype(np.int64)  # (n,)
    plan_batches(lengths[:1000], "packed", capacity=8192, overlong="truncate")  # compile warm-up
    records = []
    for capacity in LONG_CAPACITIES:
        by_algorithm = {}
        for algorithm in ("auto", "bfd"):
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                plan = plan_batches(
                    lengths, "packed", capacity=capacity, algorithm=algorithm, overlong="truncate"
                )
                best = min(best, time.perf_counter() - t)
            s = plan.stats()
            by_algorithm[algorithm] = {
                "section": "long_context",
                "strategy": f"packed[{algorithm}]",
                "n": n,
                "capacity": capacity,
                "seconds": best,
                "efficiency": s.efficiency,
                "num_rows": s.num_rows,
                "lower_bound_rows": s.lower_bound_rows,
                "rows_over_lower_bound": s.rows_over_lower_bound,
                "data": "lognormal (median 4000, sigma 1), truncated at the capacity",
            }
        auto, bfd = by_algorithm["auto"], by_algorithm["bfd"]
        auto["seconds_over_bfd"] = auto["seconds"] / bfd["seconds"]
        auto["ratio_note"] = f"{auto['seconds_over_bfd']:.1f}x bfd's time"
        records += [auto, bfd]
        log(f"long context {capacity}: auto {auto['seconds']:.4f} s, bfd {bfd['seconds']:.4f} s")
    return records


def format_long_context(records: list[dict]) -> str:
    lines = [
        f"{'capacity':>8}  {'auto s':>8}  {'bfd s':>8}  {'auto/bfd':>8}  {'auto rows/LB':>12}  {'bfd rows/LB':>11}",
    ]
    for capacity in LONG_CAPACITIES:
        rec = {
            r["strategy"]: r for r in records if r["section"] == "long_context" and r["capacity"] == capacity
        }
        if not rec:
            continue
        a, b = rec["packed[auto]"], rec["packed[bfd]"]
        lines.append(
            f"{capacity:>8}  {a['seconds']:>8.4f}  {b['seconds']:>8.4f}  {a['seconds_over_bfd']:>7.1f}x"
            f"  {a['rows_over_lower_bound']:>12.5f}  {b['rows_over_lower_bound']:>11.5f}"
        )
    return "\n".join(lines)


def transparent_hugepages() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``; None off Linux).
    The planners' large arrays are allocated by numpy, which asks for huge pages: with ``never`` each
    fresh 80 MB array costs about four times as much to first touch, and ``packed`` at 10M measured
    0.69x argsort instead of 0.47x (benchmarks/RESULTS.md)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    chosen = [word.strip("[]") for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def env_info() -> dict[str, Any]:
    info = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "transparent_hugepages": transparent_hugepages(),
    }
    for mod in ("numba", "transformers", "trl", "datasets"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing anchor is reported, not fatal
            info[mod] = None
    return info


def _fmt_seconds(r: dict) -> str:
    s = r.get("seconds")
    return "-" if s is None else f"{s:.3f}"


def format_table(records: list[dict]) -> str:
    headers = [
        "section",
        "strategy",
        "n",
        "seconds",
        "efficiency",
        "rows",
        "rows/LB",
        "peak B/ex",
        "plan B/ex",
        "ratio",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r["section"],
                r["strategy"],
                f"{r['n']:,}",
                _fmt_seconds(r),
                f"{100 * r['efficiency']:.2f}%",
                f"{r['num_rows']:,}" if r.get("num_rows") is not None else "-",
                f"{r['rows_over_lower_bound']:.4f}" if r.get("rows_over_lower_bound") else "-",
                f"{r['peak_bytes_per_example']:.0f}" if r.get("peak_bytes_per_example") else "-",
                f"{r['plan_bytes_per_example']:.0f}" if r.get("plan_bytes_per_example") else "-",
                r.get("ratio_note", ""),
            ]
        )
    widths = [max(len(h), *(len(x[i]) for x in rows)) for i, h in enumerate(headers)]
    left = {0, 1, 9}

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(x) for x in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000_000, help="lengths to plan (default: 10M)")
    parser.add_argument(
        "--capacity", type=int, default=4096, help="packed capacity and token budget (default 4096)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="examples per batch, fixed-size strategies")
    parser.add_argument(
        "--anchor-n", type=int, default=1_000_000, help="lengths TRL's BFD runs on (default: 1M)"
    )
    parser.add_argument(
        "--hf-n", type=int, default=None, help="lengths LengthGroupedSampler runs on (default: --n)"
    )
    parser.add_argument("--fill-capacity", type=int, default=2048, help="capacity of the fill comparison")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per strategy (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-anchors", action="store_true", help="skip transformers and TRL")
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc run")
    parser.add_argument("--quick", action="store_true", help="n=200k, TRL on 50k, 2 repeats (CI-sized)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per line")
    parser.add_argument(
        "--long-n", type=int, default=50_000, help="heavy-tailed lengths of the long-context section (50k)"
    )
    parser.add_argument("--long-context", action="store_true", help="run the long-context section alone")
    parser.add_argument(
        "--also",
        default="",
        help='comma-separated rows timed after the default ones, e.g. "packed[algorithm=auto]"',
    )
    args = parser.parse_args(argv)
    if args.long_context:
        records = long_context(args.long_n, args.repeat, args.seed)
        env = env_info()
        if args.json:
            for r in records:
                print(json.dumps({**r, "env": env}))
            return 0
        print(
            f"packed, {args.long_n:,} heavy-tailed lengths (lognormal, median 4,000, sigma 1), best of {args.repeat}"
        )
        print(
            f"machine: {env['machine']}, {env['cpus']} CPUs (load {env['load_avg_1m']}); numba {env['numba']}"
        )
        print(format_long_context(records))
        return 0
    if args.quick:
        args.n, args.anchor_n, args.repeat = 200_000, 50_000, 2
    for name in ("n", "capacity", "batch_size", "anchor_n", "fill_capacity", "repeat"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    hf_n = min(args.hf_n or args.n, args.n)
    anchor_n = min(args.anchor_n, args.n)

    t0 = time.perf_counter()
    real, source = base_lengths(args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = rng.choice(real, size=args.n, replace=True).astype(np.int64)  # (n,)
    log(f"data: {args.n:,} lengths resampled from {source} ({time.perf_counter() - t0:.1f} s)")

    records: list[dict] = []
    ours: dict[str, dict] = {}
    before = time_argsort(lengths, args.repeat)  # numpy's stable argsort, the yardstick of this run
    also = [row.strip() for row in args.also.split(",") if row.strip()]
    for name in (*DEFAULT_STRATEGIES, *also):
        rec = time_ours(lengths, name, args.batch_size, args.capacity, args.repeat, not args.no_memory)
        rec["capacity"] = args.capacity
        ours[name] = rec
        records.append(rec)
        log(f"ours {name}: {rec['seconds']:.3f} s")
    after = time_argsort(lengths, args.repeat)
    argsort = (min(before[0], after[0]), min(before[1], after[1]))
    log(f"numpy stable argsort: {argsort[0]:.3f} s (cpu {argsort[1]:.3f} s)")
    for rec in ours.values():
        with_argsort_ratio(rec, argsort)

    if not args.no_anchors:
        hf = hf_length_grouped(lengths[:hf_n], args.batch_size, args.seed)
        mine = (
            ours["group_by_length"]
            if hf_n == args.n
            else time_ours(
                lengths[:hf_n], "group_by_length", args.batch_size, args.capacity, args.repeat, False
            )
        )
        hf["speedup_of_ours"] = hf["seconds"] / mine["seconds"]
        hf["ratio_note"] = f"{hf['speedup_of_ours']:.1f}x slower than ours (same n)"
        records.append(hf)
        log(f"hf LengthGroupedSampler: {hf['seconds']:.3f} s")

        sub = lengths[:anchor_n]
        mine = time_ours(sub, "packed", args.batch_size, args.capacity, args.repeat, False)
        mine.update(section="anchor", strategy="packed", capacity=args.capacity)
        trl = trl_bfd(sub, args.capacity)
        trl["capacity"] = args.capacity
        trl["speedup_of_ours"] = trl["seconds"] / mine["seconds"]
        trl["seconds_scaled_to_n"] = trl["seconds"] * args.n / anchor_n
        trl["ratio_note"] = f"{trl['speedup_of_ours']:.0f}x slower than ours (same n)"
        if anchor_n < args.n:
            trl["ratio_note"] += f"; ~{trl['seconds_scaled_to_n']:.0f} s at n={args.n:,} (linear estimate)"
        records += [mine, trl]
        log(f"trl bfd (n={anchor_n:,}): {trl['seconds']:.3f} s; ours packed {mine['seconds']:.3f} s")

    records += fill_comparison(real, args.fill_capacity, source, with_trl=not args.no_anchors)
    records += long_context(args.long_n, args.repeat, args.seed)

    env = env_info()
    for r in records:
        r.setdefault("capacity", args.capacity)
        r.setdefault("data", f"resampled (seed {args.seed}) from {source}")
        r["env"] = env
    if args.json:
        for r in records:
            print(json.dumps(r))
    else:
        print(
            f"data: {args.n:,} lengths resampled from {source}; batch size {args.batch_size}, "
            f"capacity {args.capacity}; fill section at capacity {args.fill_capacity} on the {real.size:,} "
            "real lengths"
        )
        print(
            f"machine: {env['machine']}, {env['cpus']} CPUs (load {env['load_avg_1m']}, transparent huge pages "
            f"{env['transparent_hugepages']}); python {env['python']}, numpy {env['numpy']}, "
            f"numba {env['numba']}, transformers {env['transformers']}, trl {env['trl']}"
        )
        print(format_table(records))
        speed = [r for r in records if r["section"] == "speed"]
        verdict = f"the target holds at {TARGET_N:,} lengths (this run: {args.n:,})"
        if args.n >= TARGET_N:
            missed = [r["strategy"] for r in speed if not r["meets_target"]]
            verdict = f"{len(speed) - len(missed)} of {len(speed)} meet it" + (
                f" (missed: {', '.join(missed)})" if missed else ""
            )
        print(
            f"speed: numpy stable argsort of the same {args.n:,} lengths took {argsort[0]:.3f} s "
            f"(cpu {argsort[1]:.3f} s); target: every strategy <= {TARGET_OVER_ARGSORT}x argsort; {verdict}"
        )
        print("long context (packed auto against bfd, side by side):")
        print(format_long_context(records))
        print(
            f"(total {time.perf_counter() - t0:.0f} s; seconds are best of {args.repeat} for ours, one run "
            "for the anchors; peak B/ex: tracemalloc peak while planning, per example)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
