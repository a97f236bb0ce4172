"""Attention within segments: segment-wise SDPA (exact, any device) and varlen kernels (CUDA)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from smart_batching import compat
from smart_batching.attention._segments import _SegmentPlan

# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


def _window_mask(length: int, window: int, causal: bool, device: torch.device) -> torch.Tensor:
    """``(length, length)`` bool mask, True where a query (row) may attend to a key (column)."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    if causal:
        # transformers' sliding_window_overlay: kv_idx > q_idx - sliding_window
        return (k <= q) & (k > q - window)
    # transformers' sliding_window_bidirectional_overlay: |q - kv| <= sliding_window
    return (q - k).abs() <= window


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """SDPA over ``(n, H, L, D)`` tensors with no padding; returns ``(n, Hq, L, Dv)``."""
    length = q.shape[2]
    mask = None
    if window is not None and (length > window if causal else length > window + 1):
        mask = _window_mask(length, window, causal, q.device)
    n_rep = q.shape[1] // k.shape[1]
    gqa = n_rep > 1
    if gqa and mask is not None and q.is_cuda:
        # CUDA's fused kernels take enable_gqa only without a mask (as transformers' use_gqa_in_sdpa);
        # on CPU enable_gqa measured 15-25% faster than repeating K/V, mask or not.
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=causal and mask is None,
        scale=scale,
        enable_gqa=gqa,
    )


def _segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: _SegmentPlan,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """Exact attention within segments of flattened ``(T, H, D)`` tokens; returns ``(T, Hq, Dv)``."""
    outs: list[torch.Tensor] = []
    for length, where in plan.groups:
        if isinstance(where, int):
            # One segment: views, no gather.  (1, H, L, D)
            qg = q[where : where + length].transpose(0, 1)[None]
            kg = k[where : where + length].transpose(0, 1)[None]
            vg = v[where : where + length].transpose(0, 1)[None]
        else:
            # (n, L, H, D) -> (n, H, L, D)
            qg = q[where].transpose(1, 2)
            kg = k[where].transpose(1, 2)
            vg = v[where].transpose(1, 2)
        out = _sdpa(qg, kg, vg, causal=causal, window=window, scale=scale, dropout=dropout)
        outs.append(out.transpose(1, 2))  # (n, L, Hq, Dv)
    if len(outs) == 1 and len(plan.order) == outs[0].shape[0]:
        return outs[0].reshape(plan.num_tokens, *outs[0].shape[2:])
    pieces = [outs[g][m] for g, m in plan.order]
    return torch.cat(pieces, dim=0)


@functools.cache
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _torch_varlen():
    return compat.torch_varlen_attn()


def _varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_length: int,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor | None:
    """Fused varlen kernel over ``(T, H, D)`` tokens, or ``None`` when none applies to this call.

    Off CUDA, ``None`` is the documented path (segment-wise SDPA). On CUDA it is a fallback: the first
    one of each process warns with the reason (:func:`~smart_batching.fallbacks.warn_fallback`).
    """
    if not q.is_cuda:
        return None
    reason = varlen_unavailable_reason(
        q.dtype,
        same_head_dim=q.shape[-1] == v.shape[-1],
        dropout=dropout,
        has_flash_attn=_flash_attn_varlen() is not None,
        has_torch_varlen=_torch_varlen() is not None,
    )
    if reason is not None:
        _warn_varlen(reason)
        return None
    cu = cu.to(device=q.device, dtype=torch.int32)
    if window is None:
        window_size = (-1, 0) if causal else (-1, -1)
    else:
        # flash-attn windows are inclusive token counts on each side (transformers uses the same mapping)
        window_size = (window - 1, 0) if causal else (window, window)
    fa = _flash_attn_varlen()
    if fa is not None:
        return fa(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=max_length,
            max_seqlen_k=max_length,
            dropout_p=dropout,
            softmax_scale=scale,
            causal=causal,
            window_size=window_size,
        )
    varlen = _torch_varlen()
    assert varlen is not None  # varlen_unavailable_reason said one kernel applies
    kwargs, repeat_kv, refused = compat.torch_varlen_call(
        window_size=window_size, scale=scale, head_dim=q.shape[-1], gqa=q.shape[1] != k.shape[1]
    )
    if refused is not None:
        _warn_varlen(refused)
        return None
    if repeat_kv:
        # torch < 2.12 takes no enable_gqa: the same result with the key/value heads repeated
        n_rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    try:
        return varlen(q, k, v, cu, cu, max_length, max_length, **kwargs)
    except (
        RuntimeError,
        ValueError,
        NotImplementedError,
        TypeError,
    ) as e:  # pragma: no cover - GPU dependent
        _warn_varlen(f"torch's varlen kernel refused this call ({type(e).__name__}: {e})")
        return None


def varlen_unavailable_reason(
    dtype: torch.dtype, *, same_head_dim: bool, dropout: float, has_flash_attn: bool, has_torch_varlen: bool
) -> str | None:
    """Why no fused varlen kernel can run a packed CUDA attention call; None if one can.

    Args:
        dtype: The query's dtype (the kernels take float16 and bfloat16 only).
        same_head_dim: Whether query and value heads have one size (MLA-style attention has not).
        dropout: Attention dropout probability (torch's varlen kernel has none).
        has_flash_attn: Whether ``flash_attn.flash_attn_varlen_func`` imports.
        has_torch_varlen: Whether ``torch.nn.attention.varlen.varlen_attn`` imports.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return (
            f"the fused varlen kernels take float16/bfloat16 and attention runs in {dtype}: load the model "
            "with dtype=torch.bfloat16 or train with bf16=True"
        )
    if not same_head_dim:
        return "query and value heads differ in size, which the varlen kernels do not take"
    if not has_flash_attn and not has_torch_varlen:
        return "neither flash-attn nor torch.nn.attention.varlen is available: pip install flash-attn"
    if not has_flash_attn and dropout > 0.0:
        return "torch's varlen kernel has no dropout: set attention_dropout=0.0 or pip install flash-attn"
    return None


def _warn_varlen(reason: str) -> None:
    from smart_batching.fallbacks import warn_fallback

    warn_fallback(
        "attention.varlen",
        f"packed attention runs segment by segment with SDPA (exact, slower) instead of a fused varlen "
        f"kernel, because {reason}",
        stacklevel=5,
    )
