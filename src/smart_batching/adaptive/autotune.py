"""Adaptive token budget: the largest ``max_tokens`` / ``capacity`` that fits device memory.

:func:`find_max_tokens` tries budgets from small to large. For each it plans the data, takes the most
expensive batch of the plan (most token slots; for packing, the fullest row) and runs one forward and
backward pass on a batch of exactly that shape (random token ids; autocast passes through). It stops at
the first budget that does not fit and returns the one before:

- CUDA: an out-of-memory error, or ``torch.cuda.max_memory_allocated`` above ``memory_cap_bytes``;
- CPU: there is no out-of-memory error to catch, so an explicit ``memory_cap_bytes`` is required and
  the process's peak resident memory (``ru_maxrss``) must stay below it. Budgets are tried in rising
  order because that peak only grows.

Keep the tokens of an optimizer step constant when the budget changes with
:func:`accumulation_steps_for`: ``ceil(tokens_per_step / max_tokens)`` micro-batches.
"""

from __future__ import annotations

import math
import resource
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.plan import BatchPlan, as_lengths
from smart_batching.planners import DEFAULT_STRATEGY, plan_batches, spec_class, strategy_names

DEFAULT_CANDIDATES = tuple(2**k for k in range(8, 18))  # 256 .. 131072 tokens


def accumulation_steps_for(tokens_per_step: int, max_tokens: int) -> int:
    """Micro-batches of ``max_tokens`` needed for ``tokens_per_step`` tokens per optimizer step."""
    if tokens_per_step < 1 or max_tokens < 1:
        raise ConfigError("tokens_per_step= and max_tokens= must be positive")
    return max(1, math.ceil(tokens_per_step / max_tokens))


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def costliest_batch_shape(plan: BatchPlan) -> tuple[int, int, list[int]]:
    """``(rows, width, segment_lengths)`` of the batch with the most token slots."""
    b = int(np.argmax(plan.slots_per_batch))
    lo, hi = plan.segment_range(b)
    rows = int(plan.rows_per_batch[b])
    return rows, int(plan.batch_width[b]), plan.seg_lengths[lo:hi].tolist()


def _trial_batch(plan: BatchPlan, vocab_size: int, device: Any) -> dict[str, Any]:
    import torch

    rows, width, segs = costliest_batch_shape(plan)
    g = torch.Generator().manual_seed(0)
    if plan.spec.packs_rows:  # one padding-free row, as PackingCollator builds it
        from smart_batching.collate import PackingCollator

        feats = [
            {"input_ids": torch.randint(1, vocab_size, (n,), generator=g).tolist()} for n in segs if n > 0
        ]
        batch = PackingCollator()(feats)
    else:
        ids = torch.randint(1, vocab_size, (rows, width), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return {k: v.to(device) if hasattr(v, "to") else v for k, v in batch.items()}


def find_max_tokens(
    model: Any,
    lengths: Any,
    strategy: str = DEFAULT_STRATEGY,
    *,
    memory_cap_bytes: int | None = None,
    candidates: Sequence[int] = DEFAULT_CANDIDATES,
    autocast_dtype: Any = None,
    seed: int = 0,
    **options: Any,
) -> int:
    """The largest budget in ``candidates`` whose most expensive batch trains within memory.

    Args:
        model: the model to train (a transformers model taking ``input_ids``/``labels``); it is run
            in train mode and its gradients are cleared afterwards.
        lengths: (num_examples,) token lengths of the training data.
        strategy: A strategy with a budget (its spec's ``budget_option``: ``max_tokens`` for
            ``token_budget``, ``capacity`` for ``packed``).
        memory_cap_bytes: peak memory allowed; required on CPU. On CUDA, None means "until OOM".
        candidates: budgets to try, in tokens (tried in rising order).
        autocast_dtype: e.g. ``torch.bfloat16`` to run the trials under autocast, as training will.
        seed, **options: passed to :func:`~smart_batching.planners.plan_batches` (e.g. ``overlong=``).

    Raises:
        ConfigError: no candidate fits, or no cap on CPU.
    """
    import torch

    key = spec_class(strategy).budget_option
    if key is None:
        budgeted = [n for n in strategy_names() if spec_class(n).budget_option]
        raise ConfigError(f"max_tokens='auto' applies to {' or '.join(budgeted)}, not {strategy!r}")
    lengths = as_lengths(lengths)
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    if not cuda and memory_cap_bytes is None:
        raise ConfigError(
            "max_tokens='auto' on CPU needs an explicit memory cap: pass memory_cap_bytes= (e.g. 8 * 2**30)"
        )
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 1000) or 1000)
    longest = int(lengths.max(initial=1))
    tried = sorted({int(c) for c in candidates})
    options.setdefault("overlong", "truncate")
    best: int | None = None
    was_training = model.training
    model.train()
    try:
        for budget in tried:
            plan = plan_batches(lengths, strategy, seed=seed, **{key: budget}, **options)
            batch = _trial_batch(plan, vocab, device)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            try:
                ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else _null()
                with ctx:
                    loss = model(**batch).loss
                loss.backward()
            except torch.cuda.OutOfMemoryError:
                break
            finally:
                model.zero_grad(set_to_none=True)
            peak = torch.cuda.max_memory_allocated(device) if cuda else _peak_rss_bytes()
            if memory_cap_bytes is not None and peak > memory_cap_bytes:
                break
            best = budget
            if budget >= longest * max(1, len(lengths)):  # the whole dataset fits one batch already
                break
    finally:
        model.train(was_training)
        if cuda:
            torch.cuda.empty_cache()
    if best is None:
        raise ConfigError(
            f"no {key} in {tried[0]}..{tried[-1]} fits the memory cap; raise memory_cap_bytes= or use a smaller model"
        )
    return best


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


__all__ = ["DEFAULT_CANDIDATES", "accumulation_steps_for", "costliest_batch_shape", "find_max_tokens"]
