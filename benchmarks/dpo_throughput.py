"""DPO training throughput: TRL's ``DPOTrainer`` alone against ``apply_smart_batching``, side by side.

Two preference sets are built from the shared data (``../shared/data``), tokenized by TRL with the
SmolLM2 tokenizer (plain text, TRL adds EOS to both completions):

* ``gsm8k`` (short prompts, long completions): prompt ``"Question: {question}\\nAnswer:"``; chosen, the
  problem's reference solution; rejected, the reference solution of another problem (the solutions
  of a seeded random order, each pair taking the next one's). ``pairs`` problems drawn from train.
* ``sgd`` (long shared prompts, short completions): a Schema-Guided Dialogue cut before its last
  assistant turn, rendered ``"User: ...\\nAssistant: ...\\n...Assistant:"`` as the prompt; chosen, that
  last assistant turn; rejected, the last assistant turn of another dialogue (same seeded
  derangement). ``pairs`` dialogues drawn from train.

Methods, each training one epoch over the same pairs from the same initial weights (fp32, no gradient
checkpointing, dropout off as TRL sets it, AdamW, one process, ``--threads`` torch threads):

==========================  ==========================================================================
``trl``                     ``DPOTrainer`` alone: random batches of ``batch_size`` pairs, padded; on CPU
                            TRL's fused LM head scores every position (on CUDA only the targets)
``random``                  TRL's batches (random, ``batch_size`` pairs), LM head at target positions
                            only: isolates the LM-head saving from the batching
``group_by_length``         ``batch_size`` pairs of similar cost per batch, padded
``token_budget``            batches of at most ``batch_size x mean padded pair cost`` tokens, padded
``packed``                  padding-free rows of ``batch_size x mean pair cost`` tokens, each pair as
                            its two sequences
``packed+prompt_sharing``   the same with each pair's prompt once (prompt, chosen, rejected)
==========================  ==========================================================================

Every method but ``trl`` runs ``apply_smart_batching`` (LM head at target positions). Budgets hold about
``batch_size`` pairs per step on average, so the steps are comparable. After each run, the first step's
logged loss and log-probabilities (``logps/chosen``, ``logps/rejected``) are compared with TRL alone's
on the same pairs from the same weights (``first_step_match``): equal loss per step.

Model: by default a random ``tiny-llama`` widened to hidden 256 (MLP 768) and 6 layers, on SmolLM2's
49,152-token vocabulary: a CPU-sized model whose backbone still does most of the packed path's work on
``sgd`` (about three quarters of its FLOPs), or ``--model smollm2`` cut to its first ``--layers``
layers. On CPU, TRL's fused LM head projects every position of the padded batch onto the vocabulary,
which dominates ``trl``'s time for any small model: ``x random`` (TRL's own batches, LM head at the
targets, which is what TRL does on CUDA) is the ratio that measures the batching. Report the machine,
the load and the CPU seconds with any number.

Run::

    python benchmarks/dpo_throughput.py --quick          # a table; about 4 CPU minutes
    python benchmarks/dpo_throughput.py --json           # one JSON record per (dataset, method)
"""

from __future__ import annotations

import argparse
import copy
import gzip
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
DATA = ROOT.parent / "shared" / "data"
METHODS = ("trl", "random", "group_by_length", "token_budget", "packed", "packed+prompt_sharing")


# -- the preference sets ----------------------------------------------------------------------------


def _derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    """``other[i] != i`` for every ``i``: each item takes the next one's in a random order."""
    order = rng.permutation(n)
    other = np.empty(n, dtype=np.int64)
    other[order] = np.roll(order, -1)
    return other


