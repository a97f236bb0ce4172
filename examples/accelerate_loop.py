"""Plain accelerate training loop on planned batches, with a token-normalised loss.

A tiny Llama (built from its config, random weights) learns to count: every example is a run of
consecutive token ids with a random start and a random length, so lengths vary like real data.
The loop shows the three pieces a hand-written loop needs:

1. ``smart_dataloader``: a DataLoader whose ``batch_sampler`` is a ``SmartBatchSampler`` and whose
   collator matches the strategy (``PackingCollator`` for ``packed``), prepared by accelerate;
2. ``enable_packed_attention(model)`` for ``packed``, so packed examples never attend to each other;
3. the loss of one optimizer step = summed token losses / target tokens of all its micro-batches
   (and ranks), not a mean of micro-batch means: batches differ in size.

Run::

    python examples/accelerate_loop.py --strategy packed --epochs 2
    python examples/accelerate_loop.py --quick --json     # a few seconds, one JSON line at the end
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from accelerate import Accelerator

from smart_batching.hf import smart_dataloader
from smart_batching.loss import count_target_tokens, token_loss_sum

STRATEGY_OPTIONS = {
    "random": {"batch_size": 8},
    "group_by_length": {"batch_size": 8},
    "token_budget": {"max_tokens": 512},
    "packed": {"capacity": 512},
}


def counting_dataset(num_examples: int, vocab_size: int, seed: int = 0):
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 120, size=num_examples)
    starts = rng.integers(1, vocab_size, size=num_examples)
    rows = [
        ((s + np.arange(n)) % (vocab_size - 1) + 1).tolist() for s, n in zip(starts, lengths, strict=True)
    ]
    return datasets.Dataset.from_dict({"input_ids": rows})


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="packed", choices=sorted(STRATEGY_OPTIONS))
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quick", action="store_true", help="100 examples, 2 epochs")
    parser.add_argument("--json", action="store_true", help="print one JSON summary line at the end")
    args = parser.parse_args(argv)
    if args.quick:
        args.examples = 100

    vocab_size = 512
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = tiny_llama(vocab_size)
    if args.strategy == "packed":
        from smart_batching.attention import enable_packed_attention

        enable_packed_attention(model)
    dataset = counting_dataset(args.examples, vocab_size)
    loader = smart_dataloader(dataset, args.strategy, seed=0, **STRATEGY_OPTIONS[args.strategy])
    sampler = loader.batch_sampler
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses, examples_per_epoch, tokens = [], [], 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        seen = 0
        batches = iter(loader)  # accelerate calls set_epoch(epoch) on the sampler
        while True:
            micro = [b for _, b in zip(range(args.grad_accum), batches, strict=False)]
            if not micro:
                break
            # Target tokens of the whole step, over every rank: the loss denominator.
            num_items = count_target_tokens([b["labels"] for b in micro]).to(accelerator.device)
            num_items = accelerator.reduce(num_items, reduction="sum")
            step_loss = 0.0
            for i, batch in enumerate(micro):
                seen += (
                    int(batch["cu_seq_lens_q"].numel() - 1)
                    if "cu_seq_lens_q" in batch
                    else len(batch["input_ids"])
                )
                tokens += int(batch["labels"].ne(-100).sum())
                labels = batch.pop("labels")
                ctx = accelerator.no_sync(model) if i < len(micro) - 1 else torch.enable_grad()
                with ctx:
                    logits = model(**batch).logits
                    # DDP averages gradients over ranks, so scale the rank's share back up.
                    loss = token_loss_sum(logits, labels) / num_items * accelerator.num_processes
                    accelerator.backward(loss)
                step_loss += float(loss.detach()) / accelerator.num_processes
            optimizer.step()
            optimizer.zero_grad()
            losses.append(step_loss)
        examples_per_epoch.append(seen)
        accelerator.print(
            f"epoch {epoch}: {seen} examples in {len(loader)} batches, last loss {losses[-1]:.3f} "
            f"(sampler now at epoch {sampler.epoch})"
        )
    elapsed = time.perf_counter() - start
    summary = {
        "strategy": args.strategy,
        "num_examples": args.examples,
        "examples_per_epoch": examples_per_epoch,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "optimizer_steps": len(losses),
        "target_tokens_per_s": tokens / elapsed,
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
