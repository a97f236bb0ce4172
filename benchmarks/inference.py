"""Batched inference: smart batching against fixed-size batches in input order and HF pipelines.

Three workloads, each measured side by side in one run (methods interleaved over ``--repeat`` rounds,
the median kept, so load from other processes hits all of them alike):

* ``generate``: SmolLM2-135M-Instruct (dequantised GGUF, fp32 on CPU) answering the first
  ``--num-prompts`` GSM8K test questions (chat template, greedy, ``--max-new-tokens``).
  ``smart_batching`` (:func:`smart_batching.inference.generate`, token budget ``--max-tokens``,
  continuous batching), ``smart_batching_planned`` (the same plan through ``model.generate``, each
  batch until its longest answer: the ablation of continuous batching) vs
  ``naive_bs{B}`` (fixed batches of B in input order, left padding, ``model.generate``) at
  ``--batch-size`` and at the largest fixed B whose worst batch fits the same token budget
  (``naive_same_memory``), and ``hf_pipeline_bs{B}`` (``pipeline("text-generation", batch_size=B)``).
* ``encode``: all-MiniLM-L6-v2 mean-pooled, normalised embeddings of the SST-2 dev sentences:
  ``smart_batching`` and ``smart_batching_packed`` (:func:`smart_batching.inference.encode`) vs
  ``naive_bs{B}``, ``hf_pipeline_bs{B}`` (``pipeline("feature-extraction")`` + mean pooling) and
  ``sentence_transformers`` (``SentenceTransformer.encode(batch_size=B)``, if installed).
* ``prefix``: ``--prefix-prompts`` GSM8K test questions behind the same ``--few-shot`` solved train
  examples; prefill time (``max_new_tokens=1``) with and without reusing the shared prefix's KV cache.

Usage::

    python benchmarks/inference.py                       # table
    python benchmarks/inference.py --json                # one JSON record per method per line
    python benchmarks/inference.py --tasks encode --repeat 5
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


def bench_generate(args: argparse.Namespace, model: Any, tok: Any) -> list[dict[str, Any]]:
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.inference import generate, tokenize_prompts

    questions = [r["question"] for r in gsm8k("test", args.num_prompts)]
    prompts = [[{"role": "user", "content": q}] for q in questions]
    ids = tokenize_prompts(tok, prompts)
    new = args.max_new_tokens
    budget = args.max_tokens
    same_memory_bs = max(1, budget // (max(map(len, ids)) + new))
    pipe_tok = load_tokenizer("smollm2")
    generate(model, tok, prompts[:2], max_new_tokens=2, progress=False)  # warm-up
    stats: dict[str, Any] = {}

    def smart(name: str, **kwargs: Any) -> Callable[[], list[list[int]]]:
        def run() -> list[list[int]]:
            r = generate(model, tok, prompts, max_new_tokens=new, max_tokens=budget, progress=False, **kwargs)
            stats[name] = r.stats
            return r.token_ids

        return run

    methods: dict[str, Callable[[], Any]] = {
        "smart_batching": smart("smart_batching"),
        # SmolLM2's chat template opens every prompt with the same system prompt (24 tokens).
        "smart_batching_prefix_sharing": smart(
            "smart_batching_prefix_sharing", prefix_sharing=True, min_prefix=16
        ),
        # Ablation: the same token-budget plan through model.generate, each batch until its longest.
        "smart_batching_planned": smart("smart_batching_planned", continuous_batching=False),
        f"naive_bs{args.batch_size}": lambda: naive_generate(model, tok, ids, args.batch_size, new),
    }
    if same_memory_bs != args.batch_size:
        methods[f"naive_bs{same_memory_bs}_same_memory"] = lambda: naive_generate(
            model, tok, ids, same_memory_bs, new
        )
    if not args.no_pipeline:
        methods[f"hf_pipeline_bs{args.batch_size}"] = lambda: pipeline_generate(
            model, pipe_tok, prompts, args.batch_size, new
        )
    results = interleaved(methods, args.generate_repeat, args.clock)
    ref = results["smart_batching"]["out"]
    ref_texts = tok.batch_decode(ref, skip_special_tokens=True)
    records = []
    for name, run in results.items():
        out = run["out"]
        pipe = name.startswith("hf_pipeline")
        texts = out if pipe else tok.batch_decode(out, skip_special_tokens=True)
        # The pipeline returns text only: its token count is re-tokenised (close, not exact).
        generated = sum(len(tok(t)["input_ids"]) for t in out) if pipe else sum(len(r) for r in out)
        bs = None if name in stats else int(name.split("_bs")[1].split("_")[0])
        s = stats.get(name)
        records.append(
            {
                "task": "generate",
                "workload": f"gsm8k_test[:{len(prompts)}] chat, greedy, {new} new tokens",
                "strategy": name,
                "items_per_s": len(prompts) / run["seconds"],
                "generated_tokens_per_s": generated / run["seconds"],
                **_timing(run, args.clock),
                "batch_size": bs,
                "max_tokens": budget if s else None,
                "num_batches": s.num_batches if s else -(-len(prompts) // bs),
                "padding_ratio": s.padding_ratio if s else _naive_padding(ids, bs),
                "prefill_tokens_saved": s.prefill_tokens_saved if s else 0,
                "continuous_batching": s.continuous_batching if s else False,
                "mean_decode_rows": s.mean_decode_rows if s else None,
                "prompt_tokens": sum(map(len, ids)),
                "same_text_as_smart": float(
                    np.mean([a.strip() == b.strip() for a, b in zip(texts, ref_texts, strict=True)])
                ),
            }
        )
    return records


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

        st = SentenceTransformer(str(alias_asset_path("minilm")), device=str(model.device))
        methods[f"sentence_transformers_bs{bs}"] = lambda: torch.from_numpy(
            st.encode(texts, batch_size=bs, normalize_embeddings=True, convert_to_numpy=True)
        )
    except ImportError:
        print("sentence-transformers is not installed: skipped", file=sys.stderr)
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


def bench_prefix(args: argparse.Namespace, model: Any, tok: Any) -> list[dict[str, Any]]:
    from smart_batching.inference import find_prefix_groups, generate, tokenize_prompts

    shots = gsm8k("train", args.few_shot)
    header = "Solve the grade-school math problems. End with '#### <answer>'.\n\n"
    prefix = header + "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    questions = [r["question"] for r in gsm8k("test", args.prefix_prompts)]
    prompts = [f"{prefix}Question: {q}\nAnswer:" for q in questions]
    groups = find_prefix_groups(tokenize_prompts(tok, prompts))
    shared = int(sum(len(m) * p for m, p in groups))  # prompt tokens inside a shared prefix
    generate(model, tok, prompts[:2], max_new_tokens=1, progress=False, prefix_sharing=True)  # warm-up
    stats: dict[str, Any] = {}

    def run(share: bool) -> Callable[[], list[list[int]]]:
        def fn() -> list[list[int]]:
            r = generate(
                model,
                tok,
                prompts,
                max_new_tokens=1,
                max_tokens=args.max_tokens,
                prefix_sharing=share,
                progress=False,
            )
            stats[share] = r.stats
            return r.token_ids

        return fn

    results = interleaved(
        {"prefill_no_reuse": run(False), "prefill_prefix_reuse": run(True)}, args.generate_repeat, args.clock
    )
    records = []
    for name, run_ in results.items():
        out, seconds = run_["out"], run_["seconds"]
        s = stats[name == "prefill_prefix_reuse"]
        records.append(
            {
                "task": "generate",
                "workload": f"prefix: {len(prompts)} gsm8k_test questions behind {args.few_shot} solved train examples, prefill (1 new token)",
                "strategy": name,
                "items_per_s": len(prompts) / seconds,
                **_timing(run_, args.clock),
                "prompt_tokens": s.prompt_tokens,
                "prefill_tokens": s.prefill_tokens,
                "prefill_tokens_saved": s.prefill_tokens_saved,
                # shared: prompt tokens inside a shared prefix; saved: those skipped (all but one copy).
                "shared_fraction": shared / s.prompt_tokens,
                "saved_fraction": s.prefill_tokens_saved / s.prompt_tokens,
                "num_prefix_groups": s.num_prefix_groups,
                "num_batches": s.num_batches,
                "max_tokens": args.max_tokens,
                "same_tokens_as_no_reuse": out == results["prefill_no_reuse"]["out"],
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
        base = next(
            (r for r in rows if r["strategy"].startswith("naive") and "same_memory" not in r["strategy"]),
            rows[-1],
        )
        clock = f"{rows[0]['clock']} s"
        lines.append(
            f"  {'strategy':<34}{'items/s':>9}{clock:>9}{'x base':>8}{'padding':>9}{'batches':>8}  notes"
        )
        for r in rows:
            note = ""
            if "same_text_as_smart" in r:
                note = f"same text as smart: {r['same_text_as_smart']:.0%}"
            elif "max_abs_diff_vs_smart" in r:
                note = f"max |diff| vs smart: {r['max_abs_diff_vs_smart']:.1e}"
            elif "shared_fraction" in r:
                note = (
                    f"shared {r['shared_fraction']:.1%}, saved {r['prefill_tokens_saved']}/{r['prompt_tokens']} "
                    f"prompt tokens; same tokens: {r['same_tokens_as_no_reuse']}"
                )
            if r.get("prefill_tokens_saved") and "same_text_as_smart" in r:
                note += f"; prefix tokens saved {r['prefill_tokens_saved']}/{r['prompt_tokens']}"
            padding = f"{r['padding_ratio']:.1%}" if r.get("padding_ratio") is not None else "-"
            lines.append(
                f"  {r['strategy']:<34}{r['items_per_s']:>9.2f}{r['seconds']:>9.2f}{r['items_per_s'] / base['items_per_s']:>7.2f}x"
                f"{padding:>9}{r['num_batches']:>8}  {note}"
            )
        lines.append(f"  (x base: items/s relative to {base['strategy']})")
    return "\n".join(lines)


def targets(records: list[dict[str, Any]], batch_size: int, encode_bs: int) -> list[str]:
    """One line per target of the issue, with the measured ratio and whether it was met."""

    def rate(task: str, strategy: str) -> float | None:
        for r in records:
            if r["task"] == task and r["strategy"] == strategy and not r["workload"].startswith("prefix"):
                return r["items_per_s"]
        return None

    def line(what: str, ratio: float, goal: float) -> str:
        return f"{what}: {ratio:.2f}x (target {goal}x) -> {'met' if ratio >= goal else 'NOT met'}"

    out = []
    naive = rate("generate", f"naive_bs{batch_size}")
    same = next((r for r in records if "same_memory" in r["strategy"]), None)
    for strategy in ("smart_batching", "smart_batching_prefix_sharing"):
        ours = rate("generate", strategy)
        if ours and naive:
            out.append(line(f"generate {strategy} vs naive_bs{batch_size}", ours / naive, 2))
        if ours and same:
            out.append(line(f"generate {strategy} vs {same['strategy']}", ours / same["items_per_s"], 2))
    naive_e = rate("encode", f"naive_bs{encode_bs}")
    st = rate("encode", f"sentence_transformers_bs{encode_bs}")
    for strategy in ("smart_batching", "smart_batching_packed"):
        ours = rate("encode", strategy)
        if ours and st:
            out.append(line(f"encode {strategy} vs sentence_transformers_bs{encode_bs}", ours / st, 1.0))
        if ours and naive_e:
            out.append(line(f"encode {strategy} vs naive_bs{encode_bs}", ours / naive_e, 1.5))
    pre = {r["strategy"]: r for r in records if r["workload"].startswith("prefix")}
    if len(pre) == 2:
        no, yes = pre["prefill_no_reuse"], pre["prefill_prefix_reuse"]
        cut = 1 - yes["seconds"] / no["seconds"]
        for name in ("shared_fraction", "saved_fraction"):
            frac = yes[name]
            out.append(
                f"prefix reuse cuts prefill time by >= {name.replace('_', ' ')}: cut {cut:.1%} vs "
                f"{frac:.1%} -> {'met' if cut >= frac else 'NOT met'}"
            )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--tasks", default="generate,encode,prefix", help="comma-separated: generate, encode, prefix"
    )
    p.add_argument("--num-prompts", type=int, default=64, help="GSM8K test questions to answer (default: 64)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="smart token budget per generation batch (default: the library's)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="naive and pipeline generation batch size (default: 8)"
    )
    p.add_argument("--no-pipeline", action="store_true", help="skip the text-generation pipeline (slow)")
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
        "--few-shot", type=int, default=4, help="solved train examples in the shared prefix (default: 4)"
    )
    p.add_argument(
        "--prefix-prompts", type=int, default=32, help="questions behind the shared prefix (default: 32)"
    )
    p.add_argument(
        "--repeat", type=int, default=3, help="rounds per encode method; the median is kept (default: 3)"
    )
    p.add_argument(
        "--generate-repeat", type=int, default=1, help="rounds per generate/prefix method (default: 1)"
    )
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
    tasks = set(args.tasks.split(","))

    import transformers

    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.inference import DEFAULT_MAX_TOKENS
    from smart_batching.models import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    default_budget = DEFAULT_MAX_TOKENS["cuda" if device.startswith("cuda") else "cpu"]
    args.max_tokens = args.max_tokens or default_budget
    args.encode_max_tokens = args.encode_max_tokens or default_budget
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}"
    )
    records: list[dict[str, Any]] = []
    dtype = "-"
    if tasks & {"generate", "prefix"}:
        model, tok = load_model("smollm2", device=device), load_tokenizer("smollm2")
        if "generate" in tasks:
            print("== generate ==", file=sys.stderr)
            records += bench_generate(args, model, tok)
        if "prefix" in tasks:
            print("== prefix ==", file=sys.stderr)
            records += bench_prefix(args, model, tok)
        dtype = str(model.dtype)
        del model
    if "encode" in tasks:
        print("== encode ==", file=sys.stderr)
        records += bench_encode(args)
    for r in records:
        r.update(
            machine=machine,
            device=device,
            dtype=dtype if r["task"] == "generate" else "float32" if device == "cpu" else "auto",
        )
    if args.json:
        for r in records:
            print(json.dumps(r))
        return
    print(f"machine: {machine}")
    print(render(records))
    print("\ntargets:")
    for line in targets(records, args.batch_size, args.encode_batch_size):
        print(f"  {line}")


if __name__ == "__main__":
    main()
