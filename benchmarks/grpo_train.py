"""GRPO training pass: TRL's ``GRPOTrainer`` alone against ``apply_smart_batching``, side by side.

What is timed is the training pass over generated completions, not generation: for every micro-batch of
the generation batch, the policy's per-token log-probabilities and entropies
(``trainer._get_per_token_logps_and_entropies``, the method smart batching replaces, called as TRL's
``_compute_loss`` calls it) and the backward of a policy-gradient surrogate on them
(``-(logps x advantage)`` over the completion tokens; TRL's clipped loss adds elementwise work only).
The optimizer step and TRL's reward and advantage code are the same for every row and are left out.

The completions are made once and are the same for every row: ``prompts`` GSM8K questions (train,
seeded draw) as ``"Question: {question}\\nAnswer:"``, ``num_generations`` completions each, whose
lengths are the token lengths of the reference solutions of other random GSM8K problems (real answer
lengths) clipped to ``[16, max_completion_length]``, and whose token ids are drawn uniformly from the
vocabulary (seeded). They are laid out in TRL's batch format (``prompt_ids`` left-padded, ``completion_ids``
right-padded, ``logits_to_keep`` = the widest completion). Two prompt sets:

* ``gsm8k``: the questions as they are (about 60 to 150 prompt tokens).
* ``gsm8k+system``: the same questions after one shared system prompt of several hundred tokens (an
  instruction and worked GSM8K examples, drawn from problems not among the questions).

Rows, each a ``GRPOTrainer`` on a copy of the same model (fp32, no gradient checkpointing, ``beta=0``):

================  ===========================================================================
``trl``           TRL alone: each micro-batch padded to its longest prompt + longest completion
``token_budget``  ``apply_smart_batching(trainer, "token_budget", max_tokens=...)``: padded
                  forwards of similar-cost completions under the budget
``packed``        ``apply_smart_batching(trainer, "packed", capacity=...)``: padding-free rows,
                  each prompt once per group of completions
================  ===========================================================================

A micro-batch is ``batch_size`` completions (TRL's ``per_device_train_batch_size``; its default 8 with
``num_generations`` 8 is one prompt's group per step). On CPU, TRL's fused LM head projects every
position of a forward onto the vocabulary (on CUDA only the completion tokens), the padding and the
prompt's positions included: that is what both sides pay here.

Each row's log-probabilities are compared with TRL's on the same micro-batches (``max_abs_diff``, over
completion tokens). Peak memory per row is the process's resident-set high-water mark (Linux
``VmHWM``), reset before the row (``/proc/self/clear_refs`` 5, after collecting garbage and
``malloc_trim``): ``rss_peak_mb``, and above the row's starting RSS, ``rss_peak_over_start_mb``.

Run::

    python benchmarks/grpo_train.py --quick                      # tiny model, about 40 s on 2 busy cores
    python benchmarks/grpo_train.py --model smollm2 --prompts 4 --trainable-layers 2 --threads 2
    python benchmarks/grpo_train.py ... --json                   # one JSON record per (prompts, row)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
ROWS = ("trl", "token_budget", "packed")
SETS = ("gsm8k", "gsm8k+system")


# -- the completions ----------------------------------------------------------------------------------


def read_gsm8k(path: Path = GSM8K) -> list[dict[str, str]] | None:
    """GSM8K train rows, or None (with a message) when the shared data is absent."""
    if not path.exists():
        print(f"grpo_train: {path} is absent: nothing to run")
        return None
    with open(path) as f:
        return [json.loads(line) for line in f]


def system_prompt(rows: list[dict[str, str]], tokenizer: Any, min_tokens: int) -> str:
    """An instruction and worked examples (the last GSM8K train problems) of at least ``min_tokens``."""
    text = (
        "You are a careful math tutor. Solve each grade-school word problem step by step: restate what is "
        "asked, write every intermediate computation as <<expression=result>>, check the units, and end with "
        "a line '#### <number>' holding the final answer only. Here are solved examples.\n\n"
    )
    for row in reversed(rows):
        if len(tokenizer(text)["input_ids"]) >= min_tokens:
            break
        text += f"Question: {row['question']}\nAnswer: {row['answer']}\n\n"
    return text


def make_batch(
    rows: list[dict[str, str]], tokenizer: Any, *, prompts: int, num_generations: int,
    max_completion_length: int, system: str, seed: int,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """TRL's padded batch of ``prompts x num_generations`` completions (each prompt's group contiguous)."""
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(rows) - 64, size=prompts, replace=False)  # the last 64 feed the system prompt
    texts = [system + f"Question: {rows[i]['question']}\nAnswer:" for i in picked]
    prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
    answers = rng.choice(len(rows) - 64, size=prompts * num_generations)
    lengths = [len(tokenizer(" " + rows[i]["answer"])["input_ids"]) for i in answers]
    lengths = np.clip(lengths, 16, max_completion_length)
    vocab = len(tokenizer)
    n, pw, cw = prompts * num_generations, max(map(len, prompt_ids)), int(lengths.max())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batch = {
        "prompt_ids": torch.full((n, pw), pad), "prompt_mask": torch.zeros(n, pw, dtype=torch.long),
        "completion_ids": torch.full((n, cw), pad), "completion_mask": torch.zeros(n, cw, dtype=torch.long),
    }  # fmt: skip
    for b in range(n):
        p, c = prompt_ids[b // num_generations], int(lengths[b])
        batch["prompt_ids"][b, pw - len(p) :] = torch.tensor(p)
        batch["prompt_mask"][b, pw - len(p) :] = 1
        batch["completion_ids"][b, :c] = torch.from_numpy(rng.integers(0, vocab, size=c))
        batch["completion_mask"][b, :c] = 1
    batch["advantages"] = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    return batch


# -- the rows -----------------------------------------------------------------------------------------


def make_trainer(model: Any, tokenizer: Any, args: Any) -> Any:
    """A ``GRPOTrainer`` on ``model`` (its prompts are never used: the completions are given)."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        per_device_train_batch_size=args.batch_size, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, gradient_checkpointing=False, bf16=False, beta=0.0,
        seed=args.seed,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(
            model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["."] * args.batch_size}),
            processing_class=tokenizer,
        )  # fmt: skip


