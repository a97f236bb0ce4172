"""Multi-process training with the HF Trainer and balanced smart batching (DDP on CPU with gloo, or GPUs).

Launch with torchrun (or ``accelerate launch``)::

    torchrun --nproc_per_node 2 examples/ddp_trainer.py --strategy packed --out runs/ddp
    torchrun --nproc_per_node 2 examples/ddp_trainer.py --strategy packed --fsdp   # FSDP2 (GPUs)

``--fsdp`` asks the Trainer for FSDP2 (``fsdp_config={"version": 2, ...}``). accelerate 1.15 enables
FSDP only on GPU-like devices (CUDA, XPU, NPU, HPU, ...): on CPU it drops the plugin and wraps the model
in DDP, which this script reports (``"wrapper"`` in the records). FSDP2 itself runs on CPU with gloo
(``tests/test_fsdp.py`` calls ``fully_shard`` directly). ``--zero-stage N`` trains with DeepSpeed ZeRO
stage N through the Trainer; DeepSpeed is not a dependency of this project (install it yourself; on CPU
it runs with gloo, see ``tests/test_fsdp.py``).

Every rank computes the same balanced plan from the same lengths and seed and trains on its own share:
equal micro-batch counts on every rank, every example exactly once per epoch, and real tokens per
optimizer step equal across ranks (within a few percent). The loss is normalised by the target tokens
of the whole optimizer step across ranks (``average_tokens_across_devices``). Each rank writes
``rank{N}.json`` with the example ids of every micro-batch it trained and its tokens per step; rank 0
prints the per-step imbalance (max rank tokens / mean).

The model is a tiny Llama built from its config (random weights); each example's first two tokens
encode its index so the ranks' records can be checked for exactly-once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

STRATEGY_OPTIONS = {
    "random": {"batch_size": 4},
    "group_by_length": {"batch_size": 4},
    "token_budget": {"max_tokens": 384},
    "packed": {"capacity": 256},
}


def make_dataset(num_examples: int, vocab_size: int, seed: int = 0):
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(6, 120, size=num_examples)
    rows = []
    for i, n in enumerate(lengths.tolist()):
        body = rng.integers(3, vocab_size, size=n - 2).tolist()
        rows.append([1 + i // 250, 1 + i % 250, *body])  # the first two tokens encode the index
    return datasets.Dataset.from_dict({"input_ids": rows})


def example_id(input_ids: list[int]) -> int:
    return (input_ids[0] - 1) * 250 + (input_ids[1] - 1)


class RecordingCollator:
    """Wraps the strategy's collator and records which examples each micro-batch held."""

    def __init__(self, inner):
        self.inner = inner
        self.batches: list[list[int]] = []
        self.tokens: list[int] = []

    def __call__(self, features):
        self.batches.append([example_id(list(f["input_ids"])) for f in features])
        self.tokens.append(sum(len(f["input_ids"]) for f in features))
        return self.inner(features)


def _deepspeed_config(stage: int) -> dict:
    # The Trainer's optimizer (AdamW from torch) is not one DeepSpeed lists for ZeRO: allow it.
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="packed", choices=sorted(STRATEGY_OPTIONS))
    ap.add_argument("--num-examples", type=int, default=240)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--out", default="runs/ddp_trainer")
    ap.add_argument(
        "--mix-steps",
        choices=("auto", "on", "off"),
        default="auto",
        help="each step's micro-batch rounds from as many length strata (auto: on for group_by_length)",
    )
    ap.add_argument(
        "--fsdp", action="store_true", help="shard the model with FSDP2 (accelerate) instead of DDP"
    )
    ap.add_argument(
        "--zero-stage", type=int, choices=(0, 1, 2, 3), help="train with DeepSpeed ZeRO (needs deepspeed)"
    )
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

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
    dataset = make_dataset(args.num_examples, vocab)
    out = Path(args.out)
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="gloo" if not torch.cuda.is_available() else None,
        num_train_epochs=1,
        gradient_accumulation_steps=args.accum,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        # FSDP2 through accelerate: every decoder layer and the root sharded over the ranks.
        fsdp="full_shard auto_wrap" if args.fsdp else "",
        deepspeed=None if args.zero_stage is None else _deepspeed_config(args.zero_stage),
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
        if args.fsdp
        else None,
    )
    collator = RecordingCollator(make_collator(args.strategy, pad_token_id=0))
    trainer = SmartBatchingTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=collator,
        strategy=args.strategy,
        strategy_options=STRATEGY_OPTIONS[args.strategy],
        mix_steps={"on": True, "off": False}.get(args.mix_steps, "auto"),
    )
    result = trainer.train()
    rank = training_args.process_index
    wrapper = type(trainer.model_wrapped).__name__  # DistributedDataParallel, or the FSDP2 module
    if args.fsdp and not trainer.is_fsdp_enabled and rank == 0:
        # accelerate (1.15) turns FSDP on for GPU-like devices only; on CPU it keeps DDP.
        print(
            f"--fsdp: accelerate did not enable FSDP on {training_args.device.type}; trained with {wrapper}"
        )
    per_step = [sum(collator.tokens[i : i + args.accum]) for i in range(0, len(collator.tokens), args.accum)]
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "world_size": training_args.world_size,
        "strategy": args.strategy,
        "batches": collator.batches,
        "tokens_per_step": per_step,
        "global_steps": result.global_step,
        "train_loss": result.training_loss,
        "wrapper": wrapper,
        "fsdp_enabled": bool(trainer.is_fsdp_enabled),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if training_args.world_size > 1:
        tokens = torch.tensor(per_step, dtype=torch.float64)
        gathered = [torch.zeros_like(tokens) for _ in range(training_args.world_size)]
        torch.distributed.all_gather(gathered, tokens)
        if rank == 0:
            table = torch.stack(gathered)  # (world_size, steps)
            imbalance = (table.max(dim=0).values / table.mean(dim=0)).max().item()
            print(json.dumps({"strategy": args.strategy, "world_size": training_args.world_size,
                              "steps": int(table.shape[1]), "max_step_imbalance": imbalance,
                              "train_loss": result.training_loss, "wrapper": wrapper,
                              "fsdp_enabled": bool(trainer.is_fsdp_enabled)}))  # fmt: skip
    # Drop the DDP model, then the process group: left to interpreter exit, gloo can abort the process.
    del trainer
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
