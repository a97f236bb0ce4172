"""Encoding with smart batching: sorted right-padded batches, or packed rows with no padding."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError, DataError, require
from smart_batching.inference._common import (
    POOLINGS,
    _check_int,
    _default_max_tokens,
    _plan_indices,
    _progress,
)
from smart_batching.inference._results import EncodeResult, EncodeStats
from smart_batching.planners import PackedSpec, plan_batches


def _max_positions(model: Any, tokenizer: Any) -> int:
    limits = [
        getattr(model.config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    limits = [int(x) for x in limits if isinstance(x, int | np.integer) and 0 < x < 1_000_000]
    return min(limits) if limits else 512


def _pool(hidden: Any, mask: Any, pooling: str) -> Any:
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (rows, seq, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def _model_accepts(model: Any, name: str) -> bool:
    from smart_batching.compat import forward_accepts

    return forward_accepts(model, name)


def encode(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_tokens: int | None = None,
    max_batch_size: int | None = None,
    max_length: int | None = None,
    pooling: str | None = "mean",
    normalize: bool = False,
    packed: bool = False,
    progress: bool = True,
) -> EncodeResult:
    """Encode texts with an encoder in token-budget batches of similar length.

    Args:
        model: A transformers encoder (``BertModel``, ``AutoModel``...) or, with ``pooling=None``, a model
            whose output has ``logits`` (e.g. ``BertForSequenceClassification``).
        tokenizer: Its tokenizer.
        texts: The texts.
        max_tokens: Padded tokens (rows × longest) per batch; with ``packed=True`` the tokens of one
            packed row. None: :data:`DEFAULT_MAX_TOKENS` for the model's device.
        max_batch_size: Most texts per batch; None means no limit.
        max_length: Texts are truncated to this many tokens; None means the model's position limit.
        pooling: ``"mean"`` (mean of the token states over the attention mask), ``"cls"`` (the first
            token's state) or None (the model's ``logits``).
        normalize: L2-normalise each output row.
        packed: Several texts per row with no padding, attention kept within each text
            (:func:`smart_batching.attention.enable_packed_attention`, switched on for the call and
            restored after). Needs ``pooling`` "mean" or "cls" and a model that takes ``position_ids``.

    Returns:
        :class:`EncodeResult` with ``(num_texts, dim)`` outputs in the order of ``texts``.
    """
    torch = require("torch", "hf")
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling={pooling!r} must be one of {POOLINGS}")
    _check_int("max_tokens", max_tokens, allow_none=True)
    _check_int("max_batch_size", max_batch_size, allow_none=True)
    _check_int("max_length", max_length, allow_none=True)
    if packed and pooling is None:
        raise ConfigError(
            "packed=True needs pooling='mean' or 'cls': a model head reads one token per row, not per text"
        )
    if packed and not _model_accepts(model, "position_ids"):
        raise ConfigError(
            f"packed=True: {type(model).__name__}.forward takes no position_ids; use packed=False"
        )
    if max_tokens is None:
        max_tokens = _default_max_tokens(model)
    limit = max_length if max_length is not None else _max_positions(model, tokenizer)
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise DataError("texts= must be a sequence of strings")

    start = time.perf_counter()
    ids = tokenizer(list(texts), truncation=True, max_length=limit)["input_ids"] if len(texts) else []
    n = len(ids)
    lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
    if n and lengths.min() == 0:
        raise DataError(f"text {int(np.argmin(lengths))} has no tokens; encoding needs at least one")
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    device = model.device
    accepts_types = _model_accepts(model, "token_type_ids")
    outputs: list[Any] = [None] * n
    real = int(lengths.sum())
    slots = 0
    if packed:
        capacity = max(int(max_tokens), int(lengths.max(initial=1)))
        # The fewest rows: nothing learns from these rows, so mixing lengths buys nothing here.
        plan = plan_batches(lengths, PackedSpec(capacity=capacity, shuffle=False, algorithm="auto"))
        batches = list(plan)
    else:
        batches = _plan_indices(np.arange(n), lengths, max_tokens, max_batch_size)
    restore = _enable_packed(model) if packed else None
    try:
        # no_grad, not inference_mode, when packed: the packed attention keys its plan cache on tensor
        # version counters, which inference tensors do not have.
        grad_off = torch.no_grad() if packed else torch.inference_mode()
        with _progress(n, "encoding", "text", progress) as bar, grad_off:
            for batch in batches:
                rows = [ids[i] for i in batch]
                if packed:
                    pooled = _encode_packed(model, rows, pooling, accepts_types)
                    slots += sum(len(r) for r in rows)
                else:
                    width = max(len(r) for r in rows)
                    arr = np.full((len(rows), width), pad_id, dtype=np.int64)
                    mask = np.zeros((len(rows), width), dtype=np.int64)
                    for k, r in enumerate(rows):
                        arr[k, : len(r)] = r
                        mask[k, : len(r)] = 1
                    slots += arr.size
                    t_mask = torch.from_numpy(mask).to(device)
                    inputs = {"input_ids": torch.from_numpy(arr).to(device), "attention_mask": t_mask}
                    if accepts_types:
                        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
                    out = model(**inputs)
                    if pooling is None:
                        pooled = getattr(out, "logits", None)
                        if pooled is None:
                            raise ConfigError(
                                f"pooling=None needs a model with logits; {type(model).__name__} has none"
                            )
                    else:
                        pooled = _pool(out.last_hidden_state, t_mask, pooling)
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled.float(), dim=-1).to(pooled.dtype)
                pooled = pooled.cpu()
                for k, i in enumerate(batch.tolist()):
                    outputs[i] = pooled[k]
                bar.update(len(batch))
    finally:
        if restore is not None:
            restore()
    embeddings = torch.stack(outputs) if n else torch.zeros(0)
    seconds = time.perf_counter() - start
    stats = EncodeStats(
        num_texts=n,
        num_batches=len(batches),
        seconds=seconds,
        real_tokens=real,
        token_slots=slots,
        padding_ratio=(slots - real) / slots if slots else 0.0,
        packed=packed,
        max_tokens=int(max_tokens),
    )
    return EncodeResult(embeddings, stats)


def _enable_packed(model: Any) -> Any:
    """Switch ``model`` to packed attention; returns a function that switches it back."""
    from smart_batching.attention import enable_packed_attention

    old_impl = model.config._attn_implementation
    old_cache = getattr(model.config, "use_cache", None)
    enable_packed_attention(model, backend="auto")

    def restore() -> None:
        from smart_batching.compat import set_attn_implementation

        set_attn_implementation(model, old_impl)
        if old_cache is not None:
            model.config.use_cache = old_cache

    return restore


def _encode_packed(model: Any, rows: list[list[int]], pooling: str, accepts_types: bool) -> Any:
    """One packed row of ``rows`` (no padding); returns ``(len(rows), dim)`` pooled states::

    input_ids     a0 a1 a2 b0 b1 c0 c1 c2 c3
    position_ids   0  1  2  0  1  0  1  2  3
    cu_seq_lens_q [0, 3, 5, 9]
    """
    import torch

    device = model.device
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)[None]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    starts = cu[:-1].long()
    pos = torch.arange(flat.shape[1]) - torch.repeat_interleave(starts, lens)  # (T,) restarts per text
    inputs: dict[str, Any] = {
        "input_ids": flat,
        "position_ids": pos[None].to(device),
        "cu_seq_lens_q": cu.to(device),
        "cu_seq_lens_k": cu.to(device),
        "max_length_q": int(lens.max()),
        "max_length_k": int(lens.max()),
    }
    if accepts_types:
        inputs["token_type_ids"] = torch.zeros_like(flat)
    hidden = model(**inputs).last_hidden_state[0]  # (T, dim)
    if pooling == "cls":
        return hidden[starts.to(device)]
    seg = torch.repeat_interleave(torch.arange(len(rows)), lens).to(device)  # (T,) text of each token
    sums = torch.zeros(len(rows), hidden.shape[-1], dtype=hidden.dtype, device=device).index_add_(
        0, seg, hidden
    )
    return sums / lens.to(device=device, dtype=hidden.dtype)[:, None]
