"""One rank of TRL's ``GRPOTrainer`` on several processes (launched by torchrun from
``tests/conformance/test_vs_trl_grpo.py``): the same two-step run (gradient accumulation 2, dapo, prompts
repeated across ranks as TRL's sampler deals them) once with TRL alone and once per smart-batching layout
given in ``--layouts``, one after the other in the same process group. Writes ``{layout}_rank{N}.pt``: the
log history and the final weights."""

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
    from smart_batching.hf import apply_smart_batching

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    out = Path(args.out)
    data = G.prompts(8, words=6, seed=3)
    for name, layout in json.loads(args.layouts).items():
        trainer = G.grpo_trainer(args.model, data, max_steps=2, gradient_accumulation_steps=2,
                                 per_device_train_batch_size=4, loss_type="dapo")  # fmt: skip
        if layout is not None:
            apply_smart_batching(trainer, layout[0], **layout[1])
        trainer.train()
        rank = dist.get_rank()
        record = {
            "history": trainer.state.log_history,
            "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            "forwards": getattr(getattr(trainer, "smart_batching", None), "num_forwards", None),
        }
        torch.save(record, out / f"{name}_rank{rank}.pt")
        del trainer
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
