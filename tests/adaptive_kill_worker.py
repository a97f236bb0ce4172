"""A run with a batch schedule that saves a checkpoint every step (tests/test_adaptive_trainer.py).
Run as a script with ``--kill-at N`` it kills itself with SIGKILL right after saving checkpoint N (no
clean-up, as a preempted job dies); the test builds the same trainer in-process for the uninterrupted
and the resumed runs."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch


def make_trainer(out: Path, kill_at: int | None = None):
    from test_trainer import counting_dataset, tiny_llama, training_args
    from transformers import TrainerCallback

    from smart_batching.hf import SmartBatchingTrainer

    class KillAfterSave(TrainerCallback):
        def on_save(self, targs, state, control, **kwargs):
            if kill_at is not None and state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    return SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(
            out,
            num_train_epochs=2,
            max_steps=-1,
            save_strategy="steps",
            save_steps=1,
            lr_scheduler_type="linear",
            optim="adamw_torch",
        ),  # fmt: skip
        train_dataset=counting_dataset(40, seed=7),
        strategy="token_budget",
        strategy_options={"max_tokens": 160},
        batch_schedule="linear:80->400@60%",
        lr_scaling="sqrt",
        callbacks=[KillAfterSave()],
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--kill-at", type=int, required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    make_trainer(Path(args.out), args.kill_at).train()
    return 0  # not reached: the process is killed first


if __name__ == "__main__":
    raise SystemExit(main())
