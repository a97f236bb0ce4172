"""Packed ("padding-free") attention for HuggingFace transformers models.

A packed batch puts several examples end to end in one row and gives no ``attention_mask``; the
boundaries travel as ``cu_seq_lens_q``/``cu_seq_lens_k`` (from :class:`~smart_batching.collate.PackingCollator`)
or as ``position_ids`` that restart at each example. :func:`packed_attention_forward` is registered in
transformers' ``AttentionInterface`` under ``"smart_batching_packed"`` and attends within each segment only::

    row (1, 7)       a0 a1 a2 b0 b1 c0 c1
    cu_seq_lens_q    [0, 3, 5, 7]
    computed as      sdpa(a0..a2)  +  sdpa([b0 b1], [c0 c1])   # equal lengths share one call

It never builds the dense ``(N, N)`` block-causal mask transformers' own sdpa/eager packed path builds.

Backends, chosen per call:

* CUDA, fp16/bf16: ``flash_attn.flash_attn_varlen_func`` when flash-attn is installed, else
  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9, no dropout), else the segment-wise path.
* Everywhere else (CPU, fp32, dropout without flash-attn): exact segment-wise SDPA. Segments of
  equal length are batched into one ``scaled_dot_product_attention`` call; many short segments cost
  one call per distinct length, not one per segment.

Calls the packed path cannot serve exactly (a padding ``attention_mask`` with zeros, decoding with a
KV cache, ``q_len != kv_len``) are delegated to transformers' own ``sdpa_attention_forward`` with the
mask transformers built, so a model switched to this implementation still runs padded batches and
``generate`` correctly.

Measured (``benchmarks/attention_speed.py``; x86_64 CPU, 2 threads, torch 2.13, transformers 5.23; tiny
Llama 256x4, one 2048-token row of 22 GSM8K-like examples): fwd+bwd 0.40 s, against 0.60 s for the
same examples padded (22 x 149, sdpa) and 0.85 s for transformers' own packed sdpa path (dense mask);
identical losses.

Use::

    from smart_batching.attention import enable_packed_attention
    enable_packed_attention(model)            # sets the implementation and use_cache=False
    model(**PackingCollator()(features))      # no attention_mask in the batch
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from smart_batching.errors import ConfigError

PACKED_ATTENTION = "smart_batching_packed"
"""Name of the packed implementation (auto backend) in transformers' ``AttentionInterface``."""

PACKED_ATTENTION_SDPA = "smart_batching_packed_sdpa"
"""Name of the packed implementation forced to the segment-wise SDPA backend (any device)."""

_IMPLEMENTATIONS = (PACKED_ATTENTION, PACKED_ATTENTION_SDPA)
# Implementations that attend within packed segments given cu_seq_lens or restarting position_ids.
_PACKED_AWARE = {*_IMPLEMENTATIONS, "flash_attention_2", "flash_attention_3", "flash_attention_4"}
# Implementations whose packing support goes through transformers' mask builder: position_ids only,
# and only with no attention_mask and no KV cache, and only for causal models.
_MASK_BASED = {"sdpa", "eager", "flex_attention"}


# --------------------------------------------------------------------------------------------------
# Segment plans
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SegmentPlan:
    """How to cut ``T`` flattened tokens into segments and batch equal-length segments together.

    ``groups`` holds one entry per distinct segment length ``L``: ``(L, index)`` where ``index`` is a
    ``(num_segments_of_length_L, L)`` long tensor of token positions, or, when the group is a single
    segment, its ``int`` start offset (sliced as a view, no gather). ``order`` lists, for each segment in
    token order, ``(group, member)`` so outputs can be put back in place with one ``torch.cat``.
    ``cu_seq_lens`` is the int32 ``(num_segments + 1,)`` offsets tensor varlen kernels take.
    """

    num_tokens: int
    lengths: tuple[int, ...]
    groups: tuple[tuple[int, torch.Tensor | int], ...]
    order: tuple[tuple[int, int], ...]
    max_length: int
    cu_seq_lens: torch.Tensor


