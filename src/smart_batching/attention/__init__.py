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

Modules: ``_segments`` (segment plans from ``cu_seq_lens`` or ``position_ids``, cached), ``_kernels``
(segment-wise SDPA and the CUDA varlen kernels), ``forward`` (the functions registered in
transformers), ``guard`` (switching a model over, and refusing a model or batch that would leak),
``prefix_sharing`` (a prompt shared by several completions in one row: DPO pairs).
"""

from smart_batching.attention._kernels import _segment_attention  # noqa: F401 (tests)
from smart_batching.attention._names import PACKED_ATTENTION, PACKED_ATTENTION_SDPA
from smart_batching.attention._segments import (  # noqa: F401 (_plan_from_starts: tests)
    _plan_from_starts,
    segment_starts_from_position_ids,
)
from smart_batching.attention.forward import (
    packed_attention_forward,
    packed_attention_forward_sdpa,
    packed_attention_mask,
)
from smart_batching.attention.guard import (
    check_packed_batch,
    enable_packed_attention,
    install_packed_guard,
    is_packed_batch,
    register_packed_attention,
)
from smart_batching.attention.prefix_sharing import (
    PREFIX_SHARED_ATTENTION,
    enable_prefix_shared_attention,
    prefix_shared_attention_forward,
)

__all__ = [
    "PACKED_ATTENTION",
    "PACKED_ATTENTION_SDPA",
    "PREFIX_SHARED_ATTENTION",
    "check_packed_batch",
    "enable_packed_attention",
    "enable_prefix_shared_attention",
    "install_packed_guard",
    "is_packed_batch",
    "packed_attention_forward",
    "packed_attention_forward_sdpa",
    "packed_attention_mask",
    "prefix_shared_attention_forward",
    "register_packed_attention",
    "segment_starts_from_position_ids",
]
