"""One rank of TRL's ``GRPOTrainer`` on several processes (launched by torchrun from
``tests/conformance/test_vs_trl_grpo.py``): the same two-step run (gradient accumulation 2, dapo, prompts
repeated across ranks as TRL's sampler deals them) once with TRL alone and once per smart-batching layout
given in ``--layouts`` (``[strategy, options]``, or ``[strategy, options, config]`` with GRPOConfig settings
of its own), one after the other in the same process group. Writes ``{layout}_rank{N}.pt``: the log history,
the final weights, the smart-batching state's counts and the fallbacks warned about."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--layouts", default='{"trl": null, "packed": ["packed", {}]}')
    args = ap.parse_args()
    torch.set_num_threads(1)

    import datasets
    import grpo_setup as G
    import torch.distributed as dist
    import transformers

    from smart_batching.distributed import shutdown
    from smart_batching.fallbacks import recorded_fallbacks, reset_fallbacks
    from smart_batching.hf import apply_smart_batching

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    out = Path(args.out)
    data = G.prompts(8, words=6, seed=3)
    for name, layout in json.loads(args.layouts).items():
        config = {"loss_type": "dapo", **(layout[2] if layout and len(layout) > 2 else {})}
        trainer = G.grpo_trainer(args.model, data, max_steps=2, gradient_accumulation_steps=2,
                                 per_device_train_batch_size=4, **config)  # fmt: skip
        reset_fallbacks()
        if layout is not None and layout[0] is not None:  # [None, {}, config]: TRL alone with that config
            apply_smart_batching(trainer, layout[0], **layout[1])
        trainer.train()
        rank = dist.get_rank()
        state = getattr(trainer, "smart_batching", None)
        record = {
            "history": trainer.state.log_history,
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "forwards": getattr(state, "num_forwards", None),
            "balanced_steps": getattr(state, "balanced_steps", None),
            "balance_off": getattr(state, "balance_off", None),
            "imbalance": (state.step_imbalance_before, state.step_imbalance_after) if state else None,
            "rank_tokens": (state.rank_tokens_before, state.rank_tokens_after) if state else None,
            "fallbacks": recorded_fallbacks(),
        }
        torch.save(record, out / f"{name}_rank{rank}.pt")
        del trainer
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
