"""The attention functions registered in transformers: packed forward (auto backend, forced SDPA) and the dense mask."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from smart_batching import compat
from smart_batching.attention._kernels import _sdpa, _segment_attention, _varlen_attention
from smart_batching.attention._names import PACKED_ATTENTION
from smart_batching.attention._segments import _plan_from_cu_seq_lens, _plan_from_position_ids, _SegmentPlan
from smart_batching.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------------


def _sliding_window(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> int | None:
    window = (
        kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    )
    if window is None:
        return None
    window = int(window)
    return window if window > 0 else None


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    use_varlen: bool,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    cu_q = kwargs.get("cu_seq_lens_q")
    cu_k = kwargs.get("cu_seq_lens_k")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise ConfigError(
            f"{type(module).__name__} uses attention softcapping or sinks, which {PACKED_ATTENTION!r} does not "
            "implement: load the model with attn_implementation='flash_attention_2' (or 'eager') instead"
        )
    batch, num_heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if attention_mask is not None or q_len != k_len:
        if cu_q is not None:
            raise ConfigError(
                "a packed batch (cu_seq_lens_q given) reached the model together with a padding attention_mask "
                "or a KV cache: drop attention_mask from the batch and set model.config.use_cache=False "
                "(enable_packed_attention(model) does the latter)"
            )
        from smart_batching.compat import sdpa_attention_forward

        return sdpa_attention_forward()(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    if cu_q is not None and cu_k is not None and cu_k is not cu_q:
        # Shapes compare without a device sync; values only where that is free (CPU).
        same = cu_k.shape == cu_q.shape and (cu_q.is_cuda or torch.equal(cu_k.to(cu_q.device), cu_q))
        if not same:
            raise ConfigError("cu_seq_lens_k must equal cu_seq_lens_q for packed self-attention")

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _sliding_window(module, kwargs)
    attend = {"causal": causal, "window": window, "scale": scaling, "dropout": dropout}
    # The dtype attention runs in: autocast's where it is on (as SDPA and transformers' flash-attention
    # path take it; under autocast RoPE hands over query and key in float32, value in bf16), else the
    # inputs'. float32 instead where this CPU has no instructions for bf16/fp16 products (SDPA's bf16
    # GEMMs would take ATen's reference kernel, 4x slower). Each input is cast once per call, in the copy
    # the layout change makes anyway, and the kernels run with autocast off: autocast would otherwise
    # cast every segment's slices again, forward and backward. The output is in the dtype SDPA would
    # return (``wanted``).
    device = query.device.type
    autocast = torch.is_autocast_enabled(device)
    wanted = compat.autocast_dtype(device, query.dtype)
    work = compat.matmul_dtype(device, wanted)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        out = _attend(query, key, value, work, use_varlen, cu_q, kwargs, attend)
    # Contiguous as transformers' attention functions return it (a model may .view the output).
    return out.to(wanted).contiguous(), None


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    work: torch.dtype,
    use_varlen: bool,
    cu_q: torch.Tensor | None,
    kwargs: dict[str, Any],
    attend: dict[str, Any],
) -> torch.Tensor:
    """Packed attention of ``(B, H, S, D)`` inputs in ``work``; returns ``(B, S, H, Dv)``."""
    batch, num_heads, q_len, _ = query.shape
    num_tokens = batch * q_len
    position_ids = kwargs.get("position_ids")

    def flat(x: torch.Tensor) -> torch.Tensor:
        # (B, H, S, D) -> (B*S, H, D): the layout varlen kernels and segment gathers index into.
        x = x.transpose(1, 2)
        if x.dtype != work:
            x = x.to(work, memory_format=torch.contiguous_format)
        return x.reshape(num_tokens, x.shape[2], x.shape[-1])

    plan: _SegmentPlan | None = None
    if cu_q is not None:
        max_len = kwargs.get("max_length_q")
        if use_varlen and max_len is not None and query.is_cuda:
            # Trust the collator's boundaries: no host sync at all on this path.
            out = _varlen_attention(flat(query), flat(key), flat(value), cu_q, int(max_len), **attend)
            if out is not None:
                return out.reshape(batch, q_len, num_heads, -1)
        plan = _plan_from_cu_seq_lens(cu_q, num_tokens, query.device)
        cu = cu_q
    elif position_ids is not None and position_ids.dim() <= 2:
        # 3-D multimodal RoPE positions (Qwen2-VL) do not mark boundaries: such models need cu_seq_lens_q.
        plan = _plan_from_position_ids(position_ids, batch, query.device)
        cu = plan.cu_seq_lens

    if plan is None or all(length == q_len for length in plan.lengths):
        # Not packed: each row is one sequence; plain SDPA on the original layout.
        out = _sdpa(query.to(work), key.to(work), value.to(work), **attend)
        return out.transpose(1, 2)

    q, k, v = flat(query), flat(key), flat(value)
    if use_varlen and query.is_cuda:
        out = _varlen_attention(q, k, v, cu, plan.max_length, **attend)
        if out is not None:
            return out.reshape(batch, q_len, num_heads, -1)
    out = _segment_attention(q, k, v, plan, **attend)
    return out.reshape(batch, q_len, num_heads, -1)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention that never crosses packed example boundaries; transformers' attention signature.

    Registered as ``"smart_batching_packed"``. Boundaries come from ``cu_seq_lens_q`` (preferred, as
    :class:`~smart_batching.collate.PackingCollator` returns them) or from ``position_ids`` that restart
    (a position that is not the previous plus one starts a new segment); with neither, each row is one
    sequence.

    Args:
        module: The attention module; read for ``is_causal`` and ``sliding_window`` when not passed.
        query: ``(batch, num_heads, seq, head_dim)``.
        key: ``(batch, num_kv_heads, seq, head_dim)``; GQA when ``num_kv_heads < num_heads``.
        value: ``(batch, num_kv_heads, seq, v_head_dim)``.
        attention_mask: ``None`` for packed or unpadded batches. A 4-D mask (what transformers builds for
            padded batches or a KV cache through this implementation's mask function) sends the call to
            transformers' ``sdpa_attention_forward``.
        dropout: Attention dropout probability (transformers passes 0 in eval mode).
        scaling: Softmax scale; ``None`` means ``head_dim ** -0.5``.
        is_causal: Overrides ``module.is_causal``; encoders (BERT) are non-causal.
        **kwargs: ``cu_seq_lens_q``/``cu_seq_lens_k`` (int32 ``(num_segments + 1,)`` offsets into the
            flattened ``batch * seq`` tokens), ``max_length_q``, ``position_ids`` (2-D; multimodal 3-D
            positions are not read, so pack such models with ``cu_seq_lens_q``), ``sliding_window``
            (tokens, transformers' convention: a causal query sees itself and ``sliding_window - 1``
            earlier tokens); others are ignored.

    Returns:
        ``(attn_output, None)`` with ``attn_output`` of shape ``(batch, seq, num_heads, v_head_dim)``.

    Raises:
        ConfigError: ``cu_seq_lens_q`` together with a padding mask or a KV cache, or a model using
            softcapping/attention sinks.
    """
    return _packed_attention(
        module, query, key, value, attention_mask, dropout, scaling, is_causal, use_varlen=True, kwargs=kwargs
    )


def packed_attention_forward_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """:func:`packed_attention_forward` restricted to segment-wise SDPA (no fused varlen kernel).

    Registered as ``"smart_batching_packed_sdpa"``: for debugging or bitwise comparisons on GPU.
    """
    return _packed_attention(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout,
        scaling,
        is_causal,
        use_varlen=False,
        kwargs=kwargs,
    )


def packed_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """Mask builder paired with the packed implementation in transformers' ``AttentionMaskInterface``.

    Returns ``None`` (no mask, O(1) memory) when the call is self-attention over the whole input without
    padding: the attention function then finds segments itself. Otherwise (padding, KV cache) it
    returns what transformers' ``sdpa_mask`` builds, and the attention function delegates to sdpa.
    """
    no_offset = not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0
    if no_offset and q_length == kv_length and (attention_mask is None or bool(attention_mask.all())):
        return None
    from smart_batching.compat import sdpa_mask

    return sdpa_mask()(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )
