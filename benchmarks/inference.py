"""Batched inference: smart batching against fixed-size batches in input order and HF pipelines.

Workloads, each measured side by side in one run (methods interleaved over ``--repeat`` rounds, the
median kept, so load from other processes hits all of them alike):

* ``generate``, ``generate_shared_prefix``, ``generate_multi_prefix``: SmolLM2-135M-Instruct on every
  engine, identical fp32 weights (the GGUF dequantised once and saved as an HF folder for vLLM): fixed
  batches of ``model.generate``, transformers' ``generate_batch``, the library's loop, vLLM alone and
  vLLM with smart batching's order and step budget. See ``benchmarks/_generate_engines.py``. vLLM
  pins its own transformers: run it with ``make bench-inference`` (its own environment).
* ``encode``: all-MiniLM-L6-v2 mean-pooled, normalised embeddings of the SST-2 dev sentences:
  ``smart_batching`` and ``smart_batching_packed`` (:func:`smart_batching.inference.encode`) vs
  ``naive_bs{B}``, ``hf_pipeline_bs{B}`` (``pipeline("feature-extraction")`` + mean pooling) and the
  ``sentence_transformers`` anchor (``SentenceTransformer.encode(batch_size=B)``; a missing
  sentence-transformers is an error, not a skip).

With ``--json``: one record per (task, method) and line, with ``task``, ``engine``, ``strategy``
(``smart`` where smart batching planned the order, ``naive`` for fixed batches in input order) and
``items_per_s``.

Usage::

    make bench-inference                                 # table (in .venv-vllm, with vLLM)
    make bench-inference ARGS=--json                     # one JSON record per method per line
    python benchmarks/inference.py --tasks encode --repeat 5
    python benchmarks/inference.py --no-vllm --tasks generate  # without vLLM (the dev venv)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM logs to stdout by default, which would break --json; and on CPU it keeps one core for itself
# (VLLM_CPU_NUM_OF_RESERVED_CPU), which on a 2-core machine halves its threads against the others'.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import numpy as np
import torch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def gsm8k(split: str, n: int) -> list[dict[str, str]]:
    path = DATA / "gsm8k" / f"{split}.jsonl"
    if not path.is_file():
        sys.exit(f"missing {path}")
    with open(path) as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def sst2_sentences(n: int | None) -> list[str]:
    path = DATA / "sst2" / "dev.tsv"
    if not path.is_file():
        sys.exit(f"missing {path}")
    lines = path.read_text(encoding="utf-8").splitlines()[1:]  # label \t sentence, no quoting
    sentences = [line.split("\t", 1)[1] for line in lines if "\t" in line]
    return sentences[:n] if n else sentences


# --------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------


def naive_generate(
    model: Any, tok: Any, prompt_ids: list[list[int]], batch_size: int, max_new_tokens: int
) -> list[list[int]]:
    """Fixed batches of ``batch_size`` in input order, left-padded to the longest, ``model.generate``."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out: list[list[int]] = []
    for lo in range(0, len(prompt_ids), batch_size):
        rows = prompt_ids[lo : lo + batch_size]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
        with torch.inference_mode():
            gen = model.generate(
                input_ids=ids.to(model.device),
                attention_mask=mask.to(model.device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        for row in gen[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            out.append(row[:cut])
    return out


def pipeline_generate(
    model: Any, tok: Any, prompts: list[Any], batch_size: int, max_new_tokens: int
) -> list[str]:
    from transformers import pipeline

    tok.padding_side = "left"  # a decoder-only model must be left-padded (a copy of the tokenizer)
    pipe = pipeline("text-generation", model=model, tokenizer=tok, batch_size=batch_size, device=model.device)
    outs = pipe(prompts, max_new_tokens=max_new_tokens, do_sample=False, return_full_text=False)
    return [o[0]["generated_text"] for o in outs]


def naive_encode(model: Any, tok: Any, texts: list[str], batch_size: int) -> torch.Tensor:
    """Fixed batches in input order, right-padded to the longest, mean pooling, L2 normalisation."""
    outs = []
    with torch.inference_mode():
        for lo in range(0, len(texts), batch_size):
            enc = tok(
                texts[lo : lo + batch_size],
                padding=True,
                truncation=True,
                max_length=256,
                return_tensors="pt",
            )
            enc = {k: v.to(model.device) for k, v in enc.items()}
            hidden = model(**enc).last_hidden_state
            m = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            outs.append(torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).cpu())
    return torch.cat(outs)


def pipeline_encode(model: Any, tok: Any, texts: list[str], batch_size: int) -> torch.Tensor:
    from transformers import pipeline

    pipe = pipeline(
        "feature-extraction", model=model, tokenizer=tok, batch_size=batch_size, device=model.device
    )
    feats = pipe(texts, truncation=True, max_length=256)
    # Batched, the pipeline returns each text's features padded to its batch's longest: cut them.
    lens = [len(r) for r in tok(texts, truncation=True, max_length=256)["input_ids"]]
    pooled = np.stack([np.asarray(f[0])[:n].mean(0) for f, n in zip(feats, lens, strict=True)])
    return torch.nn.functional.normalize(torch.from_numpy(pooled).float(), dim=-1)


# --------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
"""``cpu`` (process CPU time, all threads) is the steadier clock on a machine shared with other jobs:
time slices lost to other processes do not count. It equals wall time on an idle machine with one
torch thread; with several threads it sums them."""


def timed(fn: Callable[[], Any], clock: str) -> tuple[float, float, Any]:
    """``(seconds on the chosen clock, wall seconds, output)`` of one call."""
    start, wall = CLOCK[clock](), time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return CLOCK[clock]() - start, time.perf_counter() - wall, out


def interleaved(methods: dict[str, Callable[[], Any]], repeat: int, clock: str) -> dict[str, dict[str, Any]]:
    """Run every method ``repeat`` times, round-robin (so load from other processes hits all alike).

    Returns, per method: ``seconds`` (median on ``clock``), ``times``, ``wall_times`` and ``out`` (the
    last output).
    """
    runs: dict[str, dict[str, Any]] = {name: {"times": [], "wall_times": []} for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            seconds, wall, runs[name]["out"] = timed(fn, clock)
            runs[name]["times"].append(seconds)
            runs[name]["wall_times"].append(wall)
            print(f"  {name}: {seconds:.2f} s ({clock}), {wall:.2f} s wall", file=sys.stderr)
    for r in runs.values():
        r["seconds"] = statistics.median(r["times"])
    return runs


def _timing(run: dict[str, Any], clock: str) -> dict[str, Any]:
    return {
        "seconds": run["seconds"],
        "clock": clock,
        "times": run["times"],
        "wall_times": run["wall_times"],
    }


def _naive_padding(ids: list[list[int]], bs: int) -> float:
    lens = np.array([len(r) for r in ids])
    slots = sum(int(lens[i : i + bs].max()) * len(lens[i : i + bs]) for i in range(0, len(lens), bs))
    return 1 - lens.sum() / slots


def bench_encode(args: argparse.Namespace) -> list[dict[str, Any]]:
    from smart_batching.data.tokenizers import alias_asset_path, load_tokenizer
    from smart_batching.inference import encode
    from smart_batching.models import load_model

    texts = sst2_sentences(args.num_texts)
    model, tok = load_model("minilm", device=args.device), load_tokenizer("minilm")
    bs = args.encode_batch_size
    budget = args.encode_max_tokens
    stats: dict[str, Any] = {}

    def smart(packed: bool) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            r = encode(
                model,
                tok,
                texts,
                max_tokens=budget,
                max_length=256,
                normalize=True,
                packed=packed,
                progress=False,
            )
            stats["packed" if packed else "padded"] = r.stats
            return r.embeddings

        return run

    methods: dict[str, Callable[[], Any]] = {
        "smart_batching": smart(False),
        "smart_batching_packed": smart(True),
        f"naive_bs{bs}": lambda: naive_encode(model, tok, texts, bs),
        f"hf_pipeline_bs{bs}": lambda: pipeline_encode(model, tok, texts, bs),
    }
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:  # the anchor is the point of the comparison: never skip it
        raise SystemExit(
            "the encode anchor needs sentence-transformers: pip install -e '.[dev]' (or make bench-inference)"
        ) from exc
    st = SentenceTransformer(str(alias_asset_path("minilm")), device=str(model.device))
    methods[f"sentence_transformers_bs{bs}"] = lambda: torch.from_numpy(
        st.encode(texts, batch_size=bs, normalize_embeddings=True, convert_to_numpy=True)
    )
    encode(model, tok, texts[:64], max_tokens=budget, progress=False)  # warm-up
    results = interleaved(methods, args.repeat, args.clock)
    ref = results["smart_batching"]["out"]
    lens = np.array([len(r) for r in tok(texts, truncation=True, max_length=256)["input_ids"]])
    records = []
    for name, run in results.items():
        out, seconds = run["out"], run["seconds"]
        if name.startswith("smart"):
            s = stats["packed" if name.endswith("packed") else "padded"]
            padding, batches = s.padding_ratio, s.num_batches
        else:  # sentence-transformers sorts by length before its fixed batches
            order = np.argsort(-lens, kind="stable") if name.startswith("sentence") else np.arange(len(lens))
            padding, batches = _naive_padding([[0] * int(n) for n in lens[order]], bs), -(-len(texts) // bs)
        records.append(
            {
                "task": "encode",
                "workload": f"sst2_dev ({len(texts)} sentences), mean pooling, normalised",
                "engine": "smart_batching"
                if name.startswith("smart")
                else "sentence_transformers"
                if name.startswith("sentence")
                else "transformers",
                "strategy": name,
                "items_per_s": len(texts) / seconds,
                "tokens_per_s": int(lens.sum()) / seconds,
                **_timing(run, args.clock),
                "batch_size": None if name.startswith("smart") else bs,
                "max_tokens": budget if name.startswith("smart") else None,
                "num_batches": batches,
                "padding_ratio": padding,
                "max_abs_diff_vs_smart": float((out.float() - ref.float()).abs().max()),
            }
        )
    return records


# --------------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------------


def render(records: list[dict[str, Any]]) -> str:
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload]
        lines.append(f"\n{rows[0]['task']}: {workload}")
        base = next((r for r in rows if r["strategy"].startswith("naive")), rows[-1])
        clock = f"{rows[0]['clock']} s"
        lines.append(f"  {'engine':<22}{'strategy':<26}{'items/s':>9}{clock:>9}{'x base':>8}  notes")
        for r in rows:
            if "same_tokens_as_reference" in r:
                hit = r.get("cache_hit_rate")
                note = (
                    f"gen tok/s {r['generated_tokens_per_s']:.0f}; same tokens as the first method "
                    f"{r['same_tokens_as_reference']:.0%}"
                    + (f"; prefix-cache hits {hit:.0%}" if hit is not None else "")
                    + (f"; step {r['step_tokens']}" if r.get("step_tokens") else "")
                )
            else:
                note = (
                    f"padding {r['padding_ratio']:.1%}; max |diff| vs smart {r['max_abs_diff_vs_smart']:.1e}"
                )
            lines.append(
                f"  {r['engine']:<22}{r['strategy']:<26}{r['items_per_s']:>9.2f}{r['seconds']:>9.2f}"
                f"{r['items_per_s'] / base['items_per_s']:>7.2f}x  {note}"
            )
        lines.append(f"  (x base: items/s relative to {base['strategy']})")
        shared = next(
            (r["shared_prefix_tokens"] for r in rows if r.get("shared_prefix_tokens") is not None), None
        )
        if shared is not None:
            lines.append(f"  (prefix tokens shared: {shared} of {rows[0]['prompt_tokens']} prompt tokens)")
    return "\n".join(lines)


def targets(records: list[dict[str, Any]], batch_size: int, encode_bs: int) -> list[str]:
    """One line per target of the issue, with the measured ratio and whether it was met."""

    def rate(task: str, strategy: str) -> float | None:
        return next(
            (r["items_per_s"] for r in records if r["task"] == task and r["strategy"] == strategy), None
        )

    def line(what: str, ratio: float, goal: float) -> str:
        return f"{what}: {ratio:.2f}x (target {goal}x) -> {'met' if ratio >= goal else 'NOT met'}"

    out = []
    goals = [
        ("generate_multi_prefix", "smart_vllm", "vllm", 1.3),
        ("generate", "smart_vllm", "vllm", 0.97),
    ]
    for task in ("generate", "generate_shared_prefix", "generate_multi_prefix"):
        goals.append((task, "smart_generate_batch", f"naive_bs{batch_size}", 2.0))
        goals.append((task, "smart_generate_batch", "smart_loop", 1.0))
    for task, ours, base, goal in goals:
        a, b = rate(task, ours), rate(task, base)
        if a and b:
            out.append(line(f"{task}: {ours} vs {base}", a / b, goal))
    naive_e = rate("encode", f"naive_bs{encode_bs}")
    st = rate("encode", f"sentence_transformers_bs{encode_bs}")
    for strategy in ("smart_batching", "smart_batching_packed"):
        ours_e = rate("encode", strategy)
        if ours_e and st:
            out.append(line(f"encode {strategy} vs sentence_transformers_bs{encode_bs}", ours_e / st, 1.0))
        if ours_e and naive_e:
            out.append(line(f"encode {strategy} vs naive_bs{encode_bs}", ours_e / naive_e, 1.5))
    return out


def main(argv: list[str] | None = None) -> None:
    from _generate_engines import TASKS, bench_generate_engines

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tasks",
        default=",".join((*TASKS, "encode")),
        help="comma-separated: " + ", ".join((*TASKS, "encode")),
    )
    p.add_argument("--num-prompts", type=int, default=32, help="GSM8K test questions (default: 32)")
    p.add_argument(
        "--multi-prompts", type=int, default=64, help="questions of generate_multi_prefix (default: 64)"
    )
    p.add_argument("--num-prefixes", type=int, default=4, help="distinct 4-shot prefixes (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--kv-cache-tokens", type=int, default=8192,
        help="KV cache of every continuous engine, in tokens (default: 8192)",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=8, help="naive generation batch size (default: 8)")
    p.add_argument(
        "--loop-tasks",
        default="generate",
        help="tasks that also run the library's own loop (default: generate)",
    )
    p.add_argument(
        "--hf-tasks",
        default=",".join(TASKS),
        help="tasks that run the transformers methods (fixed batches, generate_batch; slow on CPU); default: all",
    )
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM methods (no vLLM installed)")
    p.add_argument("--num-texts", type=int, default=None, help="SST-2 dev sentences (default: all 872)")
    p.add_argument(
        "--encode-batch-size", type=int, default=32, help="naive/pipeline/ST batch size (default: 32)"
    )
    p.add_argument(
        "--encode-max-tokens",
        type=int,
        default=None,
        help="smart token budget per encode batch (default: the library's)",
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="rounds per encode method; the median is kept (default: 3)"
    )
    p.add_argument("--generate-repeat", type=int, default=1, help="rounds per generate method (default: 1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=tuple(CLOCK),
        default="wall",
        help="wall, or cpu (process CPU time: steadier on a shared machine, use with --threads 1)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--json", action="store_true", help="print one JSON record per method per line")
    p.add_argument(
        "--from-jsonl", metavar="FILE", help="render the table of a saved --json run; measure nothing"
    )
    args = p.parse_args(argv)
    if args.from_jsonl:
        with open(args.from_jsonl) as f:
            records = [json.loads(line) for line in f if line.strip()]
        print(f"machine: {records[0]['machine']}")
        print(render(records))
        print("\ntargets:")
        for line in targets(records, args.batch_size, args.encode_batch_size):
            print(f"  {line}")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks = args.tasks.split(",")
    unknown = set(tasks) - {*TASKS, "encode"}
    if unknown:
        sys.exit(f"unknown --tasks {sorted(unknown)}; choose from {', '.join((*TASKS, 'encode'))}")
    import transformers

    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.inference import DEFAULT_MAX_TOKENS
    from smart_batching.models import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    args.encode_max_tokens = (
        args.encode_max_tokens or DEFAULT_MAX_TOKENS["cuda" if device.startswith("cuda") else "cpu"]
    )
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    try:
        import vllm

        versions += f", vllm {vllm.__version__}"
    except ImportError:
        pass
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}; {versions}"
    )
    records: list[dict[str, Any]] = []
    gen_tasks = [t for t in TASKS if t in tasks]
    if gen_tasks:
        model, tok = load_model("smollm2", device=device, dtype="float32"), load_tokenizer("smollm2")
        records += bench_generate_engines(
            args, model, tok, gsm8k, interleaved, naive_generate, _timing, gen_tasks
        )
        del model
    if "encode" in tasks:
        print("== encode ==", file=sys.stderr)
        records += bench_encode(args)
    for r in records:
        r.update(machine=machine, device=device, dtype="float32" if device == "cpu" else "auto")
    if args.json:
        for r in records:
            print(json.dumps(r), flush=True)
        return
    print(f"machine: {machine}")
    print(render(records))
    print("\ntargets:")
    for line in targets(records, args.batch_size, args.encode_batch_size):
        print(f"  {line}")


if __name__ == "__main__":
    main()
