"""``smart-batching infer``: batched generation or encoding of a JSONL file with smart batching.

Input: one JSON object per line, ``{"prompt": "..."}`` or ``{"messages": [{"role", "content"}, ...]}``
(``--task generate``), or ``{"text": "..."}`` (``--task encode``). Other keys are copied to the output.
Blank lines are skipped; malformed lines (bad JSON, not an object, missing or mistyped field) are
reported on stderr with their line numbers, the good lines still run, and the exit status is 1.

Output: one JSON object per good input line, in input order: the input object plus ``"line"`` (its
line number) and ``"output"`` and ``"num_generated_tokens"`` (generate) or ``"embedding"`` (encode).
A summary (items/s, tokens/s, padding ratio, prefix tokens saved) is printed on stdout at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from smart_batching.cli.analyze import positive_int
from smart_batching.cli.bench import check_device
from smart_batching.errors import DataError

EXIT_PARTIAL = 1  # some input lines were malformed and skipped; the rest ran


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "infer",
        help="batched generation or encoding of a JSONL file with token-budget batches",
        description=(
            "Run a model over a JSONL file in token-budget batches of similar length and write the "
            'outputs in input order. Lines: {"prompt": ...} or {"messages": [...]} to generate, '
            '{"text": ...} to encode.'
        ),
    )
    p.add_argument(
        "--model", required=True, metavar="M", help="model alias (smollm2, minilm), folder or hub name"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="T",
        help="tokenizer alias, folder or hub name (default: --model)",
    )
    p.add_argument("--input", required=True, metavar="FILE", help="input JSONL file")
    p.add_argument("--output", required=True, metavar="FILE", help="output JSONL file")
    p.add_argument(
        "--task",
        choices=("generate", "encode"),
        default=None,
        help="generate (causal LM) or encode (embeddings); default: the model alias's task, else generate",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="new tokens per prompt (default: 64)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        metavar="B",
        help="token budget per batch: rows x (longest prompt + max new tokens) to generate, rows x longest "
        "text to encode (default: 2048 on CPU, 65536 on CUDA)",
    )
    p.add_argument(
        "--max-batch-size", type=positive_int, default=None, metavar="N", help="most rows per batch"
    )
    p.add_argument(
        "--prefix-sharing",
        action="store_true",
        help="compute the KV cache of prefixes shared by several prompts once per group",
    )
    p.add_argument(
        "--min-prefix",
        type=positive_int,
        default=32,
        metavar="N",
        help="shortest shared prefix (default: 32)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "vllm", "transformers", "loop"),
        default="auto",
        help="generate: vllm (LLM.generate), transformers (generate_batch), loop (the library's own) or "
        "auto (vllm where installed, else transformers; default)",
    )
    p.add_argument(
        "--order",
        choices=("smart", "input"),
        default="smart",
        help="generate on an engine: smart (prefix groups together, long work first) or input order",
    )
    p.add_argument(
        "--pooling", choices=("mean", "cls", "none"), default="mean", help="encode: pooling (default: mean)"
    )
    p.add_argument("--normalize", action="store_true", help="encode: L2-normalise embeddings")
    p.add_argument("--packed", action="store_true", help="encode: pack several texts per row, no padding")
    p.add_argument(
        "--dtype", default="auto", help="model dtype: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda when available)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.set_defaults(func=run)
    return p


def read_requests(
    path: str | Path, task: str
) -> tuple[list[tuple[int, dict[str, Any]]], list[tuple[int, str]]]:
    """Parse the input file.

    Returns:
        ``(good, bad)``: ``good`` holds ``(line number, record)``, ``bad`` holds ``(line number, reason)``.
        Line numbers start at 1.
    """
    good: list[tuple[int, dict[str, Any]]] = []
    bad: list[tuple[int, str]] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                bad.append((lineno, "not UTF-8 text"))
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append((lineno, f"invalid JSON ({exc.msg} at column {exc.colno})"))
                continue
            reason = _check_record(record, task)
            if reason:
                bad.append((lineno, reason))
            else:
                good.append((lineno, record))
    return good, bad


def _check_record(record: Any, task: str) -> str | None:
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    if task == "encode":
        if not isinstance(record.get("text"), str):
            return 'expected a "text" string' + (' (got no "text")' if "text" not in record else "")
        return None if record["text"] else '"text" is empty'
    if "prompt" in record:
        if not isinstance(record["prompt"], str):
            return 'expected "prompt" to be a string'
        return None if record["prompt"] else '"prompt" is empty'
    if "messages" in record:
        msgs = record["messages"]
        ok = (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs
            )
        )
        return None if ok else 'expected "messages" to be a non-empty list of {"role": str, "content": str}'
    return 'expected a "prompt" string or a "messages" list'


def run(args: argparse.Namespace) -> int:
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.models import MODEL_ALIASES, load_model

    task = args.task or MODEL_ALIASES.get(str(args.model).lower(), "generate")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    good, bad = read_requests(args.input, task)
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if not getattr(tokenizer, "chat_template", None):
        chat = [(n, r) for n, r in good if "messages" in r and "prompt" not in r]
        bad += [(n, '"messages" given but the tokenizer has no chat template') for n, _ in chat]
        good = [(n, r) for n, r in good if not ("messages" in r and "prompt" not in r)]
    bad.sort()
    for lineno, reason in bad:
        print(f"{args.input}:{lineno}: skipped: {reason}", file=sys.stderr)
    if not good:
        raise DataError(f"{args.input}: no usable line ({len(bad)} malformed); nothing to run")
    from smart_batching import compat

    if task == "generate" and (args.engine == "vllm" or (args.engine == "auto" and compat.vllm_available())):
        from smart_batching.models import hf_folder

        model = hf_folder(args.model)  # generate() loads it into vLLM (or says why it cannot)
    else:
        model = load_model(args.model, task=task, dtype=args.dtype, device=check_device(args.device))
    load_s = time.perf_counter() - start

    from smart_batching import inference

    records = [r for _, r in good]
    if task == "generate":
        prompts = [r["prompt"] if "prompt" in r else r["messages"] for r in records]
        result = inference.generate(
            model,
            tokenizer,
            prompts,
            engine=args.engine,
            order=args.order,
            max_new_tokens=args.max_new_tokens,
            max_tokens=args.max_tokens,
            max_batch_size=args.max_batch_size,
            prefix_sharing=args.prefix_sharing,
            min_prefix=args.min_prefix,
            progress=progress,
        )
        extra = [
            {"output": text, "num_generated_tokens": len(ids)}
            for text, ids in zip(result.texts, result.token_ids, strict=True)
        ]
        s = result.stats
        summary = [
            ("prompts", f"{s.num_prompts}"),
            ("engine", f"{s.engine}, order {s.order}"),
            ("batches", f"{s.num_batches}"),
            ("time", f"{s.seconds:.2f} s (+ {load_s:.1f} s loading)"),
            ("prompts/s", f"{s.prompts_per_s:.2f}"),
            ("shared prefix tokens", f"{s.shared_prefix_tokens} of {s.prompt_tokens} prompt tokens"),
            (
                "prefix cache hit rate",
                "not reported by the engine" if s.cache_hit_rate is None else f"{s.cache_hit_rate:.1%}",
            ),
            (
                "decoding",
                f"{'continuous batch' if s.continuous_batching else 'model.generate'}, "
                f"{s.mean_decode_rows:.1f} rows per step on average",
            ),
            ("generated tokens/s", f"{s.generated_tokens_per_s:.1f}"),
            ("padding ratio", f"{s.padding_ratio:.1%} of prompt token slots"),
            (
                "prefix tokens saved",
                f"{s.prefill_tokens_saved} of {s.prompt_tokens} prompt tokens in {s.num_prefix_groups} group{'' if s.num_prefix_groups == 1 else 's'}",
            ),
        ]
    else:
        result = inference.encode(
            model,
            tokenizer,
            [r["text"] for r in records],
            max_tokens=args.max_tokens,
            max_batch_size=args.max_batch_size,
            pooling=None if args.pooling == "none" else args.pooling,
            normalize=args.normalize,
            packed=args.packed,
            progress=progress,
        )
        extra = [{"embedding": row} for row in result.embeddings.float().tolist()]
        s = result.stats
        summary = [
            ("texts", f"{s.num_texts}"),
            ("batches", f"{s.num_batches}"),
            ("time", f"{s.seconds:.2f} s (+ {load_s:.1f} s loading)"),
            ("texts/s", f"{s.texts_per_s:.1f}"),
            ("tokens/s", f"{s.tokens_per_s:.0f}"),
            ("padding ratio", f"{s.padding_ratio:.1%} of token slots"),
        ]

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for (lineno, record), more in zip(good, extra, strict=True):
            f.write(json.dumps({**record, "line": lineno, **more}, ensure_ascii=False) + "\n")
    print(f"== infer: {task} with {args.model} -> {out} ==")
    width = max(len(k) for k, _ in summary)
    for key, value in summary:
        print(f"  {key:<{width}}  {value}")
    if bad:
        print(f"  {'skipped lines':<{width}}  {len(bad)} (see stderr)")
        return EXIT_PARTIAL
    return 0
