"""Preference pairs without a Trainer: planned pair batches and their log-probabilities, for a DPO loop
of your own (the same rows :mod:`smart_batching.hf.dpo` gives TRL's ``DPOTrainer``).

::

    loader = preference_dataloader(pairs, "packed", capacity=4096, max_length=1024)
    prepare_pair_model(policy)
    prepare_pair_model(reference)
    for batch in loader:
        chosen, rejected = pair_log_probs(policy, batch)          # (pairs,) each
        ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader

from smart_batching import compat
from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import either
from smart_batching.hf.dpo.collate import PACKED_PAIRS, PairCollator, dataset_pair_lengths
from smart_batching.hf.dpo.model import check_pair_layout
from smart_batching.hf.dpo.upstream import PAIRS
from smart_batching.planners import DEFAULT_STRATEGY, spec_class


def preference_dataloader(
    dataset: Any,
    strategy: Any = DEFAULT_STRATEGY,
    *,
    prompt_sharing: bool = True,
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
    pad_token_id: int = 0,
    seed: int = 0,
    columns: tuple[str, ...] = compat.TRL_DPO_COLUMNS,
    **options: Any,
) -> DataLoader:
    """A DataLoader of planned pair batches over a tokenized preference dataset (``prompt_ids``,
    ``chosen_ids``, ``rejected_ids`` list columns, as TRL prepares them), for a loop of your own.

    Args:
        dataset: A ``datasets.Dataset`` of pairs.
        strategy: A strategy name or spec; it plans the pairs' costs in tokens.
        prompt_sharing: Strategy ``packed``: share each pair's prompt in its row.
        max_length, truncation_mode: Truncate each sequence as TRL does.
        pad_token_id: Padding of the padded view.
        seed: Planner seed.
        columns: Token-id and reference log-probability column names.
        **options: Strategy fields (``capacity=``, ``max_tokens=``, ``batch_size=``) and DataLoader keywords.

    Returns:
        The DataLoader; batches are :class:`~smart_batching.hf.dpo.collate.PairCollator` outputs (run them
        with :func:`pair_log_probs`); ``loader.batch_sampler`` is the sampler.
    """
    from dataclasses import fields

    from smart_batching.sampler import SmartBatchSampler
    from smart_batching.units import plan_units

    cls = spec_class(strategy)
    spec_fields = {f.name for f in fields(cls)}
    plan_options = {k: v for k, v in options.items() if k in spec_fields}
    loader_options = {k: v for k, v in options.items() if k not in spec_fields}
    layout = ("shared" if prompt_sharing else "unshared") if cls.packs_rows else "padded"
    costs = dataset_pair_lengths(
        dataset, max_length=max_length, truncation_mode=truncation_mode, columns=columns[:3]
    ).costs(layout)
    sampler = SmartBatchSampler(costs, strategy, seed=seed, units=plan_units(costs), **plan_options)
    if sampler.yields_segments:
        raise ConfigError(
            f"a pair is one unit: set overlong={either(PAIRS.overlong)}, not {sampler.spec.overlong!r}"
        )
    collator = PairCollator(
        pad_token_id=pad_token_id, layout=layout, max_length=max_length, truncation_mode=truncation_mode,
        columns=columns,
    )  # fmt: skip
    keep = [c for c in columns if c in dataset.column_names]
    data = dataset.select_columns(keep) if hasattr(dataset, "select_columns") else dataset
    return DataLoader(data, batch_sampler=sampler, collate_fn=collator, **loader_options)


def prepare_pair_model(model: Any, *, prompt_sharing: bool = True) -> Any:
    """Switch ``model`` to the attention packed pair rows need and check it on a probe pair (see
    :func:`~smart_batching.hf.dpo.model.check_pair_layout`). Returns the model."""
    from smart_batching.attention.prefix_sharing import enable_prefix_shared_attention

    enable_prefix_shared_attention(model)
    check_pair_layout(model, prompt_sharing=prompt_sharing)
    return model


def pair_log_probs(model: Any, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probabilities of each pair's chosen and rejected sequence, ``(pairs,)`` each.

    Runs the packed row when the batch has one (the model prepared by :func:`prepare_pair_model`), else
    the padded view; the LM head runs only at target positions. For a causal LM whose logits are its
    output embedding's projection (no logit scaling or softcapping).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise ConfigError(f"{type(model).__name__} scales or softcaps its logits; pair_log_probs does not")
    device = next(model.parameters()).device
    ids = batch["input_ids"].to(device)
    completion = batch["completion_mask"].to(device)
    valid = completion[:, 1:] == 1  # (2 * pairs, width - 1)
    targets = ids[:, 1:][valid]
    backbone = compat.trl_backbone(model)
    packed = batch.get(PACKED_PAIRS)
    if packed is None:
        hidden = backbone(input_ids=ids, attention_mask=batch["attention_mask"].to(device)).last_hidden_state
        rows, cols = valid.nonzero(as_tuple=True)
        source = rows * ids.shape[1] + cols
    else:
        packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
        source = packed.pop("source")
        hidden = backbone(**packed).last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source)  # (targets, hidden)
    logits = model.get_output_embeddings()(picked).float()
    per_token = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]
    sums = torch.zeros(valid.shape, dtype=per_token.dtype, device=device).masked_scatter(valid, per_token)
    chosen, rejected = sums.sum(dim=1).chunk(2)
    return chosen, rejected


__all__ = ["pair_log_probs", "preference_dataloader", "prepare_pair_model"]
