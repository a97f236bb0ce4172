"""Shared-prefix attention: a prompt and the completions that continue it, in one padding-free row.

A *group* is a prefix (the prompt) followed by its branches (for a preference pair: the chosen and the
rejected completion). Each branch attends to the prefix and to itself, never to another branch, with
the position ids it would have alone (every branch continues from the prefix's end); groups never
attend to each other. Two groups, the first a pair ``p | c | r``, the second ``q | d | e``::

    row                    p0 p1 p2 c0 c1 r0 r1 r2 q0 q1 d0 e0 e1
    position_ids           0  1  2  3  4  3  4  5  0  1  2  2  3
    shared_prefix_lengths  [[3, 2, 3], [2, 1, 2]]      (prefix tokens, then each branch's)

    mask of the first group (x: the query row attends the key column)
          p0 p1 p2 c0 c1 r0 r1 r2
      p0  x
      p1  x  x
      p2  x  x  x
      c0  x  x  x  x
      c1  x  x  x  x  x
      r0  x  x  x        x
      r1  x  x  x        x  x
      r2  x  x  x        x  x  x

Each query sees exactly the keys it sees in its own sequence (prefix + branch) run alone, at the same
positions, so the outputs equal those of the separate sequences up to floating-point summation order,
and the prefix is computed once instead of once per branch (arXiv 2410.20305, "Accelerating Direct
Preference Optimization with Prefix Sharing").

Computed without the dense ``(T, T)`` mask:

* the prefix and its first branch form one causal segment (``p c`` above): segment-wise SDPA, segments
  of equal length batched into one call (:func:`~smart_batching.attention._kernels._segment_attention`);
  on CUDA in half precision a varlen kernel (flash-attn or torch's) takes them all at once;
* every further branch is a block of queries over ``[prefix keys, its own keys]``, causal aligned to
  the end (query ``i`` sees the whole prefix and branch tokens ``0..i``): all of them in a few SDPA
  calls over padded blocks with an explicit boolean mask, the blocks bucketed by size so that padding
  stays under half of the work; on CUDA with flash-attn, one ``flash_attn_varlen_func`` call over the
  gathered prefix+branch keys (its causal mask is bottom-right aligned when queries are fewer than keys,
  which is this mask: the KV of the prefix is reused, not recomputed).

The layout travels as the ``shared_prefix_lengths`` keyword (int ``(num_groups, 1 + num_branches)``,
groups in row order, tiling the row) through the model's forward to the attention function
registered as ``"smart_batching_prefix_shared"``; calls without it go to
:func:`~smart_batching.attention.packed_attention_forward` (packed rows, padded batches, generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from smart_batching.attention._kernels import _flash_attn_varlen, _segment_attention, _varlen_attention
from smart_batching.attention._segments import _group_segments, _is_tracing, _PlanCache, _SegmentPlan
from smart_batching.attention.forward import _sliding_window, packed_attention_forward, packed_attention_mask
from smart_batching.errors import ConfigError

PREFIX_SHARED_ATTENTION = "smart_batching_prefix_shared"
"""Name of the shared-prefix implementation in transformers' ``AttentionInterface``."""

SHARED_PREFIX_KWARG = "shared_prefix_lengths"
"""The forward keyword that carries a row's groups: int ``(num_groups, 1 + num_branches)``."""

# Further-branch blocks are padded to their bucket's longest; a new bucket starts where padding would
# exceed this share of a bucket's work (query x key pairs).
_MAX_PADDING = 0.5


@dataclass(frozen=True)
class _SharedPlan:
    """Where every token of a shared-prefix row goes; built once per forward (cached by tensor).

    ``first`` plans the prefix + first-branch segments over the flattened row (their token positions
    in ``first_index``, in output order). ``blocks`` hold the further branches, one entry per bucket:
    ``(query_index (n, R), key_index (n, K), keep (n, R, K) bool, valid (n, R) bool)``. ``inverse``
    puts the concatenated outputs (first segments, then blocks' valid queries) back in row order.
    ``branch_*`` serve the flash-attn path: further-branch query positions, their keys'
    positions, and the int32 offsets of both.
    """

    num_tokens: int
    first: _SegmentPlan
    first_index: torch.Tensor
    blocks: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]
    block_positions: tuple[torch.Tensor, ...]
    inverse: torch.Tensor
    branch_query_index: torch.Tensor
    branch_key_index: torch.Tensor
    cu_branch_q: torch.Tensor
    cu_branch_k: torch.Tensor
    max_branch_q: int
    max_branch_k: int


