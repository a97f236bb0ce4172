"""GPU training throughput per batching strategy: a ~0.5B Llama, bf16, real length distributions, one run.

The rows of ``train_throughput.py`` (its ``run_strategy``: the same Trainers, collators and records) on
a bigger model and the real lengths of the shared data sets, on CUDA:

* model: a Llama built from its config with random weights (``--model 0.5b``: hidden 1024, 24 layers,
  16 heads, 4 KV heads, MLP 4096, vocabulary 49,152, untied LM head: 0.47B parameters, printed);
  ``--tiny`` (or ``--dry-run``): hidden 64, 2 layers, vocabulary 1,024, on CPU, two steps per row;
* precision: TRL's ``SFTConfig`` defaults for every row: ``bf16=True`` (autocast to bfloat16, float32
  weights) and activation checkpointing (the same for every row; ``--precision fp32`` turns both off);
* data: token lengths (and prompt lengths) of a shared data set from ``.device-bundle/lengths``
  (``make device-bundle``: GSM8K, LIMA, SGD tokenised with SmolLM2), resampled with replacement and
  cut to ``--capacity``; token ids are random, the loss is on the answer (the prompt's labels are -100);
* a step holds about ``--tokens-per-step`` real tokens (16,384) in every row: HF's fixed batches hold
  ``tokens-per-step / mean length`` examples; ``token_budget`` 1.25x that in padded tokens; ``packed``
  and TRL ``rows = tokens-per-step / capacity`` rows of ``--capacity`` (4,096) tokens.

Rows: ``hf_random`` (HF Trainer, padded random batches: the baseline), ``hf_group_by_length``,
``trl_packing`` (TRL's ``SFTTrainer(packing=True)``: BFD packing, which turns ``padding_free`` on; its
model keeps the attention implementation it was built with, ``sdpa`` here, since flash-attn is not
installed: transformers then builds a block-diagonal causal mask from the packed ``position_ids``;
recorded as ``attn_implementation``), ``token_budget`` and ``packed`` (ours, ``SmartBatchingTrainer``:
packed rows through ``attention/_kernels.py``'s varlen kernel).

Per row, after ``--warmup`` untimed steps (3): real tokens per second, step time (median, p90), peak
``torch.cuda.max_memory_allocated``, and

* MFU = model FLOPs / (time x peak), model FLOPs = 6 x N x real tokens + 6 x layers x hidden x sum of
  the squared lengths of the real segments (causal attention, forward and backward; N = parameters
  without the input embedding; recomputation under checkpointing and padding are not counted), peak =
  989 TFLOP/s (H100 SXM bf16 dense; ``--peak-tflops``);
* attention share: ``torch.profiler`` over two warm-up steps (the 2nd and 3rd, untimed), the summed
  self time of device kernels (CPU ops on CPU) whose names match ``flash|attention|attn|sdpa|varlen|fmha``
  over that of all kernels.

A row that fails is recorded with its error and the next one runs; ``--deadline-s`` skips (and records)
the rows that would start after it. ``--json`` prints one JSON record per row (``strategy``, ``data``,
``settings``, ``model``, ``env``, the metrics, ratios vs ``hf_random`` and vs ``trl_packing``).

Usage::

    python benchmarks/gpu_train.py --data lima,gsm8k --json > gpu.jsonl   # on a GPU
    python benchmarks/gpu_train.py --dry-run --json                         # CPU, tiny, two steps a row
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402 - the rows' code (run_strategy), shared with the CPU benchmark
from gpu_summary import add_ratios, table  # noqa: E402 - ratios and the table, shared with the summary

REPO = Path(__file__).resolve().parents[1]
LENGTHS = REPO / ".device-bundle" / "lengths"
ROWS = ("hf_random", "hf_group_by_length", "trl_packing", "token_budget", "packed")
MODELS = {
    "0.5b": {"hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 4, "mlp": 4096, "vocab": 49152},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "mlp": 128, "vocab": 1024},
}
ATTENTION_KERNEL = re.compile(r"flash|attention|attn|sdpa|varlen|fmha", re.IGNORECASE)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- data and model -------------------------------------------------------------------------------------


def load_lengths(name: str, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.load(folder / f"{name}_lengths.npy").astype(np.int64)
    prompts = np.load(folder / f"{name}_prompt_lengths.npy").astype(np.int64)
    return lengths, prompts


def synthetic_dataset(
    lengths: np.ndarray, prompts: np.ndarray, n: int, capacity: int, vocab: int, seed: int
) -> tuple[Any, dict[str, Any]]:
    """``n`` examples resampled from the real (length, prompt length) pairs, cut to ``capacity``, with
    random token ids and labels -100 on the prompt."""
    import datasets

    rng = np.random.default_rng(seed)
    pick = rng.integers(0, lengths.size, n)
    lens = np.minimum(lengths[pick], capacity)
    prompt = np.minimum(prompts[pick], lens - 1)
    ids = rng.integers(3, vocab, int(lens.sum())).tolist()
    input_ids, labels, start = [], [], 0
    for length, p in zip(lens.tolist(), prompt.tolist(), strict=True):
        row = ids[start : start + length]
        start += length
        input_ids.append(row)
        labels.append([-100] * p + row[p:])
    ds = datasets.Dataset.from_dict({"input_ids": input_ids, "labels": labels, "length": lens.tolist()})
    info = {
        "num_examples": n,
        "mean_length": float(lens.mean()),
        "max_length": int(lens.max()),
        "total_tokens": int(lens.sum()),
        "source_examples": int(lengths.size),
        "source_mean_length": float(lengths.mean()),
        "cut_to_capacity": int((lengths[pick] > capacity).sum()),
    }
    return ds, info


def build_model(spec: dict[str, int], device: str, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["mlp"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["kv_heads"],
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        return LlamaForCausalLM(config)


def count_parameters(spec: dict[str, int]) -> dict[str, int]:
    h, kv = spec["hidden"], spec["hidden"] // spec["heads"] * spec["kv_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * spec["mlp"] + 2 * h
    embed = spec["vocab"] * h
    total = spec["layers"] * layer + 2 * embed + h
    return {"total": total, "without_input_embedding": total - embed}


def id_tokenizer() -> Any:
    """A tokenizer with only pad/eos/unk: what ``SFTTrainer`` asks of one on token-id data (no files)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