def _plan_from_starts(starts: list[int], num_tokens: int, device: torch.device) -> _SegmentPlan:
    ends = starts[1:] + [num_tokens]
    lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    by_length: dict[int, list[int]] = {}
    for seg, length in enumerate(lengths):
        if length > 0:
            by_length.setdefault(length, []).append(seg)
    groups: list[tuple[int, torch.Tensor | int]] = []
    order: list[tuple[int, int] | None] = [None] * len(lengths)
    for length, segs in by_length.items():
        g = len(groups)
        if len(segs) == 1:
            groups.append((length, starts[segs[0]]))
        else:
            seg_starts = torch.tensor([starts[s] for s in segs], device=device, dtype=torch.long)
            # index: (num_segments_of_this_length, length)
            index = seg_starts[:, None] + torch.arange(length, device=device)
            groups.append((length, index))
        for member, seg in enumerate(segs):
            order[seg] = (g, member)
    return _SegmentPlan(
        num_tokens=num_tokens,
        lengths=tuple(lengths),
        groups=tuple(groups),
        order=tuple(o for o in order if o is not None),
        max_length=max(lengths, default=0),
        cu_seq_lens=torch.tensor([*starts, num_tokens], device=device, dtype=torch.int32),
    )


class _PlanCache:
    """Remembers the plan of the last boundary tensor seen, so the layers of one forward share it.

    Keyed by the tensor's identity (through a weak reference, so a freed tensor never matches) and
    its in-place version counter; every layer of a forward receives the same ``cu_seq_lens_q`` or
    ``position_ids`` object, so the host sync that turns boundaries into a plan happens once.
    """

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._key: tuple | None = None
        self._plan: _SegmentPlan | None = None

    def get(self, tensor: torch.Tensor, key: tuple) -> _SegmentPlan | None:
        if self._ref is not None and self._ref() is tensor and self._key == key:
            return self._plan
        return None

    def put(self, tensor: torch.Tensor, key: tuple, plan: _SegmentPlan) -> None:
        try:
            self._ref = weakref.ref(tensor)
        except TypeError:  # pragma: no cover - tensors support weak references
            self._ref = None
            return
        self._key, self._plan = key, plan


_PLAN_CACHE = _PlanCache()


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _plan_from_cu_seq_lens(cu: torch.Tensor, num_tokens: int, device: torch.device) -> _SegmentPlan:
    key = ("cu", cu._version, num_tokens, str(device))
    plan = None if _is_tracing() else _PLAN_CACHE.get(cu, key)
    if plan is None:
        bounds = [int(b) for b in cu.tolist()]
        if (
            bounds[0] != 0
            or bounds[-1] != num_tokens
            or any(b > a for a, b in zip(bounds[1:], bounds[:-1], strict=True))
        ):
            raise ConfigError(
                f"cu_seq_lens_q must rise from 0 to the number of tokens ({num_tokens}); got "
                f"{bounds[:8]}{'...' if len(bounds) > 8 else ''}. Build the batch with PackingCollator."
            )
        plan = _plan_from_starts(bounds[:-1], num_tokens, device)
        if not _is_tracing():
            _PLAN_CACHE.put(cu, key, plan)
    return plan


