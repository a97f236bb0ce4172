"""``smart-batching train``: fine-tune a model with one strategy, on one process or several.

::

    smart-batching train --data ../shared/data/gsm8k/train.jsonl --strategy packed --capacity 2048
    smart-batching train --data default --strategy token_budget --nproc 2          # launches torchrun
    torchrun --nproc_per_node 2 -m smart_batching train --data default --strategy packed
    smart-batching train --strategy packed --batch-schedule "linear:4096->32768@20%" --lr-scaling sqrt

With several processes every rank trains on its share of one balanced plan
(:mod:`smart_batching.distributed`): the same number of micro-batches on every rank and equal real
tokens per optimizer step. The per-step imbalance (max rank tokens / mean) is logged with the loss,
and a summary line is printed at the end (``--json``: one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from smart_batching.bench.machine import usable_cores
from smart_batching.cli.analyze import add_adaptive_options, positive_float, positive_int
from smart_batching.data.tasks import LOSS_ON
from smart_batching.errors import ConfigError


def strategy_help() -> str:
    """``--strategy`` help: every registered strategy with its one-line description."""
    from smart_batching.planners import FASTEST_STRATEGY, spec_class, strategy_names

    listed = "; ".join(f"{name}: {spec_class(name).description}" for name in strategy_names())
    return f"batching strategy (default: {FASTEST_STRATEGY}). {listed}"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="fine-tune a model with one batching strategy (optionally on several processes)",
        description=__doc__.split("::")[0].strip(),
    )
    p.add_argument("--data", default="default", help="dataset path, hub name, or 'default' (embedded)")
    p.add_argument("--model", default="tiny-llama", help="tiny-llama (default), smollm2, or a model path")
    p.add_argument("--tokenizer", default="smollm2", help="tokenizer alias, name or path (default: smollm2)")
    from smart_batching.planners import FASTEST_STRATEGY, strategy_names

    p.add_argument("--strategy", default=FASTEST_STRATEGY, choices=strategy_names(), help=strategy_help())
    p.add_argument(
        "--batch-size", type=positive_int, default=8, help="examples per batch (fixed-size strategies)"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=None,
        help="padded tokens per batch (token_budget); default: 4096, or --max-length if larger",
    )  # fmt: skip
    p.add_argument(
        "--capacity", type=positive_int, default=None,
        help="tokens per packed row (packed); default: 2048, or --max-length if larger",
    )  # fmt: skip
    p.add_argument("--max-length", type=positive_int, default=2048, help="examples are truncated to this")
    p.add_argument(
        "--loss-on", choices=LOSS_ON, default="completion",
        help="what the model learns from: the last reply (completion, default) or every assistant turn (assistant)",
    )  # fmt: skip
    p.add_argument("--num-examples", type=positive_int, default=None, help="use only the first N examples")
    p.add_argument(
        "--epochs",
        type=positive_float,
        default=1.0,
        help="passes over the data (> 0; --max-steps bounds by steps)",
    )
    p.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (overrides --epochs)")
    p.add_argument("--grad-accum", type=positive_int, default=1, help="gradient-accumulation micro-batches")
    add_adaptive_options(p, schedule_note=" (needs --grad-accum 1)")
    p.add_argument("--lr", type=positive_float, default=5e-4, help="learning rate (> 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/train", help="output folder (checkpoints, trainer state)")
    p.add_argument(
        "--save-steps", type=positive_int, default=None,
        help="write a checkpoint (weights, optimizer, sampler cursor) to --out every N optimizer steps",
    )  # fmt: skip
    p.add_argument(
        "--resume", action="store_true",
        help="continue from the newest checkpoint in --out, mid-epoch, at the batch it stopped",
    )  # fmt: skip
    p.add_argument("--nproc", type=positive_int, default=1, help="processes: >1 re-launches under torchrun")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)
    return p


def _relaunch(args: argparse.Namespace) -> int:
    """Start ``args.nproc`` processes of this command under torchrun (gloo on CPU, NCCL on GPUs)."""
    argv = [a for a in sys.argv[1:]]
    # drop "--nproc N" / "--nproc=N" so the children run as plain ranks
    cleaned: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        cleaned.append(a)
    if cleaned and cleaned[0] != "train":
        cleaned = (
            ["train", *cleaned[cleaned.index("train") + 1 :]] if "train" in cleaned else ["train", *cleaned]
        )
    from smart_batching.distributed.launch import run_torchrun

    return run_torchrun(args.nproc, "smart_batching", cleaned)


def run(args: argparse.Namespace) -> int:
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _relaunch(args)
    import torch
    from transformers import TrainerCallback, TrainingArguments

    from smart_batching.bench.measure import CountingCollator
    from smart_batching.data.tasks import prepare_training_data
    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.hf import SmartBatchingTrainer, make_collator
    from smart_batching.models.zoo import load_training_model
    from smart_batching.planners import Knobs

    # Examples are truncated to --max-length, so every budget must hold one (checked before anything
    # loads); rows padded to one width are --max-length wide.
    knobs = Knobs(
        batch_size=args.batch_size, max_tokens=_budget(args, "max_tokens", 4096),
        capacity=_budget(args, "capacity", 2048), longest=args.max_length,
    )  # fmt: skip
    cpu = not torch.cuda.is_available()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if cpu:
        torch.set_num_threads(max(1, usable_cores() // world_size))  # the cores taskset/cgroups leave it
    tokenizer = load_tokenizer(args.tokenizer)
    training_model = load_training_model(args.model, tokenizer=tokenizer)
    data = prepare_training_data(
        args.data,
        tokenizer=training_model.tokenizer,
        model_kind=training_model.kind,
        num_examples=args.num_examples,
        eval_examples=8,
        max_length=args.max_length,
        num_prompts=1,
        loss_on=args.loss_on,
    )
    from smart_batching.planners import spec_class

    options = spec_class(args.strategy).options_from(knobs)
    pad_id = training_model.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else training_model.tokenizer.eos_token_id or 0
    # The bench's counting collator counts the target tokens (the labels the loss is taken over).
    counting = CountingCollator(make_collator(args.strategy, pad_token_id=pad_id))
    counter = TokenCounter(counting)
    training_args = TrainingArguments(
        output_dir=args.out,
        use_cpu=cpu,
        ddp_backend="gloo" if cpu and world_size > 1 else None,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        seed=args.seed,
        logging_steps=1,
        report_to=[],
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        disable_tqdm=not sys.stderr.isatty(),
        # The collator masks each prompt by the data's prompt_length column, which HF's default rule
        # would drop before it (no forward argument): keep every column.
        remove_unused_columns=False,
    )
    imbalance: list[float] = []
    per_step: list[int] = []

    class ImbalanceLogger(TrainerCallback):
        """Per optimizer step: gather every rank's real tokens, log max / mean and the step's tokens."""

        def on_step_end(self, targs, state, control, **kw):  # noqa: ANN001
            tokens = torch.tensor([float(counter.take())])
            if world_size > 1 and torch.distributed.is_initialized():
                gathered = [torch.zeros_like(tokens) for _ in range(world_size)]
                torch.distributed.all_gather(gathered, tokens)
                tokens = torch.cat(gathered)
            mean = float(tokens.mean())
            imbalance.append(float(tokens.max()) / mean if mean else 1.0)
            per_step.append(int(tokens.sum()))

    model = training_model.fresh()
    trainer = SmartBatchingTrainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        data_collator=counter,
        strategy=args.strategy,
        strategy_options=options,
        seed=args.seed,
        callbacks=[ImbalanceLogger()],
        batch_schedule=args.batch_schedule,
        lr_scaling=args.lr_scaling,
        oom_backoff=True if args.oom_backoff else None,
    )
    checkpoint = None
    if args.resume:
        from smart_batching.compat import last_checkpoint

        checkpoint = last_checkpoint(args.out) if os.path.isdir(args.out) else None
        if checkpoint is None:
            raise ConfigError(f"--resume: no checkpoint in --out {args.out} (write them with --save-steps N)")
    start = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=checkpoint)
    seconds = time.perf_counter() - start
    summary = {
        "strategy": args.strategy,
        "model": training_model.name,
        "world_size": world_size,
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "seconds": seconds,
        "real_tokens": counter.total,
        "target_tokens": int(sum(counting.target_tokens)),
        "real_tokens_per_s": counter.total * world_size / seconds if seconds else None,
        "max_step_imbalance": max(imbalance) if imbalance else 1.0,
        "mean_step_imbalance": sum(imbalance) / len(imbalance) if imbalance else 1.0,
        "num_truncated": data.truncation.get("num_truncated"),
        "batch_schedule": args.batch_schedule,
        # A schedule's steps from its plan (exact); else as the collator counted them (the loader may
        # collate a step ahead, so a step's count can hold the next one's).
        "tokens_per_step": (trainer.realised_schedule() or {}).get("tokens", per_step),
        "oom_backoffs": trainer.smart_batching.backoff_state.num_backoffs
        if trainer.smart_batching.backoff is not None
        else None,
    }
    if training_args.process_index == 0:
        if args.json:
            print(json.dumps(summary))
        else:
            print(
                f"trained {summary['steps']} steps of {args.strategy} on {world_size} process(es) in {seconds:.1f} s: "
                f"loss {summary['train_loss']:.4f}, {summary['real_tokens_per_s']:.0f} real tokens/s, "
                f"per-step rank imbalance max {summary['max_step_imbalance']:.3f} "
                f"(mean {summary['mean_step_imbalance']:.3f}); {summary['num_truncated']} examples truncated "
                f"to --max-length {args.max_length}"
            )
    if world_size > 1:
        from smart_batching.distributed import shutdown

        del trainer  # the DDP model first, then the process group (gloo can abort at interpreter exit)
        shutdown()
    return 0


def _budget(args: argparse.Namespace, name: str, default: int) -> int:
    """``--max-tokens`` / ``--capacity``: given, it must hold one example of ``--max-length`` tokens;
    left out, the default or ``--max-length``, whichever is larger."""
    value = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if value is None:
        return max(default, args.max_length)
    if value < args.max_length:
        raise ConfigError(
            f"{flag} {value} is below --max-length {args.max_length}: examples are truncated to --max-length, "
            f"so one would not fit; raise {flag} or lower --max-length"
        )
    return value


class TokenCounter:
    """Wraps a collator and counts the real tokens that pass through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pending = 0
        self.total = 0

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        n = sum(len(f["input_ids"]) for f in features)
        self.pending += n
        self.total += n
        return self.inner(features)

    def take(self) -> int:
        n, self.pending = self.pending, 0
        return n
