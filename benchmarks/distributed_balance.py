"""Per-step balance across ranks: ours against HF group_by_length, HF batch_rebalance and round-robin packing.

Two measurements per method, side by side in one run:

1. **Plan** (no processes): every rank's micro-batches for every optimizer step, computed exactly as
   the method would hand them out (the samplers are instantiated per rank); the cost of a rank at a
   step is its real tokens.

   - ``max_step_imbalance``: max over steps of (max rank cost / mean rank cost); 1.0 is perfect.
   - ``idle_fraction``: share of rank-time spent waiting for the slowest rank at each all-reduce, if
     step time is proportional to tokens.
   - ``examples_seen`` / ``examples_total``: what the method used in one epoch (duplicates padded in
     by a sampler count as seen; drops show as fewer).

2. **Wall** (``--no-wall`` skips it): a real 2-process (``--wall-world-size``) gloo DDP training loop on
   CPU, one thread per rank, of a tiny Llama built from its config (hidden 64, 2 layers, vocabulary
   1,024: token ids are random, only the lengths matter), on the first ``--wall-steps`` optimizer steps
   of each method's plan (the first one a warm-up, not timed). Padded methods are collated by
   :class:`~smart_batching.collate.PaddingCollator`, packing methods by
   :class:`~smart_batching.collate.PackingCollator` with exact packed attention; the loss is the token
   sum divided by the global target tokens of the step. A DDP communication hook stamps the moment a
   rank's gradients are ready, so each step splits into own compute and time waiting in the gradient
   all-reduce.

   - ``wall_s_per_step`` / ``wall_s_total``: mean and total wall time of the timed steps (rank 0).
   - ``wall_compute_s_per_step``: mean own compute (forward, backward, optimizer) over ranks and steps.
   - ``wall_idle_fraction``: measured idle, Σ (slowest rank's compute − own compute) / (ranks × Σ
     slowest compute): the share of rank-time lost to imbalance.
   - ``wall_wait_fraction``: measured time inside the all-reduce after own gradients were ready, over
     step time (idle plus the transfer itself).
   - ``wall_tokens_per_s``: real tokens of the timed steps, all ranks, per second of wall time.

3. **Scale** (``--scale``, instead of the two above): planning time and imbalance of ``distribute()``
   alone at simulated cluster sizes (world sizes 8 to 4,096, ``--scale-accum`` micro-batches per rank,
   default 4), plans only, no processes: ``--scale-n`` lengths (default 1M) of each distribution of
   ``--dist``, seeded, planned by each of ``--scale-strategies`` (default ``packed`` at ``--capacity``
   and the default strategy ``token_budget`` with a budget of ``--capacity`` padded tokens):

   - ``gsm8k``, ``lima``: resampled from the dataset (SmolLM2 tokens), at most the capacity;
   - ``near_capacity``: lognormal, median 4,000 tokens (at capacity 4,096; the median scales with it),
     sigma 0.5, those above the capacity left out: most rows hold one example, the cheapest ones alone;
   - ``bimodal``: half resampled GSM8K, half near the capacity (median 4,000, sigma 0.1, at most 4,096);
   - ``outlier``: resampled GSM8K with one example of the full capacity.

   Per (distribution, world size): ``distribute_seconds`` (wall) and ``distribute_cpu_seconds``
   (process CPU: the measure on a shared machine) of one call after a warm-up run of the same
   distribution (numba compiles once), the max and 99th-percentile step imbalance, and
   ``example_bound``: the largest ``world_size × costliest example / step cost`` over the steps, which
   no deal can beat (1.0: every step could be even). ``--target`` runs the issue's row: 10M lengths on
   1,024 ranks for all five and every strategy, each within 5 s of CPU and ``max(1.02, example_bound)``.

Usage::

    python benchmarks/distributed_balance.py --scale              # world sizes 8-4,096, 1M lengths
    python benchmarks/distributed_balance.py --scale --target     # 10M lengths on 1,024 ranks, all five
    python benchmarks/distributed_balance.py --scale --dist bimodal,near_capacity --scale-worlds 8,64
    python benchmarks/distributed_balance.py                      # both, table (about 2 min on 2 cores)
    python benchmarks/distributed_balance.py --json               # one JSON record per method per line
    python benchmarks/distributed_balance.py --no-wall --world-size 4
    python benchmarks/distributed_balance.py --wall-steps 20 --datasets gsm8k

Lengths: GSM8K and LIMA from ../shared/data tokenised with the SmolLM2 tokenizer, or (when the data is
absent) a seeded lognormal sample.

Reading the wall columns: they are a handful of steps of each plan (a different sample per method) on
a shared CPU, so a rank descheduled for a moment shows as idle; compare methods within one run. With
this tiny model (hidden 64) attention, not tokens, dominates a long packed row: 4,096 tokens in 2
examples cost about twice 4,096 tokens in 13, so token-balanced packed steps still wait; ``--cost
attention`` balances Σ length² instead. For real model widths the token cost dominates up to a few
thousand tokens per example.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

import smart_batching as sb
from smart_batching.distributed import distribute, shutdown

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
WALL_MODEL = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=16384, use_cache=False,
)  # fmt: skip


def load_lengths(name: str) -> np.ndarray:
    from smart_batching.data.lengths import compute_lengths

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
    """HF ``group_by_length`` as accelerate shards it: ``DistributedLengthGroupedSampler`` per rank."""
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


def ours(lengths, world, accum, strategy, cost="tokens", **options):
    t = time.perf_counter()
    plan = sb.plan_batches(lengths, strategy, overlong="truncate", **options)
    d = distribute(plan, world, accum_steps=accum, cost=cost)
    secs = time.perf_counter() - t
    ranks = [
        [d.micro_batch_examples(u) if u >= 0 else np.zeros(0, np.int64) for u in d.rank_micro_batches(r)]
        for r in range(world)
    ]
    # Truncated examples count their kept tokens only.
    kept = np.minimum(lengths, plan.overlong.limit) if plan.overlong.limit else lengths
    return ranks, secs, kept


def methods_for(
    lengths: np.ndarray, world: int, accum: int, bs: int, capacity: int, cost: str = "tokens"
) -> list[tuple]:
    """(name, per-rank micro-batches, plan seconds, kept lengths, packed) for every method."""
    max_tokens = bs * int(math.ceil(np.quantile(lengths, 0.95) / 64) * 64)
    out = []
    ranks, secs = hf_group_by_length(lengths, world, bs, accum)
    out.append(("hf_group_by_length", ranks, secs, lengths, False))
    ranks, secs = hf_batch_rebalance(lengths, world, bs, accum)
    out.append(("hf_batch_rebalance", ranks, secs, lengths, False))
    ranks, secs = round_robin_packing(lengths, world, capacity, accum)
    out.append(("round_robin_packing", ranks, secs, np.minimum(lengths, capacity), True))
    for strat, opts in (
        ("group_by_length", dict(batch_size=bs)),
        ("token_budget", dict(max_tokens=max_tokens)),
        ("packed", dict(capacity=capacity)),
    ):
        ranks, secs, kept = ours(lengths, world, accum, strat, cost=cost, **opts)
        out.append((f"ours_{strat}", ranks, secs, kept, strat == "packed"))
    return out


# -- wall time: a real multi-process DDP run ----------------------------------------------------------


def _token_ids(i: int, kept: dict[str, int]) -> list[int]:
    """Random token ids (seeded by the example) of the example's kept length."""
    g = np.random.default_rng(int(i))
    return g.integers(1, WALL_MODEL["vocab_size"], max(int(kept[str(i)]), 1)).tolist()


