"""Forward+backward time of one packed row: padded SDPA vs transformers' packed path vs ours.

A tiny Llama (hidden 256, 4 layers, 4 heads, 2 KV heads; CPU-sized) trains on the same ~20 examples
with GSM8K-like lengths (about 100 tokens each, 2048 tokens in all), laid out three ways:

* ``padded_sdpa``: a ``(num_examples, longest)`` padded batch with an ``attention_mask``, ``sdpa``.
* ``hf_packed_sdpa``: one ``(1, 2048)`` row with restarting ``position_ids``, no mask, no KV cache,
  ``sdpa``: transformers builds a dense 2048 x 2048 block-causal mask.
* ``smart_batching_packed``: the same row with ``cu_seq_lens``, our segment-wise attention.

Usage::

    python benchmarks/attention_speed.py            # table
    python benchmarks/attention_speed.py --json     # one JSON record per line
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch


def gsm8k_like_lengths(total: int, seed: int) -> list[int]:
    """Example lengths (tokens) drawn like GSM8K prompt+answer, filling exactly ``total`` tokens."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(np.clip(rng.lognormal(mean=np.log(95), sigma=0.35), 30, 300)))
    lengths[-1] -= sum(lengths) - total
    if lengths[-1] < 8:  # fold a sliver into its neighbour
        lengths[-2] += lengths.pop()
    return lengths


def build_model(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_position_embeddings=4096,
        attn_implementation=attn_implementation,
        use_cache=False,
    )
    return LlamaForCausalLM(config).train()


def step_seconds(model, batch: dict) -> float:
    """Wall time of one forward+backward (loss from ``labels``)."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(**batch).loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the packed row")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON record per line")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from smart_batching.attention import enable_packed_attention
    from smart_batching.collate import PackingCollator, PaddingCollator

    lengths = gsm8k_like_lengths(args.tokens, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    features = [{"input_ids": torch.randint(1, 2048, (n,), generator=gen)} for n in lengths]
    padded = PaddingCollator(0)(features)
    padded["labels"][:, 0] = -100
    packed = PackingCollator()(features)
    hf_packed = {k: packed[k] for k in ("input_ids", "labels", "position_ids")}

    ours = enable_packed_attention(build_model("sdpa"))
    runs = [
        ("padded_sdpa", build_model("sdpa"), padded),
        ("hf_packed_sdpa", build_model("sdpa"), hf_packed),
        ("smart_batching_packed", ours, {k: v for k, v in packed.items() if k != "seq_idx"}),
    ]
    # Same weights everywhere (same seed), so the losses must agree: a cheap exactness check.
    with torch.no_grad():
        losses = {name: float(model(**batch).loss) for name, model, batch in runs}

    # Interleave the methods step by step so that load from other processes hits all of them alike.
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for i in range(args.warmup + args.repeat):
        for name, model, batch in runs:
            seconds = step_seconds(model, batch)
            if i >= args.warmup:
                times[name].append(seconds)
    results = [(name, statistics.median(times[name]), times[name]) for name, _, _ in runs]
    base = results[0][1]
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"

    if args.json:
        import transformers

        for name, seconds, samples in results:
            record = {
                "strategy": name,
                "seconds": seconds,
                "ratio_vs_padded": seconds / base,
                "seconds_min": min(samples),
                "speedup_vs_padded": base / seconds,
                "times": samples,
                "loss": losses[name],
                "num_examples": len(lengths),
                "num_tokens": sum(lengths),
                "padded_shape": list(padded["input_ids"].shape),
                "machine": machine,
                "transformers": transformers.__version__,
            }
            print(json.dumps(record))
        return

    print(
        f"{len(lengths)} examples, {sum(lengths)} tokens (min {min(lengths)}, max {max(lengths)}); "
        f"padded batch {tuple(padded['input_ids'].shape)}; {machine}"
    )
    print(f"{'strategy':<24}{'median s':>10}{'min s':>10}{'vs padded':>11}{'loss':>11}")
    for name, seconds, samples in results:
        print(f"{name:<24}{seconds:>10.4f}{min(samples):>10.4f}{seconds / base:>10.2f}x{losses[name]:>11.6f}")


if __name__ == "__main__":
    main()