def micro_batches(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """TRL's micro-batches: consecutive ``size`` completions, each trimmed to its own padded width (TRL
    pads a generation batch to its longest prompt and completion)."""
    out = []
    for start in range(0, batch["prompt_ids"].shape[0], size):
        part = {k: v[start : start + size] for k, v in batch.items()}
        p = int(part["prompt_mask"].sum(1).max())
        c = int(part["completion_mask"].sum(1).max())
        for key, keep in (("prompt_ids", slice(-p, None)), ("prompt_mask", slice(-p, None)),
                          ("completion_ids", slice(0, c)), ("completion_mask", slice(0, c))):  # fmt: skip
            part[key] = part[key][:, keep]
        out.append(part)
    return out


def training_pass(trainer: Any, parts: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Log-probabilities (with entropies, as TRL's loss asks) and backward, for every micro-batch."""
    model = trainer.model
    out = []
    for part in parts:
        ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
        mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
        width = part["completion_ids"].shape[1]
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, width, compute_entropy=True
        )
        keep = part["completion_mask"]
        loss = -(logps * part["advantages"][:, None] * keep).sum() / keep.sum()
        loss.backward()
        out.append(logps.detach() * keep)
    model.zero_grad(set_to_none=True)
    return out


def _reset_peak() -> float:
    """Collect, trim the heap, reset ``VmHWM``; the current RSS in MiB."""
    from smart_batching.bench.machine import release_memory

    release_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_row(name: str, base: Any, tokenizer: Any, parts: list, reference: list | None, args: Any) -> dict:
    from smart_batching.hf import apply_smart_batching

    trainer = make_trainer(copy.deepcopy(base), tokenizer, args)
    trainer.model.train()
    if name == "token_budget":
        apply_smart_batching(trainer, "token_budget", max_tokens=args.max_tokens)
    elif name == "packed":
        apply_smart_batching(trainer, "packed", capacity=args.max_tokens)
    training_pass(trainer, [{k: v[:2] for k, v in parts[0].items()}])  # warm-up (kernels), not timed
    state = getattr(trainer, "smart_batching", None)
    if state is not None:
        state.num_tokens = state.num_forwards = 0
    start_mb = _reset_peak()
    walls, cpus = [], []
    for _ in range(args.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        logps = training_pass(trainer, parts)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    peak_mb = _status("VmHWM")
    completions = sum(p["prompt_ids"].shape[0] for p in parts)
    padded = sum(p["prompt_ids"].numel() + p["completion_ids"].numel() for p in parts)
    wall, cpu = float(np.median(walls)), float(np.median(cpus))
    diff = (
        0.0
        if reference is None
        else max(float((a - b).abs().max()) for a, b in zip(logps, reference, strict=True))
    )
    return {
        "strategy": name,
        "completions": completions,
        "micro_batches": len(parts),
        "forwards": len(parts) if state is None else state.num_forwards // args.repeats,
        "model_tokens": padded if state is None else state.num_tokens // args.repeats,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "completions_per_s": round(completions / wall, 3),
        "completions_per_cpu_s": round(completions / cpu, 3),
        "rss_peak_mb": round(peak_mb, 1),
        "rss_peak_over_start_mb": round(peak_mb - start_mb, 1),
        "max_abs_diff": diff,
        "logps_mean": float(sum(x.sum() for x in logps) / sum(p["completion_mask"].sum() for p in parts)),
        "_logps": logps,
    }


def build_model(args: Any, tokenizer: Any) -> Any:
    from smart_batching.models.zoo import load_training_model

    options: dict[str, Any] = {"trainable_layers": args.trainable_layers}
    if args.layers:
        options["num_hidden_layers"] = args.layers
    if args.model == "tiny-llama" and args.hidden:
        options.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    return load_training_model(args.model, tokenizer=tokenizer, model_options=options).fresh()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--prompts", type=int, default=4, help="GSM8K questions per set")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256, help="tokens")
    parser.add_argument("--batch-size", type=int, default=8, help="completions per micro-batch (TRL's)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="token_budget / packed budget, tokens")
    parser.add_argument("--system-tokens", type=int, default=500, help="gsm8k+system: shared prompt, tokens")
    parser.add_argument("--model", default="smollm2", choices=["tiny-llama", "smollm2"])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (smollm2: its first ones)")
    parser.add_argument("--trainable-layers", type=int, default=2, help="the last ones; the rest frozen")
    parser.add_argument("--hidden", type=int, default=None, help="tiny-llama hidden size (MLP: 3x)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per row (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 prompts x 4 short completions")
    parser.add_argument("--json", action="store_true", help="print one JSON record per line")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.layers, args.hidden, args.trainable_layers = "tiny-llama", 2, 64, 1
        args.prompts, args.num_generations, args.batch_size = 2, 4, 4
        args.max_completion_length, args.system_tokens = 24, 80
    torch.set_num_threads(args.threads)
    rows = read_gsm8k()
    if rows is None:
        return []

    import datasets
    import transformers

    from smart_batching.bench.machine import load_average, machine_info, machine_line, versions
    from smart_batching.data.tokenizers import load_tokenizer

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    tokenizer = load_tokenizer("smollm2")
    base = build_model(args, tokenizer)
    machine = machine_info("cpu")
    setting = {
        "model": args.model, "parameters": sum(p.numel() for p in base.parameters()),
        "trainable_parameters": sum(p.numel() for p in base.parameters() if p.requires_grad),
        "layers": base.config.num_hidden_layers, "trainable_layers": args.trainable_layers,
        "vocab": base.config.vocab_size, "dtype": "float32", "gradient_checkpointing": False,
        "threads": args.threads, "batch_size": args.batch_size, "num_generations": args.num_generations,
        "max_completion_length": args.max_completion_length, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "memory": "VmHWM (process RSS high-water), reset per row",
    }  # fmt: skip
    records = []
    for name in args.sets:
        system = system_prompt(rows, tokenizer, args.system_tokens) if name == "gsm8k+system" else ""
        batch = make_batch(rows, tokenizer, prompts=args.prompts, num_generations=args.num_generations,
                           max_completion_length=args.max_completion_length, system=system, seed=args.seed)  # fmt: skip
        parts = micro_batches(batch, args.batch_size)
        prompt_tokens = batch["prompt_mask"].sum(1).float()
        completion_tokens = batch["completion_mask"].sum(1).float()
        reference = None
        for row in args.rows:
            load = load_average()
            record = run_row(row, base, tokenizer, parts, reference, args)
            logps = record.pop("_logps")
            if row == "trl":
                reference = logps
            record.update(
                dataset=name, prompts=args.prompts, prompt_tokens_mean=float(prompt_tokens.mean()),
                completion_tokens_mean=float(completion_tokens.mean()),
                completion_tokens_max=int(completion_tokens.max()), load_average_before=load, **setting,
                machine=machine, versions=versions(),
            )  # fmt: skip
            records.append(record)
            if args.json:
                print(json.dumps(record), flush=True)
    if not args.json:
        print(table(records))
        print(machine_line(machine))
    return records


def table(records: list[dict]) -> str:
    """Completions per second of the training pass (wall and process CPU), ratios against ``trl`` of the
    same set, measured side by side in one run, and peak RSS per row."""
    lines = [
        "| prompts | row | forwards | model tokens | completions/s | completions/CPU s | x trl (wall, CPU) "
        "| peak RSS MiB (over start) | max abs diff vs trl |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {r["dataset"]: r for r in records if r["strategy"] == "trl"}
    for r in records:
        b = base.get(r["dataset"])
        ratio = "-" if b is None else (
            f"{r['completions_per_s'] / b['completions_per_s']:.2f}, "
            f"{r['completions_per_cpu_s'] / b['completions_per_cpu_s']:.2f}"
        )  # fmt: skip
        lines.append(
            f"| {r['dataset']} ({r['prompt_tokens_mean']:.0f} tok) | {r['strategy']} | {r['forwards']} | "
            f"{r['model_tokens']} | {r['completions_per_s']:.2f} | {r['completions_per_cpu_s']:.2f} | {ratio} | "
            f"{r['rss_peak_mb']:.0f} ({r['rss_peak_over_start_mb']:+.0f}) | {r['max_abs_diff']:.2g} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
