"""What a training run computes in, and the warning where that precision is slow on this CPU.

TRL's ``SFTConfig`` turns on ``bf16=True`` (autocast) and activation checkpointing by default, on CPU
too. A bf16 matrix product is fast on CUDA and on CPUs with bf16 instructions (AVX512-BF16, AMX,
aarch64 BF16); without them torch runs it through oneDNN's float32 emulation (about 2x slower than
float32) or, on a CPU without AVX-512 (most AVX2 machines), through ATen's reference GEMM: 4x to 250x
slower than float32 depending on the operands' layout (measured on an AMD EPYC with oneDNN turned off,
1 thread: a (1024 x 256) @ (256 x 8192) product takes 6.4 s in bf16, 0.065 s in float32). Every
batching strategy pays that in the model's own layers, so it is said once, with the setting to change.
"""

from __future__ import annotations

from typing import Any

import torch

from smart_batching import compat
from smart_batching.fallbacks import warn_fallback

_SLOW = {
    "reference": (
        "its {name} matrix products take ATen's reference GEMM, 4x to 250x slower than float32 (torch has "
        "no oneDNN kernel for {name} here: a CPU without AVX-512, or torch.backends.mkldnn.enabled=False)"
    ),
    "emulated": (
        "oneDNN emulates {name} on this CPU, which has no {name} instructions (its matrix products run "
        "about 2x slower than float32)"
    ),
}


def dtype_name(dtype: Any) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"`` (None stays None), as records name dtypes."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def describe_precision(trainer: Any) -> dict[str, Any]:
    """The precision settings of a ``transformers.Trainer`` (or subclass), as benchmark records carry them.

    Returns:
        ``dtype`` (the model's parameters), ``autocast`` (the mixed-precision dtype, or None),
        ``checkpointing`` (activation checkpointing), ``device`` and, on CPU, ``cpu_bf16``: how this
        CPU runs bf16 matrix products (:func:`smart_batching.compat.cpu_half_matmul`), with
        ``cpu_bf16_forced: True`` where ``SMART_BATCHING_CPU_HALF`` forced it rather than the CPU.
    """
    model = trainer.model
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters()), None)
    device = trainer.args.device.type
    info: dict[str, Any] = {
        "dtype": dtype_name(dtype),
        "autocast": dtype_name(compat.trainer_autocast_dtype(trainer)),
        "checkpointing": compat.activation_checkpointing(trainer.args),
        "device": device,
    }
    if device == "cpu":
        info["cpu_bf16"] = compat.cpu_half_matmul(torch.bfloat16)
        if compat.forced_cpu_half() is not None:
            info["cpu_bf16_forced"] = True
    return info


def warn_slow_cpu_precision(trainer: Any, info: dict[str, Any]) -> str | None:
    """Warn once (:func:`~smart_batching.fallbacks.warn_fallback`, kind ``"precision.cpu_half"``) where the
    run multiplies in bf16 or fp16 on a CPU that has no instructions for it; return the CPU's support
    (``"emulated"`` / ``"reference"``), or None where the precision is fast."""
    if info.get("device") != "cpu":
        return None
    half = info.get("autocast") or info.get("dtype")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(half or "")
    if dtype is None:
        return None
    support = compat.cpu_half_matmul(dtype)
    if support not in _SLOW:
        return None
    flag = "bf16" if dtype is torch.bfloat16 else "fp16"
    forced = f" ({compat.CPU_HALF_ENV}={support})" if compat.forced_cpu_half() is not None else ""
    how = (
        f"{flag}=True (mixed precision)"
        if info.get("autocast")
        else f"the model's {half} weights (load it with dtype=torch.float32)"
    )
    fix = (
        f"set {flag}=False in SFTConfig / TrainingArguments (TRL's SFTConfig sets bf16=True by default)"
        if info.get("autocast")
        else "load the model in float32"
    )
    warn_fallback(
        "precision.cpu_half",
        f"training in {half} with {how} on this CPU{forced} is several times slower whatever the batching: "
        f"{_SLOW[support].format(name=half)}. To train faster here, {fix}. Smart batching runs its own "
        "matrix products (the fused LM head, packed attention) in float32 on this CPU.",
        stacklevel=4,
    )
    return support
