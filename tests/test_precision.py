"""Training under TRL's defaults (bf16 autocast, activation checkpointing): the precision is recorded,
a CPU that multiplies bf16 slowly is named once with the setting to change, and the fused LM head gives
the loss and gradients of the logits path in the same precision."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

from test_target_logits import prompt_dataset, sgd_args, tiny_llama  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402
from smart_batching.hf import SmartBatchingTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(tmp_path, name: str, **args):
    return SmartBatchingTrainer(
        model=tiny_llama(), args=sgd_args(tmp_path / name, **args), train_dataset=prompt_dataset(),
        strategy="packed", strategy_options={"capacity": 192},
    )  # fmt: skip


@pytest.mark.parametrize("cpu_half_path", ["emulated", "reference"], indirect=True)
def test_bf16_on_a_cpu_without_bf16_kernels_is_said_once_with_the_setting_to_change(
    tmp_path, monkeypatch, cpu_half_path
):
    if cpu_half_path == "reference":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # torch's reference GEMM too, as on AVX2
    with pytest.warns(FallbackWarning, match=r"set bf16=False in SFTConfig / TrainingArguments") as seen:
        first = trainer(tmp_path, "a", bf16=True)
        trainer(tmp_path, "b", bf16=True)
    assert sum(w.category is FallbackWarning for w in seen) == 1
    reason = {"reference": "reference GEMM", "emulated": "oneDNN emulates bfloat16"}[cpu_half_path]
    assert reason in str(seen[0].message) and f"SMART_BATCHING_CPU_HALF={cpu_half_path}" in str(
        seen[0].message
    )
    assert recorded_fallbacks() == {"precision.cpu_half": 2}
    assert first.smart_batching.precision == {
        "dtype": "float32", "autocast": "bfloat16", "checkpointing": False, "device": "cpu",
        "cpu_bf16": cpu_half_path, "cpu_bf16_forced": True,
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


def test_float32_never_warns_and_bf16_warns_only_off_the_native_path(tmp_path, recwarn, cpu_half_path):
    plain = trainer(tmp_path, "fp32")
    assert plain.smart_batching.precision["autocast"] is None
    assert not [w for w in recwarn if w.category is FallbackWarning]
    mixed = trainer(tmp_path, "bf16", bf16=True)
    assert mixed.smart_batching.precision["autocast"] == "bfloat16"
    assert mixed.smart_batching.precision["cpu_bf16"] == cpu_half_path
    warned = [str(w.message) for w in recwarn if w.category is FallbackWarning]
    if cpu_half_path == "native":
        assert not warned and recorded_fallbacks() == {}
    else:
        assert len(warned) == 1 and "set bf16=False" in warned[0]
        assert recorded_fallbacks() == {"precision.cpu_half": 1}


def test_bf16_with_checkpointing_fused_head_equals_the_logits_path(tmp_path, monkeypatch, cpu_half_path):
    """One SGD step under bf16 autocast and activation checkpointing: the fused LM head (its products in
    bf16 on the native path, else float32) against the logits path at the target positions
    (``target_logits_only`` with the head unfused), in the same precision. On the reference path torch's
    own bf16 products take the reference GEMM too (oneDNN off)."""
    if cpu_half_path == "reference":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
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
    assert fused.smart_batching.precision["cpu_bf16"] == cpu_half_path
    assert fused.smart_batching.precision["lm_head_matmul"] == (
        "bfloat16" if cpu_half_path == "native" else "float32"
    )
    assert abs(loss - ref_loss) <= 4e-3 * abs(ref_loss)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-3  # a real update was compared
    assert max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads) <= 0.03 * scale


class _Casts(TorchDispatchMode):
    """Counts dtype casts (``aten._to_copy`` with a dtype) of 4-D tensors: attention's (B, H, S, D)
    and (B, S, H, D) operands and their gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") not in (None, args[0].dtype):
            self.count += args[0].dim() == 4
        return func(*args, **kwargs)