# -- measurement ----------------------------------------------------------------------------------------


def profiler_callback(first: int, count: int) -> Any:
    """Profile optimizer steps ``first .. first + count - 1`` (0-based); ``result`` holds the attention
    share of kernel time afterwards."""
    from transformers import TrainerCallback

    class Profile(TrainerCallback):
        def __init__(self) -> None:
            self.prof: Any = None
            self.step = 0
            self.result: dict[str, Any] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            if self.step == first:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            self.step += 1
            if self.prof is not None and self.step == first + count:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                try:
                    self.result = attention_share(self.prof)
                except Exception as exc:  # noqa: BLE001 - recorded; the row's timing goes on
                    self.result = {"attention_share": None, "profile_error": f"{type(exc).__name__}: {exc}"}
                self.prof = None

    return Profile()


def attention_share(prof: Any) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    total = attn = 0.0
    names: dict[str, float] = {}
    for e in prof.key_averages():
        t = float(e.self_device_time_total if cuda else e.self_cpu_time_total)
        if cuda and getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        total += t
        if ATTENTION_KERNEL.search(e.key):
            attn += t
            names[e.key[:80]] = names.get(e.key[:80], 0.0) + t
    top = sorted(names.items(), key=lambda kv: -kv[1])[:4]
    if cuda and total == 0.0:
        return {"attention_share": None, "profiled_kind": "no CUDA kernel events in the profile"}
    return {
        "attention_share": attn / total if total else None,
        "profiled_kind": "cuda_kernels" if cuda else "cpu_ops",
        "attention_kernels": [k for k, _ in top],
    }


def mfu(record: dict[str, Any], spec: dict[str, int], n_params: int, peak_tflops: float) -> dict[str, Any]:
    tokens, squares, seconds = record["real_tokens"], record["segment_length_squares"], record["seconds"]
    flops = 6 * n_params * tokens + 6 * spec["layers"] * spec["hidden"] * squares
    tflops = flops / seconds / 1e12 if seconds else float("nan")
    return {"model_tflops_per_s": tflops, "mfu": tflops / peak_tflops}


def environment() -> dict[str, Any]:
    import platform

    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "transformers": f"{transformers.__version__} ({Path(transformers.__file__).parent.parent})",
    }
    for name in (
        "trl",
        "accelerate",
        "datasets",
        "huggingface_hub",
        "tokenizers",
        "numba",
        "pyarrow",
        "numpy",
    ):
        try:
            module = __import__(name)
            env[name] = f"{module.__version__} ({Path(module.__file__).parent.parent})"
        except Exception as exc:  # noqa: BLE001 - recorded
            env[name] = f"unavailable: {exc}"
    try:
        import flash_attn  # noqa: F401

        env["flash_attn"] = flash_attn.__version__
    except Exception as exc:  # noqa: BLE001 - recorded
        env["flash_attn"] = f"unavailable: {type(exc).__name__}"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401

        env["torch_varlen_attn"] = True
    except Exception as exc:  # noqa: BLE001 - recorded
        env["torch_varlen_attn"] = f"unavailable: {type(exc).__name__}"
    return env


# -- main -----------------------------------------------------------------------------------------------


