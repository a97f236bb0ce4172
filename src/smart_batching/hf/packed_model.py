"""Packed training needs a model whose attention keeps packed examples apart: switch it, check it, or
refuse it."""

from __future__ import annotations

from typing import Any

import torch

from smart_batching.errors import ConfigError

_PACKED_AWARE = ("smart_batching_packed", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def _probe_packed_batch() -> dict[str, Any]:
    # Two 2-token examples in one row, as PackingCollator builds it.
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    return {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 0, 1]]),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": 2,
        "max_length_k": 2,
    }


def prepare_packed_model(model: Any, *, packed_attention: bool = True) -> None:
    """Make sure ``model`` keeps packed examples apart, or refuse it.

    Args:
        model: A transformers model.
        packed_attention: Switch the model to :func:`~smart_batching.attention.enable_packed_attention`
            unless it already uses a packing-aware implementation (flash attention). False leaves the
            model as it is and only checks it.

    Raises:
        ConfigError: the model cannot switch, or would attend across packed examples.
    """
    from smart_batching.attention import check_packed_batch, enable_packed_attention

    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError(
            f"strategy 'packed' needs a transformers model (with .config) whose attention can follow "
            f"cu_seq_lens_q; {type(model).__name__} has none. Use a padded strategy (token_budget, group_by_length)"
        )
    impl = str(getattr(config, "_attn_implementation", None) or "eager")
    if packed_attention and not impl.startswith(_PACKED_AWARE):
        enable_packed_attention(model)
    check_packed_batch(model, _probe_packed_batch())