def _wall_worker(rank: int, world: int, init: str, jobs: list[dict], accum: int, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from transformers import LlamaConfig, LlamaForCausalLM

    from smart_batching.attention import enable_packed_attention
    from smart_batching.collate import PackingCollator, PaddingCollator
    from smart_batching.loss import token_loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    def stamped_allreduce(marks: list[float], bucket):
        marks.append(time.perf_counter())  # this rank's gradients (of this bucket) are ready
        return default_hooks.allreduce_hook(None, bucket)

    results = []
    for job in jobs:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**WALL_MODEL))
        enable_packed_attention(model)
        marks: list[float] = []
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(marks, stamped_allreduce)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        collate = PackingCollator(return_seq_idx=False) if job["packed"] else PaddingCollator(0)
        kept = job["lengths"]

        rows: dict[str, list[float]] = {"compute": [], "wait": [], "step": [], "tokens": []}
        for s in range(job["num_steps"]):
            micro = job["batches"][rank][s * accum : (s + 1) * accum]
            every = [i for r in job["batches"] for b in r[s * accum : (s + 1) * accum] for i in b]
            targets = max(sum(max(int(kept[str(i)]) - 1, 0) for i in every), 1)  # Σ (len - 1), all ranks
            marks.clear()
            t0 = time.perf_counter()
            for j, ids in enumerate(micro):
                with ddp.no_sync() if j < len(micro) - 1 else nullcontext():
                    batch = collate([{"input_ids": _token_ids(i, kept)} for i in (ids or [0])])
                    labels = batch.pop("labels")
                    logits = ddp(**batch).logits
                    scale = (world / targets) if ids else 0.0  # an empty slot trains nothing
                    (token_loss_sum(logits, labels) * scale).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            ready = marks[-1] if marks else t1
            rows["compute"].append((ready - t0) + (t2 - t1))
            rows["wait"].append(t1 - ready)
            rows["step"].append(t2 - t0)
            rows["tokens"].append(sum(int(kept[str(i)]) for ids in micro for i in ids))
        results.append(rows)
        del ddp  # DDP's reducer goes before the process group (see smart_batching.distributed.shutdown)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    shutdown()