def segment_starts_from_position_ids(position_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Flattened start offsets of the segments that ``position_ids`` describe.

    A segment starts at the beginning of each row and wherever a position is not the previous one plus
    one (the rule transformers uses to detect packed ``position_ids``).

    Args:
        position_ids: ``(batch, seq)`` or ``(1, seq)`` (broadcast over the batch) token positions.
        batch_size: Rows in the batch.

    Returns:
        ``(num_segments,)`` long tensor of offsets into the flattened ``batch * seq`` tokens.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    position_ids = position_ids.expand(batch_size, -1)
    seq = position_ids.shape[1]
    flat = position_ids.reshape(-1)
    is_start = torch.ones_like(flat, dtype=torch.bool)
    is_start[1:] = flat[1:] != flat[:-1] + 1
    is_start[::seq] = True
    return is_start.nonzero().flatten()


def _plan_from_position_ids(
    position_ids: torch.Tensor, batch_size: int, device: torch.device
) -> _SegmentPlan:
    num_tokens = batch_size * position_ids.shape[-1]
    key = ("pos", position_ids._version, batch_size, str(device))
    plan = None if _is_tracing() else _PLAN_CACHE.get(position_ids, key)
    if plan is None:
        starts = segment_starts_from_position_ids(position_ids, batch_size).tolist()
        plan = _plan_from_starts(starts, num_tokens, device)
        if not _is_tracing():
            _PLAN_CACHE.put(position_ids, key, plan)
    return plan


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


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


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
    """Fused varlen kernel over ``(T, H, D)`` tokens, or ``None`` when none applies to this call."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != v.shape[-1]:
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
    if varlen is None or dropout > 0.0:  # torch's varlen kernel has no dropout
        return None
    try:
        return varlen(
            q,
            k,
            v,
            cu,
            cu,
            max_length,
            max_length,
            scale=scale,
            window_size=window_size,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    except (RuntimeError, ValueError, NotImplementedError):  # pragma: no cover - GPU/kernel dependent
        return None


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
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
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
    num_tokens = batch * q_len
    position_ids = kwargs.get("position_ids")
    attend = {"causal": causal, "window": window, "scale": scaling, "dropout": dropout}

    def flat(x: torch.Tensor) -> torch.Tensor:
        # (B, H, S, D) -> (B*S, H, D): the layout varlen kernels and segment gathers index into.
        return x.transpose(1, 2).reshape(num_tokens, x.shape[1], x.shape[-1])

    plan: _SegmentPlan | None = None
    if cu_q is not None:
        max_len = kwargs.get("max_length_q")
        if use_varlen and max_len is not None and query.is_cuda:
            # Trust the collator's boundaries: no host sync at all on this path.
            out = _varlen_attention(flat(query), flat(key), flat(value), cu_q, int(max_len), **attend)
            if out is not None:
                return out.reshape(batch, q_len, num_heads, -1), None
        plan = _plan_from_cu_seq_lens(cu_q, num_tokens, query.device)
        cu = cu_q
    elif position_ids is not None and position_ids.dim() <= 2:
        # 3-D multimodal RoPE positions (Qwen2-VL) do not mark boundaries: such models need cu_seq_lens_q.
        plan = _plan_from_position_ids(position_ids, batch, query.device)
        cu = plan.cu_seq_lens

    if plan is None or all(length == q_len for length in plan.lengths):
        # Not packed: each row is one sequence; plain SDPA on the original layout.
        out = _sdpa(query, key, value, **attend)
        return out.transpose(1, 2).contiguous(), None

    q, k, v = flat(query), flat(key), flat(value)
    if use_varlen and query.is_cuda:
        out = _varlen_attention(q, k, v, cu, plan.max_length, **attend)
        if out is not None:
            return out.reshape(batch, q_len, num_heads, -1), None
    out = _segment_attention(q, k, v, plan, **attend)
    return out.reshape(batch, q_len, num_heads, -1), None


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
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


# --------------------------------------------------------------------------------------------------
# Model switches and guards
# --------------------------------------------------------------------------------------------------


def register_packed_attention() -> None:
    """Register both packed implementations and their mask builder with transformers (idempotent)."""
    from smart_batching.errors import require

    transformers = require("transformers", "hf")
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    transformers.AttentionInterface.register(PACKED_ATTENTION_SDPA, packed_attention_forward_sdpa)
    for name in _IMPLEMENTATIONS:
        AttentionMaskInterface.register(name, packed_attention_mask)


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
    register_packed_attention()
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        raise ConfigError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "packed attention cannot be enabled; pack with attn_implementation='flash_attention_2' or use padding"
        )
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(names[backend])
    else:
        model.config._attn_implementation = names[backend]
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
