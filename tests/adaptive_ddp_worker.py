"""One rank of adaptive-batching runs on several processes (launched by torchrun from
tests/test_adaptive_distributed.py): a tiny Llama trained by SmartBatchingTrainer once per entry of
``--runs`` (a JSON list of ``{"oom_backoff", "batch_schedule", "accum", "stream"}``, run one after the other in
the same process group, which saves a launch per run; ``"budget_of": i`` starts the back-off at the
budget run ``i`` ended with). Writes ``run{i}_rank{N}.pt``: the final weights,
the back-off state and each micro-batch's tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--strategy", default="token_budget")
    ap.add_argument("--options", default='{"max_tokens": 256}')
    ap.add_argument("--runs", default="[{}]", help="JSON list of {oom_backoff, batch_schedule}")
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)

    import datasets
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    from smart_batching.distributed import shutdown
    from smart_batching.hf import SmartBatchingTrainer, make_collator

    rng = np.random.default_rng(0)
    rows = [rng.integers(3, 250, size=int(n)).tolist() for n in rng.integers(6, 90, size=120)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = datasets.Dataset.from_dict({"input_ids": rows})
    budgets: list[int | None] = []
    for i, run in enumerate(json.loads(args.runs)):
        backoff = run.get("oom_backoff")
        if "budget_of" in run:
            backoff = {**(backoff or {}), "max_tokens": budgets[run["budget_of"]]}
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        use_cache=False)
        )  # fmt: skip
        tokens: list[int] = []
        marks: list[int] = []  # micro-batches collated by the end of each optimizer step
        inner = make_collator(args.strategy, pad_token_id=0)

        class Mark(TrainerCallback):
            def on_step_end(self, targs, state, control, tokens=tokens, marks=marks, **kwargs):
                marks.append(len(tokens))

        def collate(features, inner=inner, tokens=tokens):
            tokens.append(sum(len(f["input_ids"]) for f in features))
            return inner(features)

        trainer = SmartBatchingTrainer(
            model=model,
            args=TrainingArguments(
                output_dir=str(out / "trainer"), use_cpu=True, ddp_backend="gloo", max_steps=args.max_steps,
                gradient_accumulation_steps=run.get("accum", args.accum), learning_rate=3e-3, lr_scheduler_type="constant",
                report_to=[], save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True,
            ),
            train_dataset=data.to_iterable_dataset(num_shards=4) if run.get("stream") else data,
            data_collator=collate,
            strategy=args.strategy,
            strategy_options=json.loads(args.options),
            oom_backoff=backoff,
            batch_schedule=run.get("batch_schedule"),
            callbacks=[Mark()],
        )  # fmt: skip
        trainer.train()
        rank = trainer.args.process_index
        state = trainer.smart_batching.backoff_state
        budgets.append(state.budget if state is not None else None)
        stepped = None
        if trainer.smart_batching.batch_schedule is not None and trainer.smart_batching.sampler is not None:
            sp = trainer.smart_batching.sampler.stepped_plan(0)
            stepped = {
                "micro_per_step": sp.micro_per_step.tolist(),
                "targets": sp.step_targets.tolist(),
                "rank_step_tokens": sp.rank_step_tokens.tolist(),
                "longest": int(np.max(sp.base.seg_lengths)),
            }
        torch.save(
            {
                "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                "global_step": trainer.state.global_step,
                "backoff": state.state_dict() if state is not None else None,
                "tokens": tokens,
                "marks": marks,
                "stepped": stepped,
            },
            out / f"run{i}_rank{rank}.pt",
        )
    del trainer
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
