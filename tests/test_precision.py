"""Training under TRL's defaults (bf16 autocast, activation checkpointing): the precision is recorded,
a CPU that multiplies bf16 slowly is named once with the setting to change, and the fused LM head gives
the loss and gradients of the logits path in the same precision."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_target_logits import prompt_dataset, sgd_args, tiny_llama  # noqa: E402

from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402
from smart_batching.hf import SmartBatchingTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(tmp_path, name: str, **args):
    return SmartBatchingTrainer(
        model=tiny_llama(), args=sgd_args(tmp_path / name, **args), train_dataset=prompt_dataset(),
        strategy="packed", strategy_options={"capacity": 192},
    )  # fmt: skip


def test_bf16_on_a_cpu_without_bf16_kernels_is_said_once_with_the_setting_to_change(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # the reference GEMM, as on an AVX2 CPU
    with pytest.warns(FallbackWarning, match=r"set bf16=False in SFTConfig / TrainingArguments") as seen:
        first = trainer(tmp_path, "a", bf16=True)
        trainer(tmp_path, "b", bf16=True)
    assert sum(w.category is FallbackWarning for w in seen) == 1
    assert "reference GEMM" in str(seen[0].message)
    assert recorded_fallbacks() == {"precision.cpu_half": 2}
    assert first.smart_batching.precision == {
        "dtype": "float32", "autocast": "bfloat16", "checkpointing": False, "device": "cpu",
        "cpu_bf16": "reference",
    }  # fmt: skip
    # bf16 weights without autocast: the same warning names the model's dtype instead.
    from smart_batching.fallbacks import reset_fallbacks

    reset_fallbacks()
    model = tiny_llama().to(torch.bfloat16)
    with pytest.warns(FallbackWarning, match="load the model in float32"):
        SmartBatchingTrainer(
            model=model, args=sgd_args(tmp_path / "c"), train_dataset=prompt_dataset(), strategy="packed",
            strategy_options={"capacity": 192},
        )  # fmt: skip


def test_float32_or_a_cpu_with_bf16_kernels_is_no_warning(tmp_path, recwarn):
    plain = trainer(tmp_path, "fp32")
    assert plain.smart_batching.precision["autocast"] is None
    from smart_batching import compat

    native = compat.cpu_half_matmul(torch.bfloat16) in ("native", "unknown")
    mixed = trainer(tmp_path, "bf16", bf16=True)
    assert mixed.smart_batching.precision["autocast"] == "bfloat16"
    warned = [w for w in recwarn if w.category is FallbackWarning]
    assert (not warned) if native else len(warned) == 1


@pytest.mark.parametrize("onednn", [True, False], ids=["cpu bf16 kernels", "reference GEMM"])
def test_bf16_with_checkpointing_fused_head_equals_the_logits_path(tmp_path, monkeypatch, onednn):
    """One SGD step under bf16 autocast and activation checkpointing: the fused LM head (its products in
    bf16, or float32 on the reference GEMM) against the logits path at the target positions
    (``target_logits_only`` with the head unfused), in the same precision."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", onednn)
    from smart_batching import compat
    from smart_batching.hf.loss import TokenLossMixin

    def run(fused: bool):
        model = tiny_llama()
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        t = SmartBatchingTrainer(
            model=model, args=sgd_args(tmp_path / f"run-{fused}", bf16=True, **{compat.checkpointing_argument(): True}),
            train_dataset=prompt_dataset(), strategy="packed", strategy_options={"capacity": 192},
        )  # fmt: skip
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(TokenLossMixin, "_fused_head", lambda self, model: None)
            loss = float(t.train().training_loss)
        return t, loss, {k: before[k] - v.detach() for k, v in model.named_parameters()}

    fused, loss, grads = run(True)
    _, ref_loss, ref_grads = run(False)
    assert fused.smart_batching.fused_head is True
    assert fused.smart_batching.precision["checkpointing"] is True
    support = fused.smart_batching.precision["cpu_bf16"]
    assert fused.smart_batching.precision["lm_head_matmul"] == (
        "bfloat16" if support == "native" else "float32"
    )
    assert abs(loss - ref_loss) <= 4e-3 * abs(ref_loss)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-3  # a real update was compared
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) <= 0.03 * scale
