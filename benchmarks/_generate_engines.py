"""Generation tasks of ``benchmarks/inference.py``: engines side by side on identical weights.

Workloads (SmolLM2-135M-Instruct, fp32, greedy, chat template):

* ``generate``: the first ``--num-prompts`` GSM8K test questions.
* ``generate_shared_prefix``: the same behind one 4-shot prefix (solved train examples).
* ``generate_multi_prefix``: ``--multi-prompts`` questions behind ``--num-prefixes`` distinct 4-shot
  prefixes, interleaved in input order (question i gets prefix i mod K), with a KV cache of
  ``--kv-cache-tokens`` tokens: far fewer than the requests' total, so they cannot all run at once.

Methods: ``naive_bs{B}`` (fixed batches of B in input order through ``model.generate``),
``generate_batch`` (transformers' continuous batching, input order), ``smart_generate_batch``
(:func:`smart_batching.inference.generate` on it: prefix groups together, long work first),
``smart_loop`` (the library's own continuous loop, ``engine="loop"``), ``vllm`` (vLLM's
``LLM.generate`` in input order, its defaults), ``smart_vllm_order`` (the same engine, our order) and
``smart_vllm`` (our order and our step budget, ``max_num_batched_tokens``). Every vLLM run starts from
an empty prefix cache. Both KV caches (transformers' paged one, vLLM's) hold ``--kv-cache-tokens``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

TASKS = ("generate", "generate_shared_prefix", "generate_multi_prefix")


def _prefix(shots: list[dict[str, str]]) -> str:
    head = "Solve the grade-school math problems. End with '#### <answer>'.\n\n"
    return head + "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)


def workload(task: str, args: argparse.Namespace, gsm8k: Callable[[str, int], list[dict[str, str]]]) -> Any:
    """``(description, prompts as chat messages)`` of a task."""
    if task == "generate":
        qs = [r["question"] for r in gsm8k("test", args.num_prompts)]
        return f"gsm8k_test[:{len(qs)}]", [[{"role": "user", "content": q}] for q in qs]
    if task == "generate_shared_prefix":
        prefix = _prefix(gsm8k("train", 4))
        qs = [r["question"] for r in gsm8k("test", args.num_prompts)]
        msgs = [[{"role": "user", "content": f"{prefix}Question: {q}\nAnswer:"}] for q in qs]
        return f"gsm8k_test[:{len(qs)}] behind one 4-shot prefix", msgs
    k = args.num_prefixes
    train = gsm8k("train", 4 * k)
    prefixes = [_prefix(train[4 * j : 4 * j + 4]) for j in range(k)]
    qs = [r["question"] for r in gsm8k("test", args.multi_prompts)]
    msgs = [
        [{"role": "user", "content": f"{prefixes[i % k]}Question: {q}\nAnswer:"}] for i, q in enumerate(qs)
    ]
    return f"gsm8k_test[:{len(qs)}] behind {k} interleaved 4-shot prefixes", msgs


def kv_bytes_per_token(config: Any, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache per token: keys and values of every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * dtype_bytes


def load_vllm_engines(args: argparse.Namespace, folder: str, config: Any, longest: int) -> dict[str, Any]:
    """Two ``vllm.LLM`` on the same folder and KV memory: vLLM's defaults, and our step budget."""
    from smart_batching import compat
    from smart_batching.inference._engines import load_vllm

    if not compat.vllm_available():
        sys.exit(
            "vLLM is not installed in this environment: run `make bench-inference` (it creates .venv-vllm), "
            "or pass --no-vllm"
        )
    kw = {
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 4096,
        "kv_cache_memory_bytes": args.kv_cache_tokens * kv_bytes_per_token(config),
    }
    plain = compat.vllm_llm(folder, **kw)
    smart = load_vllm(folder, max_tokens=args.kv_cache_tokens, longest_prompt=longest, **kw)
    return {"plain": plain, "smart": smart}


