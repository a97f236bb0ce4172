"""Under each precision a user trains in, our loss is TRL's loss.

Upstream: TRL ``SFTTrainer.compute_loss`` (its fused LM head, ``trl/trainer/utils.py::add_fused_lm_head``
and ``trl/kernels/chunked_logprob.py``), which ``apply_smart_batching`` replaces with the LM head fused
with our token loss (:mod:`smart_batching.hf.lm_head`). On the same packed batch, both are run

* in float32 (``bf16=False``),
* under bf16 autocast with float32 weights (TRL's default ``bf16=True``, as accelerate wraps the
  forward),
* with bf16 weights and no autocast (a model loaded with ``dtype=torch.bfloat16``),
* under bf16 autocast with activation checkpointing (TRL's ``SFTConfig`` defaults),

each on the three CPU half-precision paths (``cpu_half_path``: our products in bf16 on ``native``, in
float32 on ``emulated`` and ``reference``; on ``reference`` torch's oneDNN kernels are off too, so the
model's own bf16 products take ATen's reference GEMM, as on a CPU without AVX-512), and the loss, the
gradients and TRL's logged metrics are compared within the dtype's rounding: bf16 keeps 8 significant
bits (relative rounding 2**-9), and the two implementations round at different places (TRL's forward
tile is bf16 and its backward float32 on CPU; ours follow :func:`smart_batching.compat.matmul_dtype`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from smart_batching.hf import apply_smart_batching  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("trl_sft_example", ROOT / "examples" / "trl_sft.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)
TOKENIZER = EX.word_tokenizer()

pytestmark = pytest.mark.usefixtures("one_thread")

# setting -> (autocast, weights dtype, loss rtol, gradient tolerance as a fraction of the largest gradient
# entry). Measured on an AMD EPYC (AVX512-BF16): loss 1e-7 / 1e-7 / 1.3e-4 / 0 relative, gradients
# 4e-7 / 0.7% / 1.1% / 0 of the largest entry (fp32 / bf16 autocast / autocast on the reference GEMM /
# bf16 weights); bf16's own relative rounding is 2**-9.
PRECISIONS = {
    "fp32": (False, torch.float32, 1e-5, 1e-4),
    "bf16 autocast": (True, torch.float32, 4e-3, 0.03),
    "bf16 weights": (False, torch.bfloat16, 4e-3, 0.03),
}
# TRL's SFTConfig defaults: bf16 autocast and activation checkpointing (the layers recomputed in the
# backward pass, the LM head and loss not).
CHECKPOINTED = {"bf16 autocast, checkpointing (TRL's defaults)": (True, torch.float32, 4e-3, 0.03)}


def sft(tmp_path, bf16: bool):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=1, disable_tqdm=True,
        max_length=256, seed=0, per_device_train_batch_size=4, bf16=bf16, completion_only_loss=True,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(
            model=EX.tiny_llama(len(TOKENIZER)), args=args, train_dataset=EX.copy_task(24, seed=1),
            processing_class=TOKENIZER,
        )  # fmt: skip
        apply_smart_batching(trainer, "packed", capacity=256)
    return trainer


@pytest.mark.parametrize("setting", [*PRECISIONS, *CHECKPOINTED])
def test_our_loss_gradients_and_metrics_equal_trl_under_each_precision(
    tmp_path, monkeypatch, setting, cpu_half_path
):
    from trl import SFTTrainer

    from smart_batching import compat

    autocast, dtype, rtol, grad_tol = {**PRECISIONS, **CHECKPOINTED}[setting]
    if cpu_half_path == "reference":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    trainer = sft(tmp_path, bf16=autocast)
    assert trainer._target_logits_apply(trainer.model) and trainer.smart_batching.trl_metrics
    model = trainer.model
    with torch.no_grad():  # logits of a few units, as a trained model's, so that bf16 rounding shows
        model.lm_head.weight.mul_(40.0)
    model = model.to(dtype).train()
    if setting in CHECKPOINTED:
        assert trainer.args.gradient_checkpointing  # TRL's default, which Trainer applies in train()
        compat.enable_activation_checkpointing(model)
    batch = next(iter(trainer.get_train_dataloader()))
    n = (batch["labels"][..., 1:] != -100).sum()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def run(compute):
        model.zero_grad()
        trainer._metrics["train"].clear()
        trainer._total_train_tokens = 0
        with context:
            loss = compute(trainer, model, dict(batch), num_items_in_batch=n)
        loss.backward()
        grads = [p.grad.float().clone() for p in model.parameters()]
        return loss.detach().float(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}

    ours = run(type(trainer).compute_loss)
    assert trainer.smart_batching.fused_head is True  # the fused head, not the logits path, was compared
    half = autocast or dtype == torch.bfloat16
    assert trainer.smart_batching.precision["cpu_bf16"] == cpu_half_path
    fast = cpu_half_path == "native"  # else float32 products are faster
    assert trainer.smart_batching.precision["lm_head_matmul"] == ("bfloat16" if half and fast else "float32")
    theirs = run(SFTTrainer.compute_loss)
    torch.testing.assert_close(ours[0], theirs[0], rtol=rtol, atol=0.0)
    for a, b in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=grad_tol * max(float(b.abs().max()), 1e-6))
    assert ours[2].keys() == theirs[2].keys() == {"entropy", "mean_token_accuracy", "num_tokens"}
    np.testing.assert_allclose(ours[2]["entropy"], theirs[2]["entropy"], rtol=max(rtol, 1e-5))
    np.testing.assert_allclose(ours[2]["num_tokens"], theirs[2]["num_tokens"])
    # The argmax of logits that differ by rounding may differ on a near-tie: at most one token here.
    num = float(n)
    assert abs(ours[2]["mean_token_accuracy"][0] - theirs[2]["mean_token_accuracy"][0]) * num <= (
        0.5 if setting == "fp32" else 1.5
    )