def gsm8k_pairs(num_pairs: int, seed: int = 0) -> dict[str, list[str]]:
    """Chosen: the reference solution; rejected: another problem's reference solution."""
    with open(DATA / "gsm8k" / "train.jsonl") as f:
        rows = [json.loads(line) for line in f]
    rng = np.random.default_rng(seed)
    picked = [rows[i] for i in rng.choice(len(rows), size=num_pairs, replace=False)]
    other = _derangement(num_pairs, rng)
    return {
        "prompt": [f"Question: {r['question']}\nAnswer:" for r in picked],
        "chosen": [" " + r["answer"] for r in picked],
        "rejected": [" " + picked[j]["answer"] for j in other],
    }


def sgd_pairs(num_pairs: int, seed: int = 0) -> dict[str, list[str]]:
    """The dialogue before its last assistant turn is the prompt; chosen, that turn; rejected, another
    dialogue's last assistant turn."""
    with gzip.open(DATA / "sgd_dialogues" / "train.jsonl.gz", "rt") as f:
        dialogues = [json.loads(line)["messages"] for line in f]
    rng = np.random.default_rng(seed)
    picked = [dialogues[i] for i in rng.choice(len(dialogues), size=num_pairs, replace=False)]
    other = _derangement(num_pairs, rng)
    names = {"user": "User", "assistant": "Assistant"}

    def render(messages: list[dict[str, str]]) -> str:
        return "".join(f"{names[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"

    return {
        "prompt": [render(d[:-1]) for d in picked],
        "chosen": [" " + d[-1]["content"] for d in picked],
        "rejected": [" " + picked[j][-1]["content"] for j in other],
    }


BUILDERS = {"gsm8k": gsm8k_pairs, "sgd": sgd_pairs}


# -- one run ------------------------------------------------------------------------------------------


class _Clock:
    """Wall and process CPU seconds of ``trainer.train()``, and the steps' logged metrics."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                clock.start = (time.perf_counter(), time.process_time())

            def on_train_end(self, *args: Any, **kwargs: Any) -> None:
                clock.end = (time.perf_counter(), time.process_time())

        self.callback = Callback()
        self.start = self.end = (0.0, 0.0)

    @property
    def wall(self) -> float:
        return self.end[0] - self.start[0]

    @property
    def cpu(self) -> float:
        return self.end[1] - self.start[1]


def make_trainer(
    data: Any, model: Any, tokenizer: Any, *, batch_size: int, max_steps: int = -1, **config: Any
):
    """A ``DPOTrainer`` over a text preference set (TRL tokenizes it), on ``model`` and a reference copy."""
    from transformers import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(
        output_dir=tempfile.mkdtemp(), report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
        per_device_train_batch_size=batch_size, gradient_checkpointing=False, bf16=False, num_train_epochs=1,
        max_steps=max_steps, logging_steps=1, learning_rate=1e-6, seed=0, max_length=1024, dataset_num_proc=None,
        **config,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
            processing_class=tokenizer,
        )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the records are ours to print
    return trainer


def strategy_of(
    method: str, costs: dict[str, np.ndarray], batch_size: int
) -> tuple[str, dict[str, Any]] | None:
    """The strategy and options of a method; budgets hold about ``batch_size`` pairs on average."""
    if method == "trl":
        return None
    if method in ("random", "group_by_length"):
        return method, {"batch_size": batch_size}
    if method == "token_budget":
        c = costs["padded"]
        return method, {"max_tokens": int(max(batch_size * c.mean(), c.max()))}
    layout = "shared" if method == "packed+prompt_sharing" else "unshared"
    c = costs[layout]
    return "packed", {
        "capacity": int(max(batch_size * c.mean(), c.max())),
        "prompt_sharing": layout == "shared",
    }


def epoch_shape(trainer: Any) -> dict[str, int]:
    """Tokens the backbone runs and positions the LM head scores over one epoch of the trainer's batches."""
    from smart_batching.hf.dpo.collate import PACKED_PAIRS

    tokens = targets = scored = batches = 0
    for batch in trainer.get_train_dataloader():
        batches += 1
        row = batch.get(PACKED_PAIRS)
        tokens += int(batch["input_ids"].numel() if row is None else row["input_ids"].numel())
        targets += int(batch["completion_mask"][:, 1:].sum())
        scored += int(batch["input_ids"][:, 1:].numel())
    return {"steps": batches, "model_tokens": tokens, "target_tokens": targets, "padded_positions": scored}


def first_step_check(ours: Any, log: dict[str, float], make_alone: Any) -> dict[str, Any]:
    """The first step's logged loss and log-probabilities against TRL alone on the same pairs, weights."""
    sampler = ours.make_train_sampler()
    indices = [int(i) for i in next(iter(sampler))]
    alone = make_alone()
    model = alone.model.train()
    pairs = [alone.train_dataset[i] for i in indices]
    with torch.no_grad():
        loss = alone.compute_loss(model, alone.data_collator(pairs))
    theirs = {
        "loss": float(loss),
        **{k: alone._metrics["train"][k][-1] for k in ("logps/chosen", "logps/rejected")},
    }
    mine = {k: float(log[k]) for k in theirs}
    match = all(abs(mine[k] - theirs[k]) <= 1e-4 * max(1.0, abs(theirs[k])) for k in theirs)
    return {"first_step": {k: [mine[k], theirs[k]] for k in theirs}, "first_step_match": match}


def run(dataset: str, method: str, data: Any, base: Any, tokenizer: Any, costs: dict, args: Any) -> dict:
    from smart_batching.bench.machine import load_average, release_memory
    from smart_batching.hf import apply_smart_batching

    release_memory()
    trainer = make_trainer(data, copy.deepcopy(base), tokenizer, batch_size=args.batch_size)
    num_pairs = len(trainer.train_dataset)
    chosen = strategy_of(method, costs, args.batch_size)
    options: dict[str, Any] = {}
    if chosen is not None:
        strategy, options = chosen
        apply_smart_batching(trainer, strategy, **options)
    shape = epoch_shape(trainer)
    clock = _Clock()
    trainer.add_callback(clock.callback)
    load_before = load_average()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "logps/chosen" in h]
    record: dict[str, Any] = {
        "dataset": dataset,
        "strategy": method,
        "options": {k: v for k, v in options.items()},
        "pairs": num_pairs,
        **shape,
        "wall_s": round(clock.wall, 3),
        "cpu_s": round(clock.cpu, 3),
        "pairs_per_s": round(num_pairs / clock.wall, 3),
        "pairs_per_cpu_s": round(num_pairs / clock.cpu, 3),
        "first_loss": logs[0]["loss"],
        "final_loss": logs[-1]["loss"],
        "load_average_before": load_before,
    }
    if chosen is not None:
        record.update(
            first_step_check(
                trainer,
                logs[0],
                lambda: make_trainer(data, copy.deepcopy(base), tokenizer, batch_size=args.batch_size),
            )
        )
    return record


