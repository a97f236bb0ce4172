"""What TRL's fused LM head returns for a DPO batch, as TRL's ``DPOTrainer._compute_loss`` calls it: the
reference the DPO conformance tests (``tests/conformance/test_vs_trl_dpo.py``, ``tests/cuda/test_cuda_dpo.py``)
compare the library's packed log-probabilities with."""

from __future__ import annotations

import torch

NOT_MODEL_INPUTS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")


def fused_log_probs(model, batch) -> torch.Tensor:
    """Per-token log-probabilities of ``batch``'s completions under ``model`` (TRL's call, no gradient)."""
    kwargs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        return model(**kwargs, labels=labels, fused_lm_head=True, use_cache=False).log_probs
