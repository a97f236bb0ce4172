"""Multi-process training with the HF Trainer on a *streamed* dataset (DDP on CPU with gloo, or GPUs).

Launch with torchrun (or ``accelerate launch``)::

    torchrun --nproc_per_node 2 examples/ddp_streaming.py --strategy packed --out runs/ddp_streaming

The train set is a ``datasets.IterableDataset`` (no length, nothing planned up front). Each rank takes
its share of the stream (``split_dataset_by_node``) and plans it online over a bounded buffer; the
ranks step in lockstep (:class:`smart_batching.distributed.even_steps.EvenSteps`): when one rank's share ends
first it trains null batches (every label -100: no loss, no gradient) until the others finish, so
every example is used exactly once per epoch and no all-reduce waits forever. ``max_steps`` is
required by the Trainer for a stream; ``--epochs`` stops after that many passes.

Each rank writes ``rank{N}.json`` with the example ids of every real micro-batch per epoch and the
number of null batches it trained; rank 0 prints a JSON summary.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

STRATEGY_OPTIONS = {
    "group_by_length": {"batch_size": 4},
    "token_budget": {"max_tokens": 384},
    "packed": {"capacity": 256},
}


def make_stream(num_examples: int, vocab_size: int, num_shards: int, seed: int = 0):
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, 120, size=num_examples)
    rows = []
    for i, n in enumerate(lengths.tolist()):
        body = rng.integers(3, vocab_size, size=n - 2).tolist()
        rows.append([1 + i // 250, 1 + i % 250, *body])  # the first two tokens encode the index
    return datasets.Dataset.from_dict({"input_ids": rows}).to_iterable_dataset(num_shards=num_shards)


def example_id(input_ids: list[int]) -> int:
    return (input_ids[0] - 1) * 250 + (input_ids[1] - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="packed", choices=sorted(STRATEGY_OPTIONS))
    ap.add_argument("--num-examples", type=int, default=203)
    ap.add_argument("--num-shards", type=int, default=3, help="shards of the stream (3: split by example)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--buffer", type=int, default=50, help="examples planned at a time per rank")
    ap.add_argument("--out", default="runs/ddp_streaming")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from smart_batching.distributed import shutdown
    from smart_batching.hf import SmartBatchingTrainer, make_collator

    vocab = 256
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            use_cache=False,
        )  # fmt: skip
    )
    out = Path(args.out)
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if not torch.cuda.is_available() else None,
        max_steps=10_000,  # a stream has no length; --epochs ends the run
        gradient_accumulation_steps=args.accum,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
    )
    inner = make_collator(args.strategy, pad_token_id=0)
    epochs: list[list[list[int]]] = [[]]

    def recording(features):
        epochs[-1].append([example_id(list(f["input_ids"])) for f in features])
        return inner(features)

    class StopAfterEpochs(TrainerCallback):
        def on_epoch_end(self, _args, state, control, **kwargs):
            if len(epochs) >= args.epochs:
                control.should_training_stop = True
            else:
                epochs.append([])

    trainer = SmartBatchingTrainer(
        model=model,
        args=training_args,
        train_dataset=make_stream(args.num_examples, vocab, args.num_shards),
        data_collator=recording,
        strategy=args.strategy,
        strategy_options=STRATEGY_OPTIONS[args.strategy],
        streaming_buffer_size=args.buffer,
        callbacks=[StopAfterEpochs()],
    )
    result = trainer.train()
    rank = training_args.process_index
    even = trainer.smart_batching.even_steps
    record = {
        "rank": rank,
        "world_size": training_args.world_size,
        "strategy": args.strategy,
        "epochs": epochs,
        "null_batches": even.num_null_batches if even is not None else 0,
        "global_steps": result.global_step,
        "train_loss": result.training_loss,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        print(json.dumps({"strategy": args.strategy, "world_size": training_args.world_size,
                          "steps": result.global_step, "train_loss": result.training_loss}))  # fmt: skip
    # Drop the DDP model, then the process group: left to interpreter exit, gloo can abort the process.
    del trainer
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
