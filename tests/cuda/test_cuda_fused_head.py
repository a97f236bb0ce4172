"""The fused LM head on CUDA: the token loss without logits equals the loss of the full logits.

As ``tests/test_target_logits.py`` on CPU: a tiny Llama's head runs fused with the loss
(:class:`~smart_batching.hf.lm_head.FusedHead`, as ``SmartBatchingTrainer.compute_loss`` calls it: only at
the target positions, ``logits_to_keep``) and the model's full logits give the reference loss
(:func:`~smart_batching.loss.token_loss_sum`). Loss and every parameter's gradient must agree, in fp32
(tight) and under bf16 autocast (loose: the head's products round to bf16 on both sides, in chunks on ours).
The chunk is made small so that several chunks run, as on a long row with a large vocabulary.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cuda_tier import to_device  # noqa: E402

from smart_batching import compat  # noqa: E402
from smart_batching import loss as loss_module  # noqa: E402
from smart_batching.attention import enable_packed_attention  # noqa: E402
from smart_batching.collate import PackingCollator  # noqa: E402
from smart_batching.hf.lm_head import FusedHead  # noqa: E402
from smart_batching.loss import kept_targets, target_positions, token_loss_sum  # noqa: E402

pytestmark = pytest.mark.cuda

VOCAB = 512
LENGTHS = [60, 33, 90, 17, 48]
# (loss rtol, gradient bound relative to each gradient's largest entry)
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (5e-3, 8e-2)}  # CPU dry run: 2e-6 and 9e-3 (bf16)


def _model(device: torch.device):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    return enable_packed_attention(transformers.LlamaForCausalLM(config).to(device).train())


def _batch(device: torch.device) -> dict:
    """One packed row; the first third of each example is prompt (no target)."""
    gen = torch.Generator().manual_seed(2)
    examples = [torch.randint(1, VOCAB, (n,), generator=gen) for n in LENGTHS]
    batch = PackingCollator(return_seq_idx=False)([{"input_ids": x} for x in examples])
    start = 0
    for n in LENGTHS:
        batch["labels"][0, start : start + n // 3] = -100
        start += n
    return to_device(batch, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_head_loss_and_gradients_equal_full_logits(device, dtype, monkeypatch):
    monkeypatch.setattr(loss_module, "_CHUNK_LOGITS", 64 * VOCAB)  # several chunks (CPU dry run)
    monkeypatch.setattr(loss_module, "_CHUNK_LOGITS_ACCELERATOR", 64 * VOCAB)  # several chunks (CUDA)
    loss_rtol, grad_rtol = TOLERANCE[dtype]
    what = f"fused LM head, {dtype} on {device.type}"
    model = _model(device)
    batch = _batch(device)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    labels = batch["labels"]
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    with autocast:
        reference = token_loss_sum(model(**inputs).logits, labels)
    reference.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    head, reason = compat.plain_lm_head(model)
    assert head is not None, f"{what}: the Llama head is not fused: {reason}"
    keep = target_positions(labels)
    assert 0 < len(keep) < labels.shape[1] * 0.8  # the head skips the prompts
    with autocast, FusedHead(head, kept_targets(labels, keep)) as fused:
        outputs = model(**inputs, logits_to_keep=keep)
    result = fused.loss(outputs)
    assert result is not None, f"{what}: the forward did not return the fused loss: {fused.reason}"
    total = result[0]
    if dtype == torch.bfloat16 and device.type == "cuda":
        assert fused.matmul_dtype == torch.bfloat16, f"{what}: the head multiplied in {fused.matmul_dtype}"
    total.backward()
    total, reference = float(total.detach()), float(reference.detach())
    loss_diff = abs(total - reference) / abs(reference)
    assert loss_diff <= loss_rtol, (
        f"{what}: loss {total:.6f} vs {reference:.6f} from full logits, relative {loss_diff:.2e} "
        f"(> {loss_rtol})"
    )
    worst = max(
        ((p.grad - ref_grads[n]).abs().max().item() / max(ref_grads[n].abs().max().item(), 1e-12), n)
        for n, p in model.named_parameters()
    )
    print(f"[cuda tier] {what}: loss relative {loss_diff:.2e}, gradients {worst[0]:.2e} ({worst[1]})")
    assert worst[0] <= grad_rtol, (
        f"{what}: gradient of {worst[1]} differs from the full-logits gradient by {worst[0]:.2e} of its "
        f"largest entry (> {grad_rtol})"
    )