def build_model(args: Any, tokenizer: Any) -> Any:
    from smart_batching.models.zoo import load_training_model

    if args.model == "smollm2":
        options = {"num_hidden_layers": args.layers} if args.layers else None
    else:
        options = {k: v for k, v in (("num_hidden_layers", args.layers), ("hidden_size", args.hidden)) if v}
        if args.hidden:
            options["intermediate_size"] = 3 * args.hidden
    loaded = load_training_model(args.model, tokenizer=tokenizer, model_options=options or None)
    model = loaded.fresh()
    return model


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--pairs", type=int, default=96, help="pairs per set (one epoch each)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="pairs per step (TRL), and the budgets' target"
    )
    parser.add_argument("--model", default="tiny-llama", choices=["tiny-llama", "smollm2"])
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (smollm2: its first ones)")
    parser.add_argument("--hidden", type=int, default=256, help="tiny-llama hidden size (MLP: 3x)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="32 pairs per set")
    parser.add_argument("--json", action="store_true", help="print one JSON record per line")
    args = parser.parse_args(argv)
    if args.quick:
        args.pairs = min(args.pairs, 32)
    torch.set_num_threads(args.threads)

    import datasets
    import transformers

    from smart_batching.bench.machine import machine_info, machine_line, versions
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.hf import apply_smart_batching
    from smart_batching.hf.dpo.collate import dataset_pair_lengths

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    tokenizer = load_tokenizer("smollm2")
    base = build_model(args, tokenizer)
    machine = machine_info("cpu")
    setting = {
        "model": args.model, "parameters": sum(p.numel() for p in base.parameters()),
        "layers": base.config.num_hidden_layers, "hidden": base.config.hidden_size,
        "vocab": base.config.vocab_size, "dtype": "float32", "gradient_checkpointing": False,
        "threads": args.threads, "batch_size": args.batch_size,
    }  # fmt: skip
    records = []
    for name in args.datasets:
        data = datasets.Dataset.from_dict(BUILDERS[name](args.pairs, seed=args.seed))
        prepared = make_trainer(
            data, copy.deepcopy(base), tokenizer, batch_size=args.batch_size
        ).train_dataset
        lengths = dataset_pair_lengths(
            prepared, max_length=1024, columns=("prompt_ids", "chosen_ids", "rejected_ids")
        )
        costs = {layout: lengths.costs(layout) for layout in ("padded", "unshared", "shared")}
        # Warm-up (allocator, kernels) on two steps that are not timed.
        warm = make_trainer(data, copy.deepcopy(base), tokenizer, batch_size=args.batch_size, max_steps=2)
        apply_smart_batching(warm, "random", batch_size=args.batch_size)
        warm.train()
        for method in args.methods:
            record = {**run(name, method, data, base, tokenizer, costs, args), **setting}
            record.update(
                prompt_tokens_mean=float(lengths.prompt.mean()),
                chosen_tokens_mean=float((lengths.chosen - lengths.prompt).mean()),
                rejected_tokens_mean=float((lengths.rejected - lengths.prompt).mean()),
                machine=machine,
                versions=versions(),
            )
            records.append(record)
            if args.json:
                print(json.dumps(record), flush=True)
    if not args.json:
        print(table(records))
        print(machine_line(machine))
    return records


def table(records: list[dict]) -> str:
    """Pairs per second (wall and process CPU) and their ratios per dataset, measured side by side in one
    run; on a shared machine the CPU-second ratios are the steadier ones."""
    lines = [
        "| dataset | method | steps | model tokens | pairs/s | pairs/CPU s | wall s | CPU s | x trl (wall, CPU) "
        "| x random (wall, CPU) | first step = TRL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["dataset"], r["strategy"]): r for r in records}

    def ratio(r: dict, base: dict | None) -> str:
        if base is None:
            return "-"
        return f"{r['pairs_per_s'] / base['pairs_per_s']:.2f}, {r['pairs_per_cpu_s'] / base['pairs_per_cpu_s']:.2f}"

    for r in records:
        match = {True: "yes", False: "NO", None: "(reference)"}[r.get("first_step_match")]
        lines.append(
            f"| {r['dataset']} | {r['strategy']} | {r['steps']} | {r['model_tokens']} | {r['pairs_per_s']:.2f} | "
            f"{r['pairs_per_cpu_s']:.2f} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{ratio(r, by.get((r['dataset'], 'trl')))} | {ratio(r, by.get((r['dataset'], 'random')))} | {match} |"
        )
    for dataset in dict.fromkeys(r["dataset"] for r in records):
        shared, packed = by.get((dataset, "packed+prompt_sharing")), by.get((dataset, "packed"))
        if shared and packed:
            lines.append(
                f"\n{dataset}: prompt sharing alone (packed+prompt_sharing / packed): {ratio(shared, packed)} "
                f"(wall, CPU) pairs/s, {packed['model_tokens'] / shared['model_tokens']:.2f}x fewer model tokens"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