def wall_run(methods: list[tuple], world: int, accum: int, num_steps: int) -> dict[str, dict]:
    """Train each method's first ``num_steps + 1`` steps on ``world`` gloo processes; wall metrics by name."""
    import torch.multiprocessing as mp

    jobs = []
    for name, ranks, _, kept, packed in methods:
        steps = min(num_steps + 1, min(len(b) for b in ranks) // accum)
        batches = [[[int(i) for i in b] for b in r[: steps * accum]] for r in ranks]
        used = {i for r in batches for b in r for i in b} | {0}
        jobs.append(
            {"name": name, "packed": packed, "num_steps": steps, "batches": batches,
             "lengths": {str(i): int(kept[i]) for i in used}}
        )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "wall.json")
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
        mp.spawn(_wall_worker, args=(world, init, jobs, accum, out), nprocs=world)
        gathered = json.loads(Path(out).read_text())
    metrics = {}
    for k, job in enumerate(jobs):
        per = {key: np.array([gathered[r][k][key] for r in range(world)])[:, 1:] for key in gathered[0][k]}
        slowest = per["compute"].max(axis=0)  # (steps,)
        total = float(per["step"][0].sum())
        metrics[job["name"]] = {
            "wall_world_size": world,
            "wall_steps": int(per["step"].shape[1]),
            "wall_s_per_step": float(per["step"][0].mean()) if total else 0.0,
            "wall_s_total": total,
            "wall_compute_s_per_step": float(per["compute"].mean()),
            "wall_idle_fraction": float((slowest - per["compute"]).sum() / max(world * slowest.sum(), 1e-12)),
            "wall_wait_fraction": float(per["wait"].sum() / max(per["step"].sum(), 1e-12)),
            "wall_tokens_per_s": float(per["tokens"].sum() / max(total, 1e-12)),
        }
    return metrics


SCALE_WORLDS = "8,16,32,64,128,256,512,1024,2048,4096"
SCALE_DISTS = ("gsm8k", "lima", "near_capacity", "bimodal", "outlier")
TARGET = dict(n=10_000_000, world_size=1024, cpu_seconds=5.0, imbalance=1.02)  # the row


def _near_capacity(rng: np.random.Generator, n: int, capacity: int, sigma: float) -> np.ndarray:
    """``n`` lognormal lengths, median 4,000/4,096 of the capacity, those above it drawn again."""
    out = np.zeros(0)
    while out.shape[0] < n:
        x = rng.lognormal(np.log(capacity * 4000 / 4096), sigma, 2 * (n - out.shape[0]) + 16)
        out = np.concatenate([out, x[x <= capacity]])
    return np.maximum(out[:n], 1).astype(np.int64)