def run_row(
    name: str, data: str, opts: argparse.Namespace, spec: dict[str, int], n_params: int, tmp: str
) -> dict[str, Any]:
    lengths, prompts = load_lengths(data, opts.lengths)
    mean = float(np.minimum(lengths, opts.capacity).mean())
    batch_size = max(1, round(opts.tokens_per_step / mean))
    rows = max(1, round(opts.tokens_per_step / opts.capacity))
    steps = opts.warmup + opts.steps
    n = int(math.ceil(1.5 * steps * opts.tokens_per_step / mean)) + batch_size
    ds, info = synthetic_dataset(lengths, prompts, n, opts.capacity, spec["vocab"], opts.seed)
    budget = max(int(batch_size * mean * 1.25), info["max_length"])
    budget = -(-budget // 64) * 64
    run_opts = argparse.Namespace(batch_size=batch_size, steps=steps, warmup=opts.warmup, vocab=spec["vocab"])
    profile = profiler_callback(first=max(opts.warmup - 2, 0), count=min(2, max(opts.warmup - 1, 1)))
    model = build_model(spec, opts.device, opts.seed)
    built = sum(p.numel() for p in model.parameters())
    if built != count_parameters(spec)["total"]:
        log(f"note: the model has {built:,} parameters, the formula {count_parameters(spec)['total']:,}")
    n_params = built - model.get_input_embeddings().weight.numel()
    record = tt.run_strategy(
        name,
        ds,
        run_opts,
        budget,
        opts.capacity,
        os.path.join(tmp, f"{data}-{name}"),
        seed=opts.seed,
        precision=opts.precision,
        model=model,
        rows=rows,
        processing_class=id_tokenizer(),
        callbacks=(profile,),
    )
    record.update(profile.result)
    record.update(mfu(record, spec, n_params, opts.peak_tflops))
    record["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    record["data"] = {"name": data, **info}
    record["settings"].update(tokens_per_step=opts.tokens_per_step, row_capacity=opts.capacity)
    return record


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default="lima,gsm8k", help="length sets of the bundle, in order")
    parser.add_argument("--lengths", type=Path, default=LENGTHS, help="folder of <name>_lengths.npy")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--model", choices=list(MODELS), default="0.5b")
    parser.add_argument("--capacity", type=int, default=4096, help="tokens per packed row, longest example")
    parser.add_argument("--tokens-per-step", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the last two profiled)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--precision", choices=list(tt.PRECISIONS), default="bf16")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="the card's bf16 dense peak")
    parser.add_argument("--deadline-s", type=float, default=None, help="skip rows that would start later")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", "--dry-run", action="store_true", help="tiny model on CPU, two steps a row")
    parser.add_argument("--json", action="store_true", help="one JSON record per row per line")
    parser.add_argument("--env", type=Path, default=None, help="write the versions to this JSON file, exit")
    opts = parser.parse_args(argv)
    if opts.env is not None:
        opts.env.write_text(json.dumps(environment(), indent=1, default=str) + "\n")
        return []
    start = time.perf_counter()
    opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.tiny:
        opts.model, opts.device = "tiny", "cpu"
        opts.capacity, opts.tokens_per_step, opts.warmup, opts.steps = 512, 1024, 1, 1
    spec = MODELS[opts.model]
    params = count_parameters(spec)
    n_params = params["without_input_embedding"]
    env = environment()
    log(f"model {opts.model} {spec}: {params['total'] / 1e9:.3f}B parameters; {env}")
    records: list[dict[str, Any]] = []
    datas = [d.strip() for d in opts.data.split(",") if d.strip()]
    names = [r.strip() for r in opts.rows.split(",") if r.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        for data in datas:
            for name in names:
                base = {"strategy": name, "data": {"name": data}, "settings": {}}
                elapsed = time.perf_counter() - start
                t0 = time.perf_counter()
                if opts.deadline_s is not None and elapsed > opts.deadline_s:
                    record = {**base, "skipped": f"deadline: {elapsed:.0f} s > {opts.deadline_s:.0f} s"}
                else:
                    try:
                        record = run_row(name, data, opts, spec, n_params, tmp)
                    except Exception as exc:  # noqa: BLE001 - recorded; the next row runs
                        record = {
                            **base,
                            "error": f"{type(exc).__name__}: {exc}"[:2000],
                            "traceback": traceback.format_exc()[-4000:],
                        }
                    finally:
                        gc.collect()  # the failed row's model and optimizer, before the next row's
                        if torch.cuda.is_available():
                            torch.cuda.empty_cache()
                record.update(
                    model={
                        "name": opts.model,
                        **spec,
                        "parameters": params["total"],
                        "flops_parameters": n_params,
                    },
                    env=env,
                    row_seconds=time.perf_counter() - t0,
                    peak_tflops=opts.peak_tflops,
                    precision_setting=opts.precision,
                )
                records.append(record)
                add_ratios(records)
                log(
                    f"{data} {name}: "
                    + (
                        record.get("error")
                        or record.get("skipped")
                        or f"{record['real_tokens_per_s']:,.0f} real tok/s, MFU {record['mfu']:.1%}"
                    )
                    + f" ({record['row_seconds']:.0f} s)"
                )
                if opts.json:
                    print(json.dumps(record, default=str), flush=True)
    if not opts.json:
        print(table(records))
    return records


if __name__ == "__main__":
    main()