def _segment_plan(starts: list[int], lengths: list[int], device: torch.device) -> _SegmentPlan:
    """A :class:`_SegmentPlan` over segments that need not tile the row (gaps are other tokens)."""
    groups, order = _group_segments(starts, lengths, device)
    kept = [length for length in lengths if length > 0]
    cu = torch.zeros(len(kept) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(kept, dtype=torch.int32).cumsum(0)
    return _SegmentPlan(
        num_tokens=sum(kept),
        lengths=tuple(kept),
        groups=groups,
        order=order,
        max_length=max(kept, default=0),
        cu_seq_lens=cu.to(device),
    )


def _buckets(key_lengths: list[int], query_lengths: list[int]) -> list[list[int]]:
    """Further branches grouped, longest keys first, so that each bucket's padded work stays within
    ``1 / (1 - _MAX_PADDING)`` of its real work."""
    order = sorted(range(len(key_lengths)), key=lambda e: (-key_lengths[e], -query_lengths[e]))
    buckets: list[list[int]] = []
    real = 0
    for e in order:
        if buckets:
            members = buckets[-1] + [e]
            longest_q = max(query_lengths[m] for m in members)
            padded = len(members) * longest_q * key_lengths[buckets[-1][0]]
            if real + query_lengths[e] * key_lengths[e] >= (1 - _MAX_PADDING) * padded:
                buckets[-1].append(e)
                real += query_lengths[e] * key_lengths[e]
                continue
        buckets.append([e])
        real = query_lengths[e] * key_lengths[e]
    return buckets


def build_shared_plan(lengths: list[list[int]], num_tokens: int, device: torch.device) -> _SharedPlan:
    """Plan a row of groups ``[prefix, branch_1, ..., branch_k]`` (token counts, in row order).

    Raises:
        ConfigError: the groups do not tile the row's ``num_tokens`` tokens.
    """
    total = sum(sum(g) for g in lengths)
    if total != num_tokens or any(min(g, default=0) < 0 or len(g) < 2 for g in lengths):
        raise ConfigError(
            f"shared_prefix_lengths must hold [prefix, branch, ...] token counts (>= 0) that add up to the "
            f"row's {num_tokens} tokens; they add up to {total}. Build the batch with the packed pair collator"
        )
    first_starts, first_lengths = [], []
    queries: list[tuple[int, int, int, int]] = []  # (prefix start, prefix length, branch start, length)
    offset = 0
    for group in lengths:
        prefix, branches = group[0], group[1:]
        first_starts.append(offset)
        first_lengths.append(prefix + branches[0])
        start = offset + prefix + branches[0]
        for length in branches[1:]:
            if length > 0:
                queries.append((offset, prefix, start, length))
            start += length
        offset = start
    first = _segment_plan(first_starts, first_lengths, device)
    first_index = torch.cat(
        [torch.arange(s, s + n) for s, n in zip(first_starts, first_lengths, strict=True) if n > 0]
        or [torch.zeros(0, dtype=torch.long)]
    )

    key_lengths = [p + r for _, p, _, r in queries]
    query_lengths = [r for *_, r in queries]
    blocks, block_positions = [], []
    for bucket in _buckets(key_lengths, query_lengths):
        n, longest_q, longest_k = (
            len(bucket),
            max(query_lengths[e] for e in bucket),
            max(key_lengths[e] for e in bucket),
        )
        i = torch.arange(longest_q)[:, None]  # (R, 1) query offset within its branch
        j = torch.arange(longest_k)[None, :]  # (1, K) key slot: prefix first, then the branch
        q_index = torch.zeros(n, longest_q, dtype=torch.long)
        k_index = torch.zeros(n, longest_k, dtype=torch.long)
        keep = torch.zeros(n, longest_q, longest_k, dtype=torch.bool)
        valid = torch.zeros(n, longest_q, dtype=torch.bool)
        positions = torch.zeros(n, longest_q, dtype=torch.long)  # logical position of each query
        for m, e in enumerate(bucket):
            p_start, p, b_start, r = queries[e]
            q_index[m, :r] = torch.arange(b_start, b_start + r)
            k_index[m, :p] = torch.arange(p_start, p_start + p)
            k_index[m, p : p + r] = torch.arange(b_start, b_start + r)
            keep[m] = (j < p) | ((j >= p) & (j - p <= i) & (j < p + r))
            keep[m, r:] = False
            keep[m, r:, 0] = True  # padded queries attend one key (no NaN); their outputs are dropped
            valid[m, :r] = True
            positions[m, :r] = torch.arange(p, p + r)
        blocks.append((q_index.to(device), k_index.to(device), keep.to(device), valid.to(device)))
        block_positions.append(positions.to(device))

    branch_index = (
        torch.cat([q[v] for q, _, _, v in blocks])
        if blocks
        else torch.zeros(0, dtype=torch.long, device=device)
    )
    inverse = torch.empty(num_tokens, dtype=torch.long)
    inverse[first_index] = torch.arange(first_index.numel())
    inverse[branch_index.cpu()] = torch.arange(branch_index.numel()) + first_index.numel()

    key_index = [torch.cat([torch.arange(ps, ps + p), torch.arange(bs, bs + r)]) for ps, p, bs, r in queries]
    cu_q = torch.zeros(len(queries) + 1, dtype=torch.int32)
    cu_k = torch.zeros(len(queries) + 1, dtype=torch.int32)
    if queries:
        cu_q[1:] = torch.tensor(query_lengths, dtype=torch.int32).cumsum(0)
        cu_k[1:] = torch.tensor(key_lengths, dtype=torch.int32).cumsum(0)
    return _SharedPlan(
        num_tokens=num_tokens,
        first=first,
        first_index=first_index.to(device),
        blocks=tuple(blocks),
        block_positions=tuple(block_positions),
        inverse=inverse.to(device),
        branch_query_index=torch.cat(
            [torch.arange(bs, bs + r) for _, _, bs, r in queries] or [torch.zeros(0, dtype=torch.long)]
        ).to(device),
        branch_key_index=torch.cat(key_index or [torch.zeros(0, dtype=torch.long)]).to(device),
        cu_branch_q=cu_q.to(device),
        cu_branch_k=cu_k.to(device),
        max_branch_q=max(query_lengths, default=0),
        max_branch_k=max(key_lengths, default=0),
    )


_SHARED_PLANS = _PlanCache()


def shared_plan(lengths: torch.Tensor, num_tokens: int, device: torch.device) -> _SharedPlan:
    """The plan of ``shared_prefix_lengths``, cached for the layers of one forward (one host sync)."""
    key = ("shared", lengths._version, num_tokens, str(device))
    plan = None if _is_tracing() else _SHARED_PLANS.get(lengths, key)
    if plan is None:
        if lengths.dim() != 2:
            raise ConfigError(
                f"shared_prefix_lengths must be (num_groups, 1 + num_branches); got shape {tuple(lengths.shape)}"
            )
        plan = build_shared_plan(lengths.tolist(), num_tokens, device)
        if not _is_tracing():
            _SHARED_PLANS.put(lengths, key, plan)
    return plan  # type: ignore[return-value]


def _masked_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    *,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """SDPA over ``(n, H, R, D)`` queries and ``(n, Hkv, K, D)`` keys with a ``(n, 1, R, K)`` bool mask."""
    n_rep = q.shape[1] // k.shape[1]
    gqa = n_rep > 1
    if gqa and q.is_cuda:  # CUDA's fused kernels take enable_gqa only without a mask
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )


def shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: _SharedPlan,
    *,
    window: int | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """Exact attention over flattened ``(T, H, D)`` tokens laid out as :class:`_SharedPlan` says;
    returns ``(T, Hq, Dv)``. ``window``: transformers' causal sliding window (a query sees itself and
    ``window - 1`` earlier positions), counted on the position ids each branch has alone."""
    attend = {"causal": True, "window": window, "scale": scale, "dropout": dropout}
    out = _flash_shared(q, k, v, plan, **attend) if q.is_cuda else None
    if out is not None:
        return out
    first = _segment_attention(q, k, v, plan.first, **attend) if plan.first.num_tokens else q[:0]
    pieces = [first]
    for (q_index, k_index, keep, valid), positions in zip(plan.blocks, plan.block_positions, strict=True):
        mask = keep
        if window is not None:
            keys = torch.arange(k_index.shape[1], device=q.device)  # a key slot is its position
            mask = keep & (keys[None, None, :] > positions[:, :, None] - window)
            mask[:, :, 0] |= ~valid  # padded queries keep their one key
        qb = q[q_index].transpose(1, 2)  # (n, H, R, D)
        kb = k[k_index].transpose(1, 2)  # (n, Hkv, K, D)
        vb = v[k_index].transpose(1, 2)
        out = _masked_sdpa(qb, kb, vb, mask[:, None], scale=scale, dropout=dropout)
        pieces.append(out.transpose(1, 2)[valid])  # (valid queries, H, Dv)
    return torch.cat(pieces, dim=0)[plan.inverse]