def scale_lengths(name: str, n: int, capacity: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """``n`` lengths of one ``--dist`` distribution (see the module docstring), at most ``capacity``,
    and its label (which says so where the shared data is absent and a lognormal stands in)."""
    rng = np.random.default_rng(seed)

    def real(dataset: str) -> tuple[np.ndarray, str]:
        if DATA.exists():
            return rng.choice(load_lengths(dataset), size=n, replace=True), dataset
        stand_in = np.clip(np.random.default_rng(0).lognormal(5, 0.6, 7000), 8, 4000).astype(np.int64)
        return rng.choice(stand_in, size=n, replace=True), f"{dataset}(lognormal: shared data absent)"

    if name in ("gsm8k", "lima"):
        lengths, label = real(name)
    elif name == "near_capacity":
        lengths, label = _near_capacity(rng, n, capacity, 0.5), name
    elif name == "bimodal":
        short, _ = real("gsm8k")
        lengths = rng.permutation(
            np.concatenate([short[: n // 2], _near_capacity(rng, n - n // 2, capacity, 0.1)])
        )
        label = name
    elif name == "outlier":
        lengths, _ = real("gsm8k")
        lengths[int(rng.integers(n))] = capacity
        label = name
    else:
        raise SystemExit(f"--dist: unknown distribution {name!r}; choose from {', '.join(SCALE_DISTS)}")
    return np.minimum(lengths, capacity).astype(np.int64), label


def example_bound(d: Any) -> float:
    """Max over steps of ``world_size × costliest segment / step cost`` (at least 1.0): a rank holding
    that segment costs at least as much, so no deal of that step can be more even."""
    from smart_batching.distributed._reform import unit_max_costs
    from smart_batching.distributed.distribute import _segment_costs

    seg_cost = _segment_costs(d.base, d.cost)
    unit_max = unit_max_costs(seg_cost, d.segment_order, d.micro_batch_start, d.micro_batch_end)
    a = d.assignment.reshape(d.num_steps, -1)
    biggest = np.where(a >= 0, unit_max[np.maximum(a, 0)], 0).max(axis=1)  # (num_steps,)
    total = d.rank_cost.sum(axis=1)
    bound = np.divide(d.world_size * biggest, total, out=np.ones(d.num_steps), where=total > 0)
    return float(max(bound.max(initial=1.0), 1.0))


def _scale_plan(lengths: np.ndarray, strategy: str, capacity: int) -> sb.BatchPlan:
    """The plan the scale run distributes: ``packed`` at ``capacity``, a token budget of ``capacity``
    padded tokens, any other strategy with its defaults."""
    options = {"packed": {"capacity": capacity}, "token_budget": {"max_tokens": capacity}}.get(strategy, {})
    return sb.plan_batches(lengths, strategy, seed=0, **options)


def scale_run(
    lengths: np.ndarray,
    name: str,
    n: int,
    worlds: list[int],
    accum: int,
    capacity: int,
    strategy: str = "packed",
) -> list[dict]:
    """``distribute()`` of one plan of ``lengths`` at each world size: seconds, imbalance."""
    t = time.perf_counter()
    plan = _scale_plan(lengths, strategy, capacity)
    plan_seconds = time.perf_counter() - t
    # Warm-up: the same shape at 1/20 the size and 256 ranks at most, so every compiled step is loaded.
    warm = _scale_plan(lengths[: max(n // 20, 5000)], strategy, capacity)
    distribute(warm, min(max(worlds), 256), accum_steps=accum)
    records = []
    for world in worlds:
        t, c = time.perf_counter(), time.process_time()
        d = distribute(plan, world, accum_steps=accum)
        seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - c
        imb = d.step_imbalance
        records.append(
            {
                "section": "scale",
                "strategy": f"ours {strategy}",
                "distribution": name,
                "dataset": name,
                "n": n,
                "world_size": world,
                "accum_steps": accum,
                "capacity": capacity,
                "num_micro_batches": len(plan),
                "num_steps": d.num_steps,
                "num_empty_slots": d.num_empty_slots,
                "max_step_imbalance": float(imb.max()) if imb.size else 1.0,
                "p99_step_imbalance": float(np.quantile(imb, 0.99)) if imb.size else 1.0,
                "example_bound": example_bound(d),
                "plan_seconds": plan_seconds,
                "distribute_seconds": seconds,
                # process CPU time: on a machine shared with other work, the steadier of the two
                "distribute_cpu_seconds": cpu_seconds,
                "load_average_1min": os.getloadavg()[0],
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            }
        )
        print(
            f"{name} {strategy} world {world}: {seconds:.3f} s ({cpu_seconds:.3f} s CPU), max imbalance "
            f"{records[-1]['max_step_imbalance']:.4f}",
            file=sys.stderr,
            flush=True,
        )
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--datasets", default="gsm8k,lima")
    ap.add_argument("--cost", default="tokens", choices=("tokens", "attention", "slots"),
                    help="what ours balances (the imbalance columns always measure real tokens)")  # fmt: skip
    ap.add_argument("--wall", action=argparse.BooleanOptionalAction, default=True,
                    help="also time a real multi-process DDP run per method (--no-wall skips it)")  # fmt: skip
    ap.add_argument(
        "--wall-steps", type=int, default=8, help="timed optimizer steps per method (after 1 warm-up)"
    )
    ap.add_argument("--wall-world-size", type=int, default=2, help="processes of the wall-time run")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--scale", action="store_true", help="distribute() alone at simulated world sizes")
    ap.add_argument("--scale-n", type=int, default=1_000_000, help="resampled lengths of the scale run")
    ap.add_argument("--scale-worlds", default=SCALE_WORLDS, help="world sizes of the scale run")
    ap.add_argument("--scale-accum", type=int, default=4, help="micro-batches per rank per step (scale run)")
    ap.add_argument("--scale-strategies", default="packed,token_budget",
                    help="strategies of the scale run (packed at --capacity, token_budget of --capacity tokens)")  # fmt: skip
    ap.add_argument("--dist", default=",".join(SCALE_DISTS),
                    help=f"length distributions of the scale run: {', '.join(SCALE_DISTS)}")  # fmt: skip
    ap.add_argument("--target", action="store_true",
                    help="the scale run at the issue's target: 10M lengths on 1,024 ranks, all five")  # fmt: skip
    args = ap.parse_args(argv)
    if args.scale:
        return scale_main(args)
    world, accum, bs = args.world_size, args.accum, args.batch_size
    records = []
    for name in args.datasets.split(","):
        if DATA.exists():
            lengths = load_lengths(name)
        else:
            lengths = np.clip(np.random.default_rng(0).lognormal(5, 0.6, 7000), 8, 4000).astype(np.int64)
            name = f"{name}(lognormal: shared data absent)"
        n = lengths.shape[0]
        methods = methods_for(lengths, world, accum, bs, args.capacity, args.cost)
        wall: dict[str, dict] = {}
        if args.wall:
            same = args.wall_world_size == world
            wall_methods = (
                methods
                if same
                else methods_for(lengths, args.wall_world_size, accum, bs, args.capacity, args.cost)
            )
            wall = wall_run(wall_methods, args.wall_world_size, accum, args.wall_steps)
        for mname, ranks, secs, kept, _ in methods:
            costs = step_costs(ranks, kept, accum)
            steps = costs.shape[0]
            seen = sum(len(b) for r in ranks for b in r[: steps * accum])
            rec = summarize(mname, costs, seen, n, secs, world)
            rec.update(dataset=name, accum_steps=accum, batch_size=bs, capacity=args.capacity, cost=args.cost)
            rec.update(wall.get(mname, {}))
            rec["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
            records.append(rec)
    if args.json:
        for rec in records:
            print(json.dumps(rec))
        return 0
    print(f"world_size={world} accum={accum} batch_size={bs} capacity={args.capacity} (cost = real tokens)")
    head = (
        f"{'dataset':<8} {'method':<20} {'steps':>5} {'max imb':>8} {'p99 imb':>8} {'idle %':>7} "
        f"{'seen/total':>11} {'plan s':>7}"
    )
    if args.wall:
        head += f" | {'s/step':>7} {'total s':>8} {'compute':>8} {'idle %':>7} {'wait %':>7} {'tok/s':>7}"
        print(f"wall: {args.wall_world_size} gloo processes, {args.wall_steps} timed steps per method")
    print(head)
    print("-" * len(head))
    for r in records:
        line = (
            f"{r['dataset'][:8]:<8} {r['strategy']:<20} {r['num_steps']:>5} {r['max_step_imbalance']:>8.3f} "
            f"{r['p99_step_imbalance']:>8.3f} {100 * r['idle_fraction']:>7.2f} "
            f"{r['examples_seen']:>5}/{r['examples_total']:<5} {r['plan_seconds']:>7.3f}"
        )
        if "wall_s_total" in r:
            line += (
                f" | {r['wall_s_per_step']:>7.3f} {r['wall_s_total']:>8.2f} {r['wall_compute_s_per_step']:>8.3f} "
                f"{100 * r['wall_idle_fraction']:>7.2f} {100 * r['wall_wait_fraction']:>7.2f} "
                f"{r['wall_tokens_per_s']:>7.0f}"
            )
        print(line)
    return 0


def scale_main(args: argparse.Namespace) -> int:
    if args.target:
        args.scale_n, args.scale_worlds, args.dist = (
            TARGET["n"],
            str(TARGET["world_size"]),
            ",".join(SCALE_DISTS),
        )
    worlds = [int(w) for w in args.scale_worlds.split(",")]
    records = []
    for name in args.dist.split(","):
        lengths, label = scale_lengths(name, args.scale_n, args.capacity)
        for strategy in args.scale_strategies.split(","):
            records += scale_run(
                lengths, label, args.scale_n, worlds, args.scale_accum, args.capacity, strategy
            )
    if args.json:
        for rec in records:
            print(json.dumps(rec))
        return 0
    r0 = records[0]
    print(
        f"distribute() at simulated scale: {args.scale_n:,} lengths per distribution, packed at capacity "
        f"{args.capacity} / token budget {args.capacity}, accum {args.scale_accum}; plans only, no processes; {r0['machine']}, load "
        f"average {min(r['load_average_1min'] for r in records):.1f}-{max(r['load_average_1min'] for r in records):.1f}"
    )
    head = (
        f"{'distribution':<14} {'strategy':<13} {'world':>6} {'steps':>7} {'empty':>6} {'max imb':>8} "
        f"{'p99 imb':>8} {'bound':>7} {'wall s':>7} {'CPU s':>7} {'load':>5}"
    )
    target = args.scale_n >= TARGET["n"] and any(w >= TARGET["world_size"] for w in worlds)
    if target:
        head += "  target"
    print(head)
    print("-" * len(head))
    for r in records:
        line = (
            f"{r['distribution'][:14]:<14} {r['strategy'].removeprefix('ours ')[:13]:<13} {r['world_size']:>6} "
            f"{r['num_steps']:>7} {r['num_empty_slots']:>6} {r['max_step_imbalance']:>8.4f} "
            f"{r['p99_step_imbalance']:>8.4f} {r['example_bound']:>7.3f} {r['distribute_seconds']:>7.2f} "
            f"{r['distribute_cpu_seconds']:>7.2f} {r['load_average_1min']:>5.1f}"
        )
        if target and r["world_size"] >= TARGET["world_size"]:
            ok = r["distribute_cpu_seconds"] <= TARGET["cpu_seconds"] and r["max_step_imbalance"] <= max(
                TARGET["imbalance"], r["example_bound"]
            )
            line += "  " + ("met" if ok else "MISSED")
        print(line)
    if target:
        print(
            f"target: {TARGET['n']:,} lengths on {TARGET['world_size']:,} ranks in at most "
            f"{TARGET['cpu_seconds']:.0f} s of CPU, every step within max({TARGET['imbalance']}, bound)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
