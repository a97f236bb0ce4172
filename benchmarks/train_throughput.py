"""Training throughput per batching strategy: real tokens per second under HF ``Trainer``, one run.

Model: a Llama built from its config with random weights (hidden 256, 4 layers, 4 heads, MLP 768),
float32 weights, with SmolLM2's vocabulary of 49,152 tokens (``--vocab 8192`` folds token ids modulo a smaller
vocabulary, so that the LM head does not dominate a CPU run). Data: the
first ``--examples`` GSM8K train records (``../shared/data/gsm8k/train.jsonl`` from the repository
root), rendered question/answer as plain text by :mod:`smart_batching.data.formats`, tokenised with SmolLM2
(GPT-2 when SmolLM2 is absent), loss on the answer only (``labels`` -100 on the question).

Strategies, all on the same examples, the same model initialisation and the same optimizer:

============================  ===================================================================
``hf_random``                 HF Trainer, random sampler, batches of ``--batch-size`` padded to
                              their longest (the baseline every ratio is taken against)
``hf_group_by_length``        HF Trainer, ``train_sampling_strategy="group_by_length"``
                              (``LengthGroupedSampler``), padded
``hf_flattening``             HF Trainer, random sampler, ``DataCollatorWithFlattening`` (padding-free;
                              transformers' own sdpa packed path, a dense block-causal mask)
``group_by_length``           ours: ``SmartBatchingTrainer``, HF's megabatch algorithm, padded
``token_budget``              ours: variable batch size under ``--batch-size x mean length x 1.25``
                              padded tokens
``packed``                    ours: packs of ``--batch-size x mean length`` tokens (so as many
                              optimizer steps as the fixed batches, with as many real tokens each),
                              packed attention
``packed_full_logits``        ``packed`` with ``target_logits_only=False``: the LM head on every
                              position, as HF computes it (ours compute it only where the loss looks)
``trl_packing``               TRL's ``SFTTrainer`` with ``SFTConfig(packing=True)``: its best-fit
                              packing into rows of the ``packed`` capacity, padding-free, one row per
                              step (what a TRL user picks instead)
``sft_packed``                ``apply_smart_batching(sft_trainer, "packed")`` on that same
                              ``SFTTrainer`` (``packing=False``): our plan and packed attention, TRL's
                              loss and metrics (its fused LM head scores target positions only)
============================  ===================================================================

Precision (``--precision``), the same for every row of a comparison:

==========  =========================================================================================
``bf16``    TRL's ``SFTConfig`` defaults, for every row (HF and ours too): ``bf16=True`` (autocast to
            bfloat16, float32 weights) and activation checkpointing
``fp32``    ``bf16=False`` and no checkpointing, for every row (TRL's rows too)
``both``    (default) both settings, fp32 first; ratios are taken within a setting, never across
==========  =========================================================================================

Each record names its setting (``precision``: ``setting``, ``dtype``, ``autocast``,
``checkpointing``, ``cpu_bf16``, the CPU's bf16-related flags) and its peak memory: on CUDA
``max_memory_allocated``, on CPU the process's resident memory sampled every 10 ms
(:class:`smart_batching.bench.machine.PeakMemory`; freed heap is handed back before each row) and
its growth during training (``peak_memory_growth_mb``, the row's own peak). ``--onednn off`` turns torch's
oneDNN kernels off (``torch.backends.mkldnn.enabled = False``), so bf16 matrix products take ATen's
reference GEMM: the path they take on a CPU without AVX-512 (most AVX2 machines), measured on a
machine that has AVX-512.

By default every strategy trains one epoch over the examples, so all see exactly the same tokens;
``--steps N`` stops each one after ``N`` optimizer steps instead (they then see different examples).
Time is measured per optimizer step (``on_step_begin`` to ``on_step_end``), after ``--warmup`` steps;
real tokens are the non-padding input tokens of the timed steps. Both wall time (``real_tokens_per_s``)
and this process's CPU time (``real_tokens_per_cpu_s``, from ``time.process_time``) are reported: on a
shared machine other processes inflate wall time, and with ``--threads 1`` CPU time stays a fair
measure of the work each strategy costs.

Usage::

    python benchmarks/train_throughput.py              # 128 examples, fp32 and bf16 rows (about 8 min idle)
    python benchmarks/train_throughput.py --quick      # 64 examples
    python benchmarks/train_throughput.py --json       # one JSON record per strategy per line
    python benchmarks/train_throughput.py --precision bf16 --onednn off \
        --strategies trl_packing,sft_packed            # TRL's defaults, as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
ALL_STRATEGIES = (
    "hf_random",
    "hf_group_by_length",
    "hf_flattening",
    "group_by_length",
    "token_budget",
    "packed",
    "packed_full_logits",
    "trl_packing",
    "sft_packed",
)
BASELINE = "hf_random"
PRECISIONS = {"fp32": (False, False), "bf16": (True, True)}  # setting -> (bf16, activation checkpointing)
# The CPU flags that decide how bf16 matrix products run (compat.cpu_half_matmul).
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "bf16")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- data -----------------------------------------------------------------------------------------------


def load_examples(path: Path, num_examples: int, vocab: int) -> tuple[Any, dict[str, Any]]:
    """Tokenised GSM8K records as a ``datasets.Dataset`` with ``input_ids``, ``labels``, ``length``."""
    import datasets

    from smart_batching.data.formats import render_batch
    from smart_batching.data.tokenizers import load_tokenizer

    if not path.is_file():
        raise SystemExit(f"{path} not found: pass --data PATH to a GSM8K-style JSONL file")
    records = []
    with open(path) as f:
        for line in f:
            if line.strip():
                records.append(json.loads(line))
            if len(records) == num_examples:
                break
    batch = {k: [r[k] for r in records] for k in records[0]}
    try:
        tokenizer, tokenizer_name = load_tokenizer("smollm2"), "smollm2"
    except Exception as exc:  # noqa: BLE001 - fall back to GPT-2 and say so
        log(f"note: smollm2 tokenizer unavailable ({exc}); using gpt2")
        tokenizer, tokenizer_name = load_tokenizer("gpt2"), "gpt2"
    rendered = render_batch(batch, tokenizer)
    special = not rendered.chat_template
    prompt_ids = tokenizer(rendered.prompts, add_special_tokens=special)["input_ids"]
    full_ids = tokenizer(rendered.texts, add_special_tokens=special)["input_ids"]
    eos = tokenizer.eos_token_id
    input_ids, labels = [], []
    for p, ids in zip(prompt_ids, full_ids, strict=True):
        ids = [*ids, eos] if eos is not None else list(ids)
        ids = [t % vocab for t in ids]
        n_prompt = min(len(p), len(ids) - 1)
        input_ids.append(ids)
        labels.append([-100] * n_prompt + ids[n_prompt:])
    lengths = [len(x) for x in input_ids]
    ds = datasets.Dataset.from_dict({"input_ids": input_ids, "labels": labels, "length": lengths})
    info = {
        "data": f"{path.name} (first {len(records)} records)",
        "tokenizer": tokenizer_name,
        "vocab": vocab,
        "num_examples": len(records),
        "mean_length": float(np.mean(lengths)),
        "max_length": int(np.max(lengths)),
        "total_tokens": int(np.sum(lengths)),
    }
    return ds, info


# -- model and measurement ------------------------------------------------------------------------------


def tiny_llama(vocab: int, hidden: int, layers: int, attn: str = "sdpa", seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


def sft_tokenizer():
    """A tokenizer for ``SFTTrainer`` (the data is already tokenized; it supplies pad/eos only)."""
    from smart_batching.data.tokenizers import load_tokenizer

    try:
        return load_tokenizer("smollm2")
    except Exception:  # noqa: BLE001 - the tokenizer load_examples fell back to
        return load_tokenizer("gpt2")


class CountingCollator:
    """Wrap a collator and record, per batch, the real (non-padding) input tokens, the token slots and
    the sum of its examples' squared lengths (``seq_lengths`` of a packed row count one by one): what
    causal attention over the real segments costs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.real: list[int] = []
        self.slots: list[int] = []
        self.squares: list[int] = []

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        features = [{k: f[k] for k in ("input_ids", "labels", "seq_lengths") if k in f} for f in features]
        self.squares.append(
            sum(int(n) ** 2 for f in features for n in f.get("seq_lengths", [len(f["input_ids"])]))
        )
        batch = self.inner(features)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        self.real.append(int(mask.sum()) if mask is not None else int(ids.numel()))
        self.slots.append(int(ids.numel()))
        return batch