def _flash_shared(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: _SharedPlan,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor | None:
    """The CUDA path: varlen kernels for the first segments and, with flash-attn, for the further branches
    over their gathered prefix+branch keys (bottom-right causal). None where it does not apply (then
    SDPA runs, exact; the first such call warns)."""
    fa = _flash_attn_varlen()
    if fa is None or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] != v.shape[-1]:
        from smart_batching.fallbacks import warn_fallback

        warn_fallback(
            "attention.prefix_sharing",
            "shared-prefix attention runs with SDPA over masked blocks (exact, slower) instead of "
            "flash-attn's varlen kernel, because flash-attn is not installed or attention does not run in "
            "float16/bfloat16: pip install flash-attn and train with bf16=True",
            stacklevel=6,
        )
        return None
    idx = plan.first_index
    first = _varlen_attention(
        q[idx], k[idx], v[idx], plan.first.cu_seq_lens, plan.first.max_length,
        causal=causal, window=window, scale=scale, dropout=dropout,
    )  # fmt: skip
    if first is None:
        return None
    pieces = [first]
    if plan.branch_query_index.numel():
        kv = plan.branch_key_index
        window_size = (-1, 0) if window is None else (window - 1, 0)
        pieces.append(
            fa(
                q[plan.branch_query_index],
                k[kv],
                v[kv],
                cu_seqlens_q=plan.cu_branch_q,
                cu_seqlens_k=plan.cu_branch_k,
                max_seqlen_q=plan.max_branch_q,
                max_seqlen_k=plan.max_branch_k,
                dropout_p=dropout,
                softmax_scale=scale,
                causal=True,
                window_size=window_size,
            )  # fmt: skip
        )
    return torch.cat(pieces, dim=0)[plan.inverse]


def prefix_shared_attention_forward(
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
    """Shared-prefix attention; transformers' attention signature (registered as
    ``"smart_batching_prefix_shared"``).

    With ``shared_prefix_lengths`` in ``kwargs`` the row is laid out as the module docstring draws;
    without it the call is :func:`~smart_batching.attention.packed_attention_forward`'s (packed rows
    by ``cu_seq_lens_q``, padded batches, decoding).

    Args:
        module: The attention module (read for ``is_causal`` and ``sliding_window``).
        query: ``(1, num_heads, T, head_dim)``: one flattened row.
        key, value: ``(1, num_kv_heads, T, head_dim)``.
        attention_mask: None (the row has no padding).
        dropout, scaling, is_causal: as transformers passes them.
        **kwargs: ``shared_prefix_lengths`` (int ``(num_groups, 1 + num_branches)``), ``sliding_window``.

    Raises:
        ConfigError: a padding mask, a KV cache, several rows, a non-causal module, softcapping or sinks
            together with ``shared_prefix_lengths``.
    """
    lengths = kwargs.get(SHARED_PREFIX_KWARG)
    if lengths is None:
        return packed_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    batch, num_heads, q_len, _ = query.shape
    problems = []
    if attention_mask is not None or key.shape[2] != q_len:
        problems.append("a padding attention_mask or a KV cache reached it (set use_cache=False, no mask)")
    if batch != 1:
        problems.append(f"the batch has {batch} rows (one flattened row expected)")
    if not causal:
        problems.append(f"{type(module).__name__} is not causal")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        problems.append(f"{type(module).__name__} uses attention softcapping or sinks")
    if problems:
        raise ConfigError(
            "shared-prefix attention cannot run this call: "
            + "; ".join(problems)
            + ". Use prompt_sharing=False "
            "or a padded strategy for this model"
        )
    plan = shared_plan(lengths, q_len, query.device)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x[0].transpose(0, 1)  # (1, H, T, D) -> (T, H, D)

    out = shared_prefix_attention(
        flat(query), flat(key), flat(value), plan, window=_sliding_window(module, kwargs), scale=scaling,
        dropout=dropout,
    )  # fmt: skip
    return out[None], None


def register_prefix_shared_attention() -> None:
    """Register :func:`prefix_shared_attention_forward` and its mask builder with transformers."""
    from smart_batching import compat
    from smart_batching.attention.guard import register_packed_attention

    register_packed_attention()  # calls without the layout go to the packed implementation
    compat.register_attention(PREFIX_SHARED_ATTENTION, prefix_shared_attention_forward)
    compat.register_attention_mask(PREFIX_SHARED_ATTENTION, packed_attention_mask)


def enable_prefix_shared_attention(model: Any) -> Any:
    """Switch a loaded transformers model to shared-prefix attention and turn its KV cache off.

    Raises:
        ConfigError: a model that cannot change its attention implementation.
    """
    from smart_batching import compat

    register_prefix_shared_attention()
    if getattr(model, "config", None) is None or not compat.can_set_attn_implementation(model):
        raise ConfigError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, so "
            "shared-prefix attention cannot be enabled: use prompt_sharing=False with flash attention, or a "
            "padded strategy"
        )
    compat.set_attn_implementation(model, PREFIX_SHARED_ATTENTION)
    model.config.use_cache = False
    return model


__all__ = [
    "PREFIX_SHARED_ATTENTION",
    "SHARED_PREFIX_KWARG",
    "build_shared_plan",
    "enable_prefix_shared_attention",
    "prefix_shared_attention_forward",
    "register_prefix_shared_attention",
    "shared_plan",
    "shared_prefix_attention",
]
