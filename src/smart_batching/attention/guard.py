"""Switching a model to packed attention, and refusing a model or batch that would leak across examples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from smart_batching.attention._names import (
    _IMPLEMENTATIONS,
    _MASK_BASED,
    _PACKED_AWARE,
    PACKED_ATTENTION,
    PACKED_ATTENTION_SDPA,
)
from smart_batching.attention.forward import (
    packed_attention_forward,
    packed_attention_forward_sdpa,
    packed_attention_mask,
)
from smart_batching.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Model switches and guards
# --------------------------------------------------------------------------------------------------


def register_packed_attention() -> None:
    """Register both packed implementations and their mask builder with transformers (idempotent)."""
    from smart_batching import compat
    from smart_batching.errors import require

    require("transformers", "hf")
    compat.register_attention(PACKED_ATTENTION, packed_attention_forward)
    compat.register_attention(PACKED_ATTENTION_SDPA, packed_attention_forward_sdpa)
    for name in _IMPLEMENTATIONS:
        compat.register_attention_mask(name, packed_attention_mask)


def enable_packed_attention(model: Any, *, backend: str = "auto") -> Any:
    """Switch a loaded transformers model to packed attention and turn its KV cache off.

    Args:
        model: A ``PreTrainedModel`` whose attention goes through ``AttentionInterface`` (Llama, Qwen2,
            Mistral, GPT-2, BERT and most models in transformers 5).
        backend: ``"auto"`` (flash-attn / torch varlen kernels on CUDA half precision, segment-wise SDPA
            elsewhere) or ``"sdpa"`` (segment-wise SDPA always).

    Returns:
        The same model, modified in place: ``config._attn_implementation`` is ``"smart_batching_packed"``
        (or ``"smart_batching_packed_sdpa"``) and ``config.use_cache`` is ``False``.

    Raises:
        ConfigError: unknown ``backend``, or a model that cannot change its attention implementation.
    """
    names = {"auto": PACKED_ATTENTION, "sdpa": PACKED_ATTENTION_SDPA}
    if backend not in names:
        raise ConfigError(f"backend={backend!r} is not one of {sorted(names)}")
    from smart_batching import compat

    register_packed_attention()
    if not compat.can_set_attn_implementation(model):
        raise ConfigError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "packed attention cannot be enabled; pack with attn_implementation='flash_attention_2' or use padding"
        )
    compat.set_attn_implementation(model, names[backend])
    model.config.use_cache = False
    return model


def _row_restarts(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether any row restarts its positions between two consecutive real (unmasked) tokens."""
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    jump = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if attention_mask is not None and attention_mask.dim() == 2:
        real = attention_mask.bool()
        jump = jump & real[:, 1:] & real[:, :-1]
    return bool(jump.any())


def _has_noncausal_self_attention(model: Any) -> bool:
    for module in model.modules():
        if "Attention" in type(module).__name__ and isinstance(getattr(module, "is_causal", None), bool):
            if getattr(module, "is_cross_attention", False):
                continue
            return not module.is_causal
    return not getattr(model.config, "is_causal", True)


def is_packed_batch(batch: Mapping[str, Any]) -> bool:
    """Whether a batch packs several examples per row (``cu_seq_lens_q`` or restarting ``position_ids``)."""
    if batch.get("cu_seq_lens_q") is not None or batch.get("cu_seq_lens_k") is not None:
        return True
    position_ids = batch.get("position_ids")
    if position_ids is None:
        return False
    return _row_restarts(torch.as_tensor(position_ids), _as_mask(batch.get("attention_mask")))


def _as_mask(mask: Any) -> torch.Tensor | None:
    return None if mask is None else torch.as_tensor(mask)


def check_packed_batch(model: Any, batch: Mapping[str, Any]) -> None:
    """Refuse a packed batch that ``model`` would attend across example boundaries.

    A batch is packed when it carries ``cu_seq_lens_q`` or ``position_ids`` that restart between two
    real tokens. transformers 5 keeps packed examples apart only in these cases:

    * ``smart_batching_packed`` or ``flash_attention_*``: with no padding ``attention_mask`` (an
      all-ones mask is harmless);
    * ``sdpa``/``eager``/``flex_attention``: causal models only, with ``position_ids`` in the batch,
      no ``attention_mask`` at all, and the KV cache off (``use_cache=False``); transformers then
      builds a dense ``N x N`` block-causal mask, correct but slow. Encoders (BERT) never.

    Non-packed batches always pass.

    Args:
        model: A transformers model.
        batch: The keyword arguments about to be passed to ``model(**batch)``.

    Raises:
        ConfigError: the batch would leak attention across examples; the message says what to change.
    """
    config = model.config
    impl = getattr(config, "_attn_implementation", None) or "eager"
    mask = _as_mask(batch.get("attention_mask"))
    if impl in _PACKED_AWARE and mask is None:
        return  # safe whatever the batch holds; skip the (device-syncing) packing check
    if not is_packed_batch(batch):
        return
    has_padding = mask is not None and not bool(mask.bool().all())
    fix = f"call smart_batching.attention.enable_packed_attention(model) (attention {PACKED_ATTENTION!r})"

    if impl in _PACKED_AWARE:
        if has_padding:
            raise ConfigError(
                f"a packed batch carries an attention_mask with padding; attention {impl!r} cannot combine "
                "both: drop attention_mask from the batch (use PackingCollator) or do not pack"
            )
        return
    if impl in _MASK_BASED:
        reasons = []
        encoder = _has_noncausal_self_attention(model)
        if encoder:
            reasons.append(
                f"{type(model).__name__} is an encoder (non-causal): transformers ignores packed position_ids"
            )
        if mask is not None:
            reasons.append(
                "the batch has an attention_mask, which turns off transformers' packed-sequence detection"
            )
        use_cache = batch.get("use_cache")
        if use_cache is None:
            use_cache = getattr(config, "use_cache", False) and not (
                getattr(model, "gradient_checkpointing", False) and model.training
            )
        if use_cache and not encoder:
            reasons.append("use_cache=True creates a KV cache, which turns off packed-sequence detection")
        if batch.get("position_ids") is None:
            reasons.append("the batch has cu_seq_lens but no position_ids, which sdpa/eager ignore")
        if reasons:
            alternative = (
                ""
                if encoder
                else ", or pass position_ids without attention_mask and set model.config.use_cache=False "
                "(transformers' own, dense-mask packed path)"
            )
            raise ConfigError(
                f"packed examples would attend to each other with attention {impl!r}: "
                + "; ".join(reasons)
                + f". Fix: {fix}{alternative}"
            )
        return
    # Unknown custom implementations: we cannot tell; trust the user.


def install_packed_guard(model: Any) -> torch.utils.hooks.RemovableHandle:
    """Run :func:`check_packed_batch` before every forward of ``model`` (e.g. under ``Trainer``).

    Returns:
        The hook handle; ``handle.remove()`` uninstalls the guard.
    """

    def _hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        check_packed_batch(module, kwargs)

    return model.register_forward_pre_hook(_hook, with_kwargs=True)