def step_timer():
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self._t0 = self._c0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0, self._c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)
            self.cpu_times.append(time.process_time() - self._c0)

    return StepTimer()


def budgets(data_info: dict[str, Any], batch_size: int) -> tuple[int, int]:
    """The token budget and the pack capacity, in multiples of 64."""
    # Tokens per batch for the variable strategies: what a fixed batch holds on average, plus slack,
    # and at least the longest example.
    budget = max(int(batch_size * data_info["mean_length"] * 1.25), data_info["max_length"])
    # Packs hold no padding: a fixed batch's real tokens on average, so the optimizer steps match.
    capacity = max(int(batch_size * data_info["mean_length"]), data_info["max_length"])
    return -(-budget // 64) * 64, -(-capacity // 64) * 64


def heldout_loss(model: Any, eval_ds: Any) -> float:
    """Mean cross-entropy per target token on held-out examples (fixed padded batches, the same for
    every strategy)."""
    from smart_batching.bench.evaluate import eval_causal_lm

    model.eval()
    return float(
        eval_causal_lm(model, eval_ds.select_columns(["input_ids", "labels"]), pad_token_id=0)["loss"]
    )


def run_strategy(
    name: str,
    ds: Any,
    opts: argparse.Namespace,
    budget: int,
    capacity: int,
    out_dir: str,
    seed: int = 0,
    eval_ds: Any = None,
    precision: str = "fp32",
    *,
    model: Any = None,
    rows: int = 1,
    processing_class: Any = None,
    callbacks: tuple[Any, ...] = (),
) -> dict[str, Any]:
    """Train one strategy on ``ds`` from the initial weights of ``seed`` (its data order too), in
    ``precision`` (a key of :data:`PRECISIONS`); with ``eval_ds``, the record also holds the trained
    model's held-out loss (``eval_loss``).

    ``model`` replaces the default :func:`tiny_llama`; ``rows`` is the packed rows per step (``packed``'s
    ``rows_per_batch``, TRL's per-device batch of packed rows); ``processing_class`` replaces
    :func:`sft_tokenizer` for TRL's rows; ``callbacks`` go to the Trainer beside the step timer
    (``benchmarks/gpu_train.py`` passes these)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from smart_batching import compat
    from smart_batching.bench.machine import PeakMemory, release_memory
    from smart_batching.collate import PaddingCollator
    from smart_batching.hf import SmartBatchingTrainer, make_collator
    from smart_batching.hf.precision import describe_precision

    bf16, checkpointing = PRECISIONS[precision]
    common = {
        "output_dir": out_dir,
        "use_cpu": not torch.cuda.is_available(),
        "report_to": [],
        "per_device_train_batch_size": opts.batch_size,
        "num_train_epochs": 1,
        "max_steps": opts.steps if opts.steps else -1,
        "learning_rate": 1e-3,
        "lr_scheduler_type": getattr(opts, "lr_schedule", "constant"),
        "logging_steps": 1,
        "save_strategy": "no",
        "disable_tqdm": True,
        "remove_unused_columns": False,
        "seed": seed,
        "data_seed": seed,
        "bf16": bf16,
        compat.checkpointing_argument(): checkpointing,
    }
    pad = 0
    if model is None:
        model = tiny_llama(opts.vocab, opts.hidden, opts.layers, seed=seed)
    timer = step_timer()
    callbacks = [timer, *callbacks]
    settings: dict[str, Any] = {"batch_size": opts.batch_size}
    if name in ("trl_packing", "sft_packed"):
        from trl import SFTConfig, SFTTrainer

        from smart_batching.hf import apply_smart_batching

        packing = name == "trl_packing"
        config = {**common, "per_device_train_batch_size": rows if packing else opts.batch_size}
        args = SFTConfig(packing=packing, max_length=capacity, **config)
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=ds,
            processing_class=processing_class if processing_class is not None else sft_tokenizer(),
            callbacks=callbacks,
        )
        if packing:
            settings = {
                "max_length": capacity,
                "rows": rows,
                "packing_strategy": args.packing_strategy,
                "padding_free": trainer.padding_free,
            }
        else:
            options = {"capacity": capacity, **({"rows_per_batch": rows} if rows > 1 else {})}
            apply_smart_batching(trainer, "packed", seed=seed, **options)
            settings = options
        collator = CountingCollator(trainer.data_collator)
        trainer.data_collator = collator
    elif name.startswith("hf_"):
        if name == "hf_flattening":
            collator = CountingCollator(DataCollatorWithFlattening())
        else:
            collator = CountingCollator(PaddingCollator(pad))
        strategy = "group_by_length" if name == "hf_group_by_length" else "random"
        args = TrainingArguments(train_sampling_strategy=strategy, **common)
        trainer = Trainer(
            model=model, args=args, train_dataset=ds, data_collator=collator, callbacks=callbacks
        )
    else:
        base = name.removesuffix("_full_logits")
        options = {
            "group_by_length": {"batch_size": opts.batch_size},
            "token_budget": {"max_tokens": budget},
            "packed": {"capacity": capacity, **({"rows_per_batch": rows} if rows > 1 else {})},
        }[base]
        settings = {**options, "target_logits_only": base == name}
        collator = CountingCollator(make_collator(base, pad_token_id=pad))
        trainer = SmartBatchingTrainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=ds,
            data_collator=collator,
            callbacks=callbacks,
            strategy=base,
            strategy_options=options,
            seed=seed,
            target_logits_only=base == name,
        )
    trainer.remove_callback(PrinterCallback)  # keep stdout for the JSON records
    release_memory()  # the previous row's freed heap back to the OS, so that it does not hide this peak
    with PeakMemory("cuda" if torch.cuda.is_available() else "cpu") as mem:
        trainer.train()
    setup = describe_precision(trainer)
    setup.pop("device", None)
    record_precision = {"setting": precision, **setup}
    if "cpu_bf16" in setup:
        from smart_batching.compat import cpu_flags

        record_precision["cpu_flags"] = sorted(set(BF16_FLAGS) & cpu_flags())
    state = getattr(trainer, "smart_batching", None)
    if state is not None and "lm_head_matmul" in state.precision:
        record_precision["lm_head_matmul"] = state.precision["lm_head_matmul"]
    steps = len(timer.times)
    warm = min(opts.warmup, max(steps - 1, 0))
    timed = timer.times[warm:]
    # One micro-batch per optimizer step; the collator may have run one batch ahead.
    real = int(np.sum(collator.real[warm:steps]))
    slots = int(np.sum(collator.slots[warm:steps]))
    squares = int(np.sum(collator.squares[warm:steps]))
    seconds = float(np.sum(timed))
    cpu_seconds = float(np.sum(timer.cpu_times[warm:]))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tail = max(1, len(losses) // 10)
    return {
        "strategy": name,
        "precision": record_precision,
        "seed": seed,
        "eval_loss": heldout_loss(trainer.model, eval_ds) if eval_ds is not None else None,
        "settings": settings,
        "optimizer_steps": steps,
        "timed_steps": len(timed),
        "real_tokens": real,
        "token_slots": slots,
        "segment_length_squares": squares,
        "padding_ratio": 1.0 - real / slots if slots else 0.0,
        "seconds": seconds,
        "real_tokens_per_s": real / seconds if seconds else float("nan"),
        "cpu_seconds": cpu_seconds,
        "real_tokens_per_cpu_s": real / cpu_seconds if cpu_seconds else float("nan"),
        "step_time_p50_s": float(np.percentile(timed, 50)) if timed else None,
        "step_time_p90_s": float(np.percentile(timed, 90)) if timed else None,
        "final_loss": float(np.mean(losses[-tail:])) if losses else None,
        "train_loss": float(np.mean(losses)) if losses else None,
        # CUDA: max_memory_allocated; CPU: the sampled peak resident memory of the process, and its
        # growth over the resident memory at the start of training (the row's own peak).
        "peak_memory_mb": mem.peak_mb,
        "peak_memory_growth_mb": (
            mem.peak_mb - mem.start_mb if mem.peak_mb is not None and mem.start_mb is not None else None
        ),
        "memory_kind": mem.kind,
        # Other processes on the machine: a high load inflates wall time (see real_tokens_per_cpu_s).
        "load_avg_1m_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


# -- output ----------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import transformers

    from smart_batching.bench.machine import cpu_model
    from smart_batching.compat import cpu_flags, cpu_half_matmul, forced_cpu_half

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "cpu": cpu_model(),
        "cpu_flags": sorted(set(BF16_FLAGS) & cpu_flags()),
        "onednn": bool(torch.backends.mkldnn.enabled),
        "cpu_bf16": cpu_half_matmul(torch.bfloat16),
        "cpu_bf16_forced": forced_cpu_half() is not None,  # SMART_BATCHING_CPU_HALF, not the CPU
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


# The comparisons the targets name, each within one precision setting: (ours, theirs).
PAIRS = (("sft_packed", "trl_packing"), ("packed", BASELINE))


def add_ratios(records: list[dict[str, Any]]) -> None:
    """``ratio_vs_random`` / ``cpu_ratio_vs_random`` (and for ``sft_packed`` ``ratio_vs_trl`` /
    ``cpu_ratio_vs_trl``) against the row of the same precision setting."""

    def find(name: str, setting: str) -> dict[str, Any] | None:
        return next(
            (r for r in records if r["strategy"] == name and r["precision"]["setting"] == setting), None
        )

    for r in records:
        setting = r["precision"]["setting"]
        for key, other in (("random", find(BASELINE, setting)), ("trl", find("trl_packing", setting))):
            if key == "trl" and r["strategy"] != "sft_packed":
                continue
            r[f"ratio_vs_{key}"] = r["real_tokens_per_s"] / other["real_tokens_per_s"] if other else None
            r[f"cpu_ratio_vs_{key}"] = (
                r["real_tokens_per_cpu_s"] / other["real_tokens_per_cpu_s"] if other else None
            )


def _x(value: float | None) -> str:
    return f"{value:>8.2f}x" if value is not None else f"{'-':>9}"


def format_table(records: list[dict[str, Any]]) -> str:
    head = (
        f"{'strategy':<20} {'precision':<10} {'steps':>5} {'real tok':>9} {'padding':>8} {'real tok/s':>10} "
        f"{'vs random':>9} {'tok/cpu-s':>9} {'vs random':>9} {'+peak MB':>8} {'final loss':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        peak = r.get("peak_memory_growth_mb")
        lines.append(
            f"{r['strategy']:<20} {r['precision']['setting']:<10} {r['optimizer_steps']:>5} "
            f"{r['real_tokens']:>9,} {r['padding_ratio']:>8.1%} {r['real_tokens_per_s']:>10,.0f} "
            f"{_x(r.get('ratio_vs_random'))} {r['real_tokens_per_cpu_s']:>9,.0f} "
            f"{_x(r.get('cpu_ratio_vs_random'))} {peak if peak is not None else float('nan'):>8,.0f} "
            f"{r['final_loss']:>10.3f}"
        )
    pairs = []
    for ours, theirs in PAIRS:
        for r in records:
            if r["strategy"] != ours:
                continue
            other = next(
                (
                    o
                    for o in records
                    if o["strategy"] == theirs and o["precision"]["setting"] == r["precision"]["setting"]
                ),
                None,
            )
            if other is not None:
                pairs.append(
                    f"{ours} / {theirs} at {r['precision']['setting']}: "
                    f"{r['real_tokens_per_s'] / other['real_tokens_per_s']:.2f}x real tok/s, "
                    f"{r['real_tokens_per_cpu_s'] / other['real_tokens_per_cpu_s']:.2f}x real tok/cpu-s"
                )
    if pairs:
        lines += ["", *pairs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=GSM8K)
    parser.add_argument("--examples", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="stop each strategy after N optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps at the start")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--strategies", default=",".join(ALL_STRATEGIES))
    parser.add_argument(
        "--precision",
        choices=[*PRECISIONS, "both"],
        default="both",
        help="bf16: TRL's defaults (bf16=True, activation checkpointing) for every row; fp32: neither",
    )
    parser.add_argument(
        "--onednn",
        choices=["on", "off"],
        default="on",
        help="off: torch.backends.mkldnn.enabled=False (bf16 products take ATen's reference GEMM, as on "
        "a CPU without AVX-512)",
    )
    parser.add_argument("--quick", action="store_true", help="64 examples")
    parser.add_argument("--json", action="store_true", help="one JSON record per strategy per line")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.examples = min(opts.examples, 64)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    torch.backends.mkldnn.enabled = opts.onednn == "on"
    strategies = [s.strip() for s in opts.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(ALL_STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {', '.join(ALL_STRATEGIES)}")
    settings = list(PRECISIONS) if opts.precision == "both" else [opts.precision]

    ds, data_info = load_examples(opts.data, opts.examples, opts.vocab)
    budget, capacity = budgets(data_info, opts.batch_size)
    env = environment()
    log(f"data: {data_info}; token budget {budget}, capacity {capacity}; {env}")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in settings:
            for name in strategies:
                t0 = time.perf_counter()
                record = run_strategy(
                    name,
                    ds,
                    opts,
                    budget,
                    capacity,
                    os.path.join(tmp, f"{name}-{setting}"),
                    precision=setting,
                )
                record.update(
                    model={
                        "hidden": opts.hidden,
                        "layers": opts.layers,
                        "vocab": opts.vocab,
                        "dtype": "float32",
                    },
                    data=data_info,
                    env=env,
                )
                records.append(record)
                add_ratios(records)
                log(
                    f"{name} ({setting}): {record['real_tokens_per_s']:,.0f} real tok/s, "
                    f"{record['real_tokens_per_cpu_s']:,.0f} real tok/cpu-s ({time.perf_counter() - t0:.0f} s)"
                )
                if opts.json:
                    print(json.dumps(record), flush=True)
    if not opts.json:
        print(format_table(records))
        print(
            f"\n{env['machine']} ({env['cpu']}; flags {', '.join(env['cpu_flags']) or 'none'}; "
            f"bf16 products: {env['cpu_bf16']}{' (forced)' if env['cpu_bf16_forced'] else ''}), torch threads {env['torch_threads']}, "
            f"load avg {env['load_avg_1m']}"
        )
    return records


if __name__ == "__main__":
    main()
