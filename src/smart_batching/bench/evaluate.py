"""Held-out evaluation, identical for every strategy: fixed batches in a fixed order (by length), each
padded, or packed into one row with exact packed attention (``packed=True``: no padding, the same loss).

* :func:`eval_causal_lm`: token-weighted cross-entropy over the target tokens (prompt masked, the
  same labels training used) and its perplexity.
* :func:`generate_texts`: greedy generations for fixed held-out prompts (left padding, KV cache).
* :func:`eval_classifier`: accuracy and cross-entropy of a sequence classifier, plus its predictions.

Before evaluating, :func:`inference_mode` puts a trained model back on the attention implementation it
started with and turns its KV cache on, so a model trained ``packed`` is evaluated exactly like the
others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from smart_batching import compat
from smart_batching.attention import enable_packed_attention
from smart_batching.bench.frozen_prefix import FrozenPrefixCache
from smart_batching.collate import PackingCollator, PaddingCollator
from smart_batching.fallbacks import warn_fallback
from smart_batching.loss import target_positions
from smart_batching.units import IGNORE_INDEX


def inference_mode(model: Any, attn_implementation: str | None) -> Any:
    """Eval mode, the original attention implementation and ``use_cache=True``; returns ``model``."""
    model.eval()
    current = getattr(model.config, "_attn_implementation", None)
    if attn_implementation and current != attn_implementation:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(attn_implementation)
        else:  # pragma: no cover - older transformers
            model.config._attn_implementation = attn_implementation
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = True
    return model


def _batches(dataset: Any, batch_size: int) -> Sequence[tuple[list[int], list[dict[str, Any]]]]:
    """Fixed batches of examples sorted by length (stable), with their dataset positions: the same for
    every strategy, and little padding."""
    rows = [dataset[i] for i in range(len(dataset))]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    return [(idx, [rows[i] for i in idx]) for idx in chunks]


@torch.no_grad()
def eval_causal_lm(
    model: Any,
    dataset: Any,
    *,
    pad_token_id: int,
    batch_size: int = 8,
    device: Any = "cpu",
    prefix_cache: FrozenPrefixCache | None = None,
    packed: bool = False,
) -> dict:
    """Mean cross-entropy per target token on ``dataset`` (``input_ids`` + ``prompt_length``).

    The LM head runs only at the positions whose next token is a target (``logits_to_keep=``, as in
    training) where the model's ``forward`` takes it: the same loss, without a ``(rows, tokens, vocab)``
    logits tensor for prompts and padding (a 49,152-token vocabulary makes that the largest cost of a
    small model's eval, and most of its memory).

    ``packed=True`` packs each batch's examples into one row (:class:`~smart_batching.collate.PackingCollator`)
    and runs the model with packed attention for the evaluation (its attention implementation and KV-cache
    flag put back after): no padding, and the loss of the padded batches up to float32 summation order.
    A model that cannot switch its attention implementation is evaluated padded, with a fallback warning.

    With ``prefix_cache``, a model whose first layers are frozen runs them once per held-out batch and
    only its trained layers at later evaluations (:class:`~.frozen_prefix.FrozenPrefixCache`): the same
    logits.

    Returns:
        ``{"loss", "perplexity", "num_tokens", "num_examples"}``; loss in nats per target token.
    """
    if packed and not compat.can_set_attn_implementation(model):
        warn_fallback(
            "eval.packed",
            f"{type(model).__name__} cannot switch its attention implementation: held-out batches padded",
        )
        packed = False
    if not packed:
        return _eval_batches(model, dataset, PaddingCollator(pad_token_id), batch_size, device, prefix_cache)
    impl = getattr(model.config, "_attn_implementation", None)
    cache = getattr(model.config, "use_cache", None)
    enable_packed_attention(model)
    try:
        collate = PackingCollator(return_seq_idx=False)
        return _eval_batches(model, dataset, collate, batch_size, device, prefix_cache)
    finally:
        if impl is not None:
            compat.set_attn_implementation(model, impl)
        if cache is not None:
            model.config.use_cache = cache


def _eval_batches(
    model: Any,
    dataset: Any,
    collate: Any,
    batch_size: int,
    device: Any,
    prefix_cache: FrozenPrefixCache | None,
) -> dict:
    keep_targets = compat.forward_accepts(model, "logits_to_keep")
    total = 0.0
    count = 0
    for index, (_, rows) in enumerate(_batches(dataset, batch_size)):
        batch = collate(rows)
        labels = batch.pop("labels").to(device)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        # Predict token t+1 from position t: shift as the causal-LM loss does.
        target = labels[:, 1:]
        if keep_targets:
            keep = target_positions(labels)  # (kept,) positions t with a target at t + 1
            if prefix_cache is not None:
                logits = prefix_cache.logits(model, index, inputs, keep)
            else:
                logits = model(**inputs, logits_to_keep=keep).logits
            target = target[:, keep]
        else:
            logits = model(**inputs).logits[:, :-1]
        logits = logits.reshape(-1, logits.shape[-1]).float()
        target = target.reshape(-1)
        total += float(
            torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
        )
        count += int((target != IGNORE_INDEX).sum())
    loss = total / count if count else float("nan")
    return {
        "loss": loss,
        "perplexity": math.exp(loss) if count and loss < 50 else None,
        "num_tokens": count,
        "num_examples": len(dataset),
    }


@torch.no_grad()
def generate_texts(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 64,
    batch_size: int = 8,
    device: Any = "cpu",
) -> list[str]:
    """Greedy continuations of token-id prompts (the new tokens only, decoded without special tokens)."""
    if not prompt_ids:
        return []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    collate = PaddingCollator(pad if pad is not None else 0, padding_side="left")
    outputs: list[str] = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = [{"input_ids": list(p)} for p in prompt_ids[start : start + batch_size]]
        batch = collate(chunk)
        input_ids = batch["input_ids"].to(device)
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=batch["attention_mask"].to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
        new = generated[:, input_ids.shape[1] :]
        outputs.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return outputs


@torch.no_grad()
def eval_classifier(
    model: Any, dataset: Any, *, pad_token_id: int, batch_size: int = 64, device: Any = "cpu"
) -> dict:
    """Accuracy and mean cross-entropy of a sequence classifier on ``dataset`` (``input_ids`` + ``labels``).

    Returns:
        ``{"loss", "accuracy", "num_examples", "predictions"}`` (predictions in dataset order).
    """
    from smart_batching.bench.measure import ClassificationCollator

    collate = ClassificationCollator(pad_token_id)
    total = 0.0
    correct = 0
    predictions = [0] * len(dataset)
    for idx, rows in _batches(dataset, batch_size):
        batch = collate(rows)
        labels = batch.pop("labels").to(device)
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits.float()
        total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        pred = logits.argmax(-1)
        correct += int((pred == labels).sum())
        for i, p in zip(idx, pred.tolist(), strict=True):
            predictions[i] = int(p)
    n = len(dataset)
    return {
        "loss": total / n if n else float("nan"),
        "accuracy": correct / n if n else None,
        "num_examples": n,
        "predictions": predictions,
    }


__all__ = ["eval_causal_lm", "eval_classifier", "generate_texts", "inference_mode"]
