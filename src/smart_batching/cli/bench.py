"""``smart-batching bench``: fine-tune one model once per strategy and seed, then report.

Runs :func:`smart_batching.bench.runner.run_bench`: the records go to ``--out``/``records.jsonl`` as
each run finishes (Ctrl-C keeps the finished ones and still renders the report), the report to
``--out``/``report.{md,html}``. Ends with the report paths and the summary table; ``--json`` prints the
records instead, one JSON object per line on stdout (the rest goes to stderr).

``--nproc N`` trains every run on N processes: for each strategy and seed the bench starts
``torchrun --standalone --nproc_per_node N`` (gloo on CPU, one GPU per process with NCCL), the
processes train over one balanced plan (each example once per epoch, across them), and the bench
evaluates the trained weights once and writes the record (``world_size`` N; tokens/s of all processes
together; peak memory of the largest process)::

    smart-batching bench --data ../shared/data/gsm8k/train.jsonl --max-steps 40 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from smart_batching.cli.analyze import add_adaptive_options, non_negative_int, positive_float, positive_int
from smart_batching.data.tasks import LOSS_ON
from smart_batching.planners import STRATEGIES

DEFAULT_OUT = "out/bench"
MODELS = ("tiny-llama", "smollm2", "minilm")
DEFAULT_STRATEGIES = ",".join(STRATEGIES)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated non-negative integers, got {text!r}")
    return values


def _model_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``; the value is read as JSON when it parses (``2``, ``true``, ``0.1``), else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE (e.g. trainable_layers=2), got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="fine-tune a model once per batching strategy and compare speed, padding, memory and accuracy",
        description=(
            "Fine-tune the same model from the same initial weights on the same examples once per strategy and "
            "seed, with the real transformers Trainer, and write JSON-lines records and a Markdown/HTML report: "
            "wall time, tokens/s, step times, padding, peak memory, loss curves, eval loss, task metric."
        ),
    )
    d = p.add_argument_group("data and model")
    d.add_argument(
        "--data", default="default", metavar="D",
        help="'default' (embedded dataset), a data file or folder (e.g. gsm8k/train.jsonl, sst2/) (default: default)",
    )  # fmt: skip
    d.add_argument(
        "--eval-data", default=None, metavar="D",
        help="held-out data (default: a dev/test split or sibling file such as test.jsonl, else the tail of --data)",
    )  # fmt: skip
    d.add_argument(
        "--model", default="tiny-llama", choices=MODELS, help="model to fine-tune (default: tiny-llama)"
    )
    d.add_argument(
        "--model-option", type=_model_option, action="append", default=[], metavar="KEY=VALUE", dest="model_options",
        help="a model option (repeatable): trainable_layers=K (train the last K decoder layers and the final norm "
        "only), num_hidden_layers=K (smollm2: its first K layers), or a LlamaConfig field (tiny-llama)",
    )  # fmt: skip
    d.add_argument("--tokenizer", default=None, metavar="T", help="tokenizer (default: the model's own)")
    d.add_argument(
        "--max-length", type=positive_int, default=None, metavar="N",
        help="truncate examples to N tokens, once, for every strategy (default: keep all)",
    )  # fmt: skip
    d.add_argument(
        "--loss-on", choices=LOSS_ON, default="completion",
        help="what a causal LM learns from: the last reply (completion, default) or every assistant turn (assistant)",
    )  # fmt: skip
    r = p.add_argument_group("runs")
    r.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        metavar="LIST",
        help=f"comma-separated (default: {DEFAULT_STRATEGIES})",
    )
    r.add_argument(
        "--seeds", type=_int_list, default=[0], metavar="LIST", help="comma-separated seeds (default: 0)"
    )
    r.add_argument(
        "--max-steps", type=positive_int, default=None, metavar="N",
        help="train on N x batch-size examples (N steps of the fixed-size strategies; the others see the same examples)",
    )  # fmt: skip
    r.add_argument(
        "--num-examples",
        type=positive_int,
        default=None,
        metavar="N",
        help="training examples (overrides --max-steps)",
    )
    r.add_argument(
        "--epochs", type=positive_int, default=1, metavar="N", help="epochs over the examples (default: 1)"
    )
    r.add_argument(
        "--batch-size", type=positive_int, default=8, metavar="N", help="examples per batch (default: 8)"
    )
    r.add_argument(
        "--max-tokens", type=positive_int, default=None, metavar="N",
        help="token_budget batch size in padded tokens (default: batch size x mean length, rounded up to 64)",
    )  # fmt: skip
    r.add_argument(
        "--capacity",
        type=positive_int,
        default=None,
        metavar="N",
        help="packed row capacity (default: as --max-tokens)",
    )
    r.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help="learning rate (default: 1e-3 tiny-llama, 5e-5 smollm2, 1e-4 minilm)",
    )
    r.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    r.add_argument(
        "--precision", choices=["fp32", "bf16", "auto"], default="auto",
        help="every strategy in float32, or with bf16 autocast (TrainingArguments(bf16=True)); auto: bf16 on "
        "a CUDA GPU that supports it, else fp32 (default: auto)",
    )  # fmt: skip
    r.add_argument(
        "--nproc", type=positive_int, default=1, metavar="N",
        help="processes per run: >1 trains each run under torchrun over one balanced plan "
        "(gloo on CPU, one GPU per process with NCCL) (default: 1)",
    )  # fmt: skip
    r.add_argument(
        "--threads", type=positive_int, default=None, metavar="N",
        help="torch CPU threads, per process with --nproc (default: torch's own, or cores / nproc; "
        "1 gives steady CPU-time figures on a shared machine)",
    )  # fmt: skip
    a = p.add_argument_group("adaptive batch size")
    add_adaptive_options(a)
    a.add_argument(
        "--schedule-unit", choices=("tokens", "examples"), default=None,
        help="count --batch-schedule in this unit for every strategy (default: each strategy's own)",
    )  # fmt: skip
    e = p.add_argument_group("evaluation")
    e.add_argument(
        "--eval-examples",
        type=positive_int,
        default=64,
        metavar="N",
        help="held-out examples for eval loss (default: 64)",
    )
    e.add_argument(
        "--eval-every", default=None, metavar="N|Ntok|auto",
        help="held-out loss during training: every N optimizer steps, every N real training tokens "
        "('20000tok') or 'auto' (about a tenth of the training compute); evaluation time is kept out of "
        "the training clock (default: off, the initial and final evaluations only)",
    )  # fmt: skip
    e.add_argument(
        "--target", type=positive_float, default=None, metavar="LOSS",
        help="held-out loss for time to target (default: random's final held-out loss, same seed)",
    )  # fmt: skip
    e.add_argument(
        "--num-generations", type=non_negative_int, default=None, metavar="N",
        help="held-out prompts to generate for (default: 16 for GSM8K, 4 otherwise, 8 predictions for classification)",
    )  # fmt: skip
    e.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="generation length (default: 256 GSM8K, 48 otherwise)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"folder for records and report (default: {DEFAULT_OUT})",
    )
    o.add_argument(
        "--append", action="store_true", help="add to an existing records.jsonl instead of starting a new one"
    )
    o.add_argument(
        "--json", action="store_true", help="print one JSON record per run on stdout (nothing else)"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress lines or bars on stderr")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from smart_batching.bench.config import BenchConfig
    from smart_batching.bench.report import summary_table
    from smart_batching.bench.runner import RECORDS_NAME, run_bench
    from smart_batching.planners import split_strategies

    strategies = split_strategies(args.strategies)
    emit = None
    if args.json:

        def emit(record: dict[str, Any]) -> None:
            print(json.dumps(record, ensure_ascii=False), flush=True)

    config = BenchConfig(
        data=args.data,
        model=args.model,
        tokenizer=args.tokenizer,
        strategies=strategies,
        seeds=args.seeds,
        max_steps=args.max_steps,
        num_examples=args.num_examples,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        capacity=args.capacity,
        max_length=args.max_length,
        loss_on=args.loss_on,
        lr=args.lr,
        eval_data=args.eval_data,
        eval_examples=args.eval_examples,
        eval_every=args.eval_every,
        target=args.target,
        num_generations=args.num_generations,
        max_new_tokens=args.max_new_tokens,
        out_dir=args.out,
        append=args.append,
        progress=not args.no_progress,
        device=check_device(args.device),
        threads=args.threads,
        nproc=args.nproc,
        batch_schedule=args.batch_schedule,
        schedule_unit=args.schedule_unit,
        lr_scaling=args.lr_scaling,
        oom_backoff=args.oom_backoff,
        precision=args.precision,
        model_options=dict(args.model_options) or None,
        on_record=emit,
    )
    records = run_bench(config)
    out = Path(args.out)
    stream = sys.stderr if args.json else sys.stdout
    if not records:
        print("no run finished; nothing to report", file=sys.stderr)
        return 130
    print(f"\nrecords: {out / RECORDS_NAME}", file=stream)
    print(f"report:  {out / 'report.html'} (and {out / 'report.md'})\n", file=stream)
    print(summary_table(records), file=stream)
    return 0


def check_device(device: str | None) -> str | None:
    """Refuse a CUDA device where there is none, before anything loads.

    Raises:
        ConfigError: ``--device cuda...`` and ``torch.cuda.is_available()`` is False.
    """
    if device and device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            from smart_batching.errors import ConfigError

            raise ConfigError(
                f"--device {device}: this machine has no CUDA GPU (or torch is a CPU build); use --device cpu"
            )
    return device
