"""DPO on CUDA: packed pairs with a shared prompt give TRL's padded log-probabilities, loss and gradients.

Mirrors ``tests/conformance/test_vs_trl_dpo.py`` (``assert_same_training``) on the device: two TRL
``DPOTrainer`` on identical tiny Llamas (``examples/trl_dpo.py``: its word tokenizer is built in-process,
no assets), one alone, one with ``apply_smart_batching(trainer, "packed")`` (prompt shared by the chosen
and rejected completions in one row). On our first planned micro-batch and the same pairs collated by
TRL, the policy's and the reference model's per-token log-probabilities (TRL's fused LM head call) and
the DPO loss and gradients must agree: fp32 tight, bf16 autocast loose.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cuda_tier import to_device  # noqa: E402
from trl_logps import fused_log_probs  # noqa: E402

from smart_batching.fallbacks import recorded_fallbacks  # noqa: E402

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
# dtype: (log-prob atol, loss rtol, gradient bound relative to each gradient's largest entry)
TOLERANCE = {
    torch.float32: (1e-4, 1e-4, 1e-3),
    torch.bfloat16: (1.5e-1, 5e-2, 1.5e-1),
}  # CPU dry run bf16: 4e-3, 2e-5, 7e-3


def _example():
    spec = importlib.util.spec_from_file_location("trl_dpo_example_cuda", ROOT / "examples" / "trl_dpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trainer(ex, data, device):
    trainer = ex.dpo_trainer(data, use_cpu=device.type == "cpu", per_device_train_batch_size=4)
    trainer.model.to(device)
    trainer.ref_model.to(device)
    with torch.no_grad():  # the policy moves away from its reference: rewards and margins are not all 0
        generator = torch.Generator().manual_seed(1)
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(p.device))
    return trainer


def _step(trainer, batch):
    """TRL's compute_loss on ``batch``: the loss and the policy's gradients."""
    model = trainer.model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_shared_prompt_pairs_equal_trl_padded(device, dtype):
    pytest.importorskip("datasets", reason="the DPO check builds TRL's dataset with datasets")
    pytest.importorskip("trl", reason="the DPO check compares with TRL's DPOTrainer")
    from smart_batching.hf import apply_smart_batching
    from smart_batching.hf.dpo.collate import PACKED_PAIRS, PairCollator

    lp_atol, loss_rtol, grad_rtol = TOLERANCE[dtype]
    what = f"DPO packed (prompt shared), {dtype} on {device.type}"
    ex = _example()
    data = ex.preference_task(14, seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours, alone = _trainer(ex, data, device), _trainer(ex, data, device)
        apply_smart_batching(ours, "packed", capacity=200)
        batch = next(iter(ours.get_train_dataloader()))
    assert batch["input_ids"].shape[0] >= 2, f"{what}: the first micro-batch holds fewer than one pair"
    assert "shared_prefix_lengths" in batch[PACKED_PAIRS], f"{what}: the packed row does not share prompts"

    # The same pairs for TRL alone, found by their sequences (the task's prompts all differ).
    one = PairCollator(pad_token_id=0, layout="padded", max_length=None, truncation_mode="keep_end")

    def sequences(b, i):
        n = b["input_ids"].shape[0] // 2
        return tuple(tuple(b["input_ids"][r][b["attention_mask"][r] == 1].tolist()) for r in (i, n + i))

    where = {sequences(one([pair]), 0): k for k, pair in enumerate(ours.train_dataset)}
    indices = [where[sequences(batch, i)] for i in range(batch["input_ids"].shape[0] // 2)]
    theirs_batch = to_device(alone.data_collator([alone.train_dataset[i] for i in indices]), device)
    batch = to_device(batch, device)

    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for name in ("model", "ref_model"):
        with autocast:
            theirs_lp = fused_log_probs(getattr(alone, name), theirs_batch).float()
            ours_lp = fused_log_probs(getattr(ours, name), batch).float()
        assert ours_lp.shape == theirs_lp.shape, (
            f"{what}: {name} log-probs {ours_lp.shape} vs {theirs_lp.shape}"
        )
        assert bool((theirs_lp != 0).any())
        diff = (ours_lp - theirs_lp).abs().max().item()
        print(f"[cuda tier] {what}: {name} log-probs differ by {diff:.2e}")
        assert diff <= lp_atol, (
            f"{what}: {name} per-token log-probs differ from TRL's by {diff:.3e} (> {lp_atol})"
        )

    with autocast:
        theirs_loss, theirs_grads = _step(alone, theirs_batch)
        ours_loss, ours_grads = _step(ours, batch)
    loss_diff = abs(ours_loss - theirs_loss) / max(abs(theirs_loss), 1e-12)
    worst = max(
        ((ours_grads[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-12), n)
        for n, g in theirs_grads.items()
    )
    print(f"[cuda tier] {what}: fallbacks recorded {recorded_fallbacks()}")
    print(
        f"[cuda tier] {what}: loss {ours_loss:.6f} vs {theirs_loss:.6f}, gradients {worst[0]:.2e} ({worst[1]})"
    )
    assert loss_diff <= loss_rtol, (
        f"{what}: DPO loss {ours_loss} vs TRL's {theirs_loss} (relative {loss_diff:.2e})"
    )
    assert worst[0] <= grad_rtol, (
        f"{what}: gradient of {worst[1]} differs from TRL's by {worst[0]:.2e} of its largest entry (> {grad_rtol})"
    )