def bench_generate_engines(
    args: argparse.Namespace,
    model: Any,
    tok: Any,
    gsm8k: Callable[[str, int], list[dict[str, str]]],
    interleaved: Callable[..., dict[str, dict[str, Any]]],
    naive_generate: Callable[..., list[list[int]]],
    timing: Callable[..., dict[str, Any]],
    tasks: list[str],
) -> list[dict[str, Any]]:
    from smart_batching.inference import generate, tokenize_prompts
    from smart_batching.models import hf_folder

    loads = {t: workload(t, args, gsm8k) for t in tasks}
    ids = {t: tokenize_prompts(tok, p) for t, (_, p) in loads.items()}
    engines: dict[str, Any] = {}
    if not args.no_vllm:
        longest = max(max(map(len, v)) for v in ids.values())
        engines = load_vllm_engines(args, hf_folder("smollm2"), model.config, longest)
    generate(
        model, tok, ids["generate" if "generate" in ids else tasks[0]][:2], max_new_tokens=2, progress=False
    )
    records: list[dict[str, Any]] = []
    for task in tasks:
        records += _bench_task(
            task, args, model, tok, loads[task][0], ids[task], engines, interleaved, naive_generate, timing
        )
    return records


def _bench_task(
    task: str,
    args: argparse.Namespace,
    model: Any,
    tok: Any,
    desc: str,
    prompt_ids: list[list[int]],
    engines: dict[str, Any],
    interleaved: Callable[..., dict[str, dict[str, Any]]],
    naive_generate: Callable[..., list[list[int]]],
    timing: Callable[..., dict[str, Any]],
) -> list[dict[str, Any]]:
    from smart_batching import compat
    from smart_batching.inference import generate

    new, budget, bs = args.max_new_tokens, args.kv_cache_tokens, args.batch_size
    print(f"== {task} ==", file=sys.stderr)
    stats: dict[str, Any] = {}
    records = []

    def ours(name: str, target: Any = None, **kw: Any) -> Callable[[], list[list[int]]]:
        def run() -> list[list[int]]:
            if target is not None:
                compat.vllm_reset_prefix_cache(target)
            r = generate(
                model if target is None else target, tok, prompt_ids, max_new_tokens=new,
                max_tokens=budget, progress=False, **kw,
            )  # fmt: skip
            stats[name] = r.stats
            return r.token_ids

        return run

    methods: dict[str, tuple[str, Callable[[], Any]]] = {}
    if task in args.hf_tasks.split(","):  # the slow ones on CPU
        methods[f"naive_bs{bs}"] = ("transformers", lambda: naive_generate(model, tok, prompt_ids, bs, new))
        methods["generate_batch"] = (
            "transformers",
            ours("generate_batch", engine="transformers", order="input"),
        )
        methods["smart_generate_batch"] = (
            "transformers",
            ours("smart_generate_batch", engine="transformers"),
        )
    if task in args.loop_tasks.split(","):
        methods["smart_loop"] = ("smart_batching", ours("smart_loop", engine="loop"))
    if engines:
        methods["vllm"] = ("vllm", ours("vllm", engines["plain"], order="input"))
        methods["smart_vllm_order"] = ("vllm", ours("smart_vllm_order", engines["plain"]))
        methods["smart_vllm"] = ("vllm", ours("smart_vllm", engines["smart"]))
    results = interleaved({k: fn for k, (_, fn) in methods.items()}, args.generate_repeat, args.clock)
    ref = next(iter(results.values()))["out"]
    for name, run in results.items():
        out, s = run["out"], stats.get(name)
        records.append(
            {
                "task": task,
                "workload": f"{desc}, chat, greedy, {new} new tokens",
                "engine": methods[name][0],
                "strategy": name,
                "items_per_s": len(prompt_ids) / run["seconds"],
                "generated_tokens_per_s": sum(map(len, out)) / run["seconds"],
                **timing(run, args.clock),
                "num_prompts": len(prompt_ids),
                "prompt_tokens": sum(map(len, prompt_ids)),
                "generated_tokens": sum(map(len, out)),
                "kv_cache_tokens": budget,
                "batch_size": bs if name.startswith("naive") else None,
                "order": s.order if s else "input",
                "shared_prefix_tokens": s.shared_prefix_tokens if s else None,
                "cache_hit_rate": s.cache_hit_rate if s else None,
                "step_tokens": s.step_tokens if s else None,
                "same_tokens_as_reference": sum(a == b for a, b in zip(out, ref, strict=True)) / len(out),
            }
        )

    return records
