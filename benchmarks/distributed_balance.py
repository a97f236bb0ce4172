"""Per-step balance across ranks: ours against HF group_by_length, HF batch_rebalance and round-robin packing.

For each method, every rank's micro-batches for every optimizer step are computed exactly as the
method would hand them out (the samplers are instantiated per rank, no processes needed), and the cost
of a rank at a step is its real tokens. Reported per method:

- ``max_step_imbalance``: max over steps of (max rank cost / mean rank cost); 1.0 is perfect.
- ``idle_fraction``: share of rank-time spent waiting for the slowest rank at each all-reduce, if step
  time is proportional to tokens.
- ``examples_seen`` / ``examples_total``: what the method used in one epoch (duplicates padded in by
  a sampler count as seen; drops show as fewer).

    python benchmarks/distributed_balance.py [--world-size 2] [--accum 1] [--batch-size 8] [--json]

Lengths: GSM8K and LIMA from ../shared/data tokenised with the SmolLM2 tokenizer, or (when the data is
absent) a seeded lognormal sample.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

import smart_batching as sb
from smart_batching.distributed import distribute

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def load_lengths(name: str) -> np.ndarray:
    from smart_batching.lengths import compute_lengths

    path = {"gsm8k": DATA / "gsm8k" / "train.jsonl", "lima": DATA / "lima" / "lima.json"}[name]
    return compute_lengths(str(path), tokenizer="smollm2", progress=False)


def step_costs(rank_batches: list[list[np.ndarray]], lengths: np.ndarray, accum: int) -> np.ndarray:
    """(num_steps, world_size) tokens per rank per optimizer step, cut to the shortest rank."""
    steps = min(len(b) for b in rank_batches) // accum
    out = np.zeros((steps, len(rank_batches)), dtype=np.int64)
    for r, batches in enumerate(rank_batches):
        for s in range(steps):
            out[s, r] = sum(int(lengths[np.asarray(b)].sum()) for b in batches[s * accum : (s + 1) * accum])
    return out


def summarize(name: str, costs: np.ndarray, seen: int, total: int, seconds: float, world: int) -> dict:
    mean = costs.mean(axis=1)
    imb = np.divide(costs.max(axis=1), mean, out=np.ones_like(mean, dtype=float), where=mean > 0)
    busy = costs.sum()
    wall = (costs.max(axis=1) * world).sum()
    return {
        "strategy": name,
        "world_size": world,
        "num_steps": int(costs.shape[0]),
        "max_step_imbalance": float(imb.max()) if imb.size else 1.0,
        "p99_step_imbalance": float(np.quantile(imb, 0.99)) if imb.size else 1.0,
        "idle_fraction": float(1 - busy / wall) if wall else 0.0,
        "examples_seen": int(seen),
        "examples_total": int(total),
        "plan_seconds": seconds,
    }


def hf_group_by_length(lengths, world, bs, accum, seed=0):
    import torch
    from transformers.trainer_pt_utils import DistributedLengthGroupedSampler

    t = time.perf_counter()
    ranks = []
    for r in range(world):
        s = DistributedLengthGroupedSampler(
            bs, dataset=None, num_replicas=world, rank=r, lengths=lengths.tolist(), seed=seed
        )
        s.set_epoch(0)
        idx = list(iter(s))
        ranks.append([np.array(idx[i : i + bs]) for i in range(0, len(idx), bs)])
    del torch
    return ranks, time.perf_counter() - t


def hf_batch_rebalance(lengths, world, bs, accum, seed=0):
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    t = time.perf_counter()
    ranks = []
    for r in range(world):
        s = BatchRebalanceSampler(
            lengths.tolist(),
            effective_batch_size=bs * world * accum,
            dp_size=world,
            grad_accum=accum,
            seed=seed,
            rank=r,
            drop_last=False,
        )
        ranks.append([np.asarray(b) for b in iter(s)])
    return ranks, time.perf_counter() - t


def round_robin_packing(lengths, world, capacity, accum):
    """Axolotl-style: pack rows, deal them round-robin, cut every rank to the shortest count."""
    t = time.perf_counter()
    plan = sb.plan_batches(lengths, "packed", capacity=capacity, overlong="truncate")
    rows = list(plan)
    per_rank = len(rows) // world
    ranks = [rows[r::world][:per_rank] for r in range(world)]
    return ranks, time.perf_counter() - t


def ours(lengths, world, accum, strategy, **options):
    t = time.perf_counter()
    plan = sb.plan_batches(lengths, strategy, overlong="truncate", **options)
    d = distribute(plan, world, accum_steps=accum)
    secs = time.perf_counter() - t
    ranks = [
        [d.unit_examples(u) if u >= 0 else np.zeros(0, np.int64) for u in d.rank_units(r)]
        for r in range(world)
    ]
    # Truncated examples count their kept tokens only.
    kept = np.minimum(lengths, plan.overlong.limit) if plan.overlong.limit else lengths
    return ranks, secs, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--datasets", default="gsm8k,lima")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    world, accum, bs = args.world_size, args.accum, args.batch_size
    records = []
    for name in args.datasets.split(","):
        if DATA.exists():
            lengths = load_lengths(name)
        else:
            lengths = np.clip(np.random.default_rng(0).lognormal(5, 0.6, 7000), 8, 4000).astype(np.int64)
            name = f"{name}(lognormal: shared data absent)"
        n = lengths.shape[0]
        max_tokens = bs * int(math.ceil(np.quantile(lengths, 0.95) / 64) * 64)
        methods = []
        ranks, secs = hf_group_by_length(lengths, world, bs, accum)
        methods.append(("hf_group_by_length", ranks, secs, lengths))
        ranks, secs = hf_batch_rebalance(lengths, world, bs, accum)
        methods.append(("hf_batch_rebalance", ranks, secs, lengths))
        ranks, secs = round_robin_packing(lengths, world, args.capacity, accum)
        methods.append(("round_robin_packing", ranks, secs, np.minimum(lengths, args.capacity)))
        for strat, opts in (
            ("group_by_length", dict(batch_size=bs)),
            ("token_budget", dict(max_tokens=max_tokens)),
            ("packed", dict(capacity=args.capacity)),
        ):
            ranks, secs, kept = ours(lengths, world, accum, strat, **opts)
            methods.append((f"ours_{strat}", ranks, secs, kept))
        for mname, ranks, secs, kept in methods:
            costs = step_costs(ranks, kept, accum)
            steps = costs.shape[0]
            seen = sum(len(b) for r in ranks for b in r[: steps * accum])
            rec = summarize(mname, costs, seen, n, secs, world)
            rec["dataset"] = name
            rec["accum_steps"] = accum
            records.append(rec)
    if args.json:
        for rec in records:
            print(json.dumps(rec))
        return 0
    head = f"{'dataset':<8} {'method':<22} {'steps':>6} {'max imb':>8} {'p99 imb':>8} {'idle %':>7} {'seen/total':>12} {'plan s':>7}"
    print(f"world_size={world} accum={accum} batch_size={bs} capacity={args.capacity} (cost = real tokens)")
    print(head)
    print("-" * len(head))
    for r in records:
        print(
            f"{r['dataset'][:8]:<8} {r['strategy']:<22} {r['num_steps']:>6} {r['max_step_imbalance']:>8.3f} "
            f"{r['p99_step_imbalance']:>8.3f} {100 * r['idle_fraction']:>7.2f} "
            f"{r['examples_seen']:>5}/{r['examples_total']:<6} {r['plan_seconds']:>7.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
