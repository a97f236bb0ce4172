"""One rank of ``loss_normalization="epoch"`` on several processes (launched by torchrun from
tests/test_step_weight.py): a tiny Llama trained with SGD by SmartBatchingTrainer, clipping binding at
every step. Writes ``rank{N}.json``: the plan's mean targets per step, each step's scale and parameter
change, the examples this rank trained on."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", default="group_by_length")
    ap.add_argument("--options", default='{"batch_size": 4}')
    ap.add_argument("--accum", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from smart_batching.distributed import shutdown
    from smart_batching.hf import SmartBatchingTrainer

    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(6, 90, size=64)]
    data = datasets.Dataset.from_dict({"input_ids": rows})
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    model = LlamaForCausalLM(config).float()

    class Deltas(TrainerCallback):
        deltas: list[float] = []

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            self.before = [p.detach().clone() for p in model.parameters()]

        def on_step_end(self, args, state, control, model=None, **kwargs):
            total = sum(
                ((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), self.before, strict=True)
            )
            self.deltas.append(float(torch.sqrt(total)))

    deltas = Deltas()
    out = Path(args.out)
    trainer = SmartBatchingTrainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(out / "trainer"), use_cpu=True, report_to=[], num_train_epochs=1, learning_rate=10.0,
            lr_scheduler_type="constant", optim="sgd", max_grad_norm=1e-3, save_strategy="no", disable_tqdm=True,
            gradient_accumulation_steps=args.accum, ddp_backend="gloo", seed=0,
        ),
        train_dataset=data, strategy=args.strategy, strategy_options=json.loads(args.options),
        callbacks=[deltas], loss_normalization="epoch",
    )  # fmt: skip
    trainer.train()
    norm = trainer.smart_batching.epoch_normalization
    rank = trainer.args.process_index
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "mean_targets": norm.mean_targets,
                "factors": norm.factors,
                "deltas": deltas.deltas,
                "steps": int(trainer.state.global_step),
                "lengths": [len(r) for r in rows],
            }
        )  # fmt: skip
    )
    # The DDP model (held by the trainer) goes before the process group: destroying a gloo group that a
    # live DDP reducer still holds can hang or abort (smart_batching.distributed.shutdown); this worker
    # kept its trainer and hung until the test's timeout twice, both times beside other tests (-n 2).
    del trainer, model, deltas
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
