"""Names of the packed implementations and which attention implementations handle packing."""

from __future__ import annotations

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