def test_checkpointed_bf16_packed_step_casts_per_layer_not_per_segment(monkeypatch, cpu_half_path):
    """Under bf16 autocast with activation checkpointing, a packed forward and backward casts attention's
    operands once per layer call, whether it multiplies in bf16 (native path) or float32: as many casts
    for a row of 16 examples as for a row of 4 (autocast inside each segment's SDPA would cast every
    segment's slices, forward, recompute and backward); the segment plan is built once per step, not
    again when checkpointing recomputes the layers."""
    from smart_batching.attention import _segments, enable_packed_attention
    from smart_batching.collate import PackingCollator

    builds = []
    build = _segments._plan_from_starts
    monkeypatch.setattr(_segments, "_plan_from_starts", lambda *a, **k: builds.append(1) or build(*a, **k))
    from smart_batching import compat

    model = enable_packed_attention(tiny_llama()).train()
    compat.enable_activation_checkpointing(model)
    calls = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
    rng = torch.Generator().manual_seed(0)

    def step(lengths: list[int]) -> int:
        batch = PackingCollator(return_seq_idx=False)(
            [{"input_ids": torch.randint(1, 300, (n,), generator=rng).tolist()} for n in lengths]
        )
        batch.pop("labels", None)
        model.zero_grad()
        with _Casts() as casts:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(**batch).logits
            logits.float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in model.model.layers.parameters())
        return casts.count

    few = step([61, 53, 44, 34])
    many = step([5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 6, 4, 27])  # 192 tokens too
    assert few == many > 0
    assert len(builds) == 2  # one plan per step
    assert len(calls) == 2 * 2 * len(model.model.layers)  # each step: forward, and the recompute


def test_fused_head_runs_once_per_step_outside_the_checkpointed_layers(tmp_path, cpu_half_path):
    """SmartBatchingTrainer under TRL's defaults (bf16 autocast, activation checkpointing): the LM head
    fused with the loss runs once per micro-batch (never recomputed), the decoder layers twice (forward
    and checkpointing's recompute), and the segment plan is built once per micro-batch."""
    from smart_batching import compat
    from smart_batching.attention import _segments

    builds = []
    build = _segments._plan_from_starts

    def counting(*args, **kwargs):
        builds.append(1)
        return build(*args, **kwargs)

    model = tiny_llama()
    head, layers = [], []
    model.lm_head.register_forward_hook(lambda *_: head.append(1))
    model.model.layers[0].self_attn.register_forward_hook(
        lambda *_: layers.append(1)
    )  # inside the checkpoint
    t = SmartBatchingTrainer(
        model=model, args=sgd_args(tmp_path, bf16=True, max_steps=2, **{compat.checkpointing_argument(): True}),
        train_dataset=prompt_dataset(), strategy="packed", strategy_options={"capacity": 192},
    )  # fmt: skip
    _segments._plan_from_starts = counting
    try:
        t.train()
    finally:
        _segments._plan_from_starts = build
    micro_batches = 2 * t.args.gradient_accumulation_steps
    assert t.smart_batching.fused_head is True and t.smart_batching.precision["checkpointing"] is True
    assert len(head) == micro_batches
    assert len(layers) == 2 * micro_batches
    assert len(builds) == micro_batches


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16 autocast"])
def test_packed_attention_output_dtype_and_layout_are_sdpas(autocast, cpu_half_path):
    """Packed attention returns what transformers' ``sdpa_attention_forward`` returns for the same call
    (contiguous, autocast's dtype under autocast), for an unpacked batch and a packed row; under autocast
    its inputs come as a model's do: query and key float32 (out of RoPE), value bf16."""
    import contextlib

    from smart_batching import compat
    from smart_batching.attention.forward import packed_attention_forward

    class Attention(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2  # GQA: 4 query heads, 2 key/value heads

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 10, 8, generator=g) for h in (4, 2, 2))
    if autocast:
        v = v.bfloat16()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    packed = {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]] * 2)}
    with context:
        theirs, _ = compat.sdpa_attention_forward()(Attention(), q, k, v, None, is_causal=True)
        for kwargs in ({}, packed):
            ours, _ = packed_attention_forward(Attention(), q, k, v, None, **kwargs)
            assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.is_contiguous()
        same, _ = packed_attention_forward(Attention(), q, k, v, None)
    tol = 1e-2 if autocast else 1e-5
    torch.testing.assert_close(same.float(), theirs.float(), rtol=tol, atol=tol)
