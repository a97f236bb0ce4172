"""Batched inference with smart batching: generation, encoding and shared-prefix reuse.

Every call tokenises its inputs once, orders or plans them by token length under a padded-token
budget, runs them, and puts the outputs back in the caller's order.

* :func:`generate`: causal LMs, on an engine (``engine="auto" | "vllm" | "transformers" | "loop"``,
  :mod:`~smart_batching.inference._engines`): vLLM's offline ``LLM.generate`` or transformers'
  ``generate_batch``, fed in smart batching's order (prefix groups together over a prefix tree of the
  whole request set, long work first: :mod:`~smart_batching.inference._order`), or the library's own
  loop, described next. On the loop, a row costs ``prompt + max_new_tokens`` tokens of KV cache, so that is
  the length budgeted and the cache of the running batch is bounded by ``max_tokens``. Prompts are
  left-padded. Greedy decoding runs as a continuous batch (``_decode.py``): a row leaves when its
  answer ends and a queued prompt takes its place; other decoding runs ``model.generate`` on planned
  batches. Greedy results equal running each prompt alone (``tests/test_inference.py``).
* :func:`encode`: encoders (BERT & co). Right-padded, sorted batches; optionally ``packed=True``:
  several texts per row with no padding at all, through :mod:`smart_batching.attention`.
* :func:`find_prefix_groups` + ``generate(..., prefix_sharing=True)``: prompts that share a long
  prefix (a system prompt, few-shot examples) are scheduled together and the prefix's KV cache is
  computed once per group and reused, as views, by every prefill of the group (the BatchLLM idea)::

      without reuse (left padding)        with reuse (the prefix's KV cache is computed once)
      _ _ P P P P a a                     [P P P P] _ _ a a      position_ids 0 1 2 3 . . 4 5
      P P P P b b b b                     [P P P P] b b b b      position_ids 0 1 2 3 4 5 6 7

  The padding sits between the cached prefix and each suffix; the attention mask hides it and
  ``position_ids`` (from the mask's cumulative sum) stay those of the unpadded prompt.

Measured on 2 shared CPU cores with SmolLM2-135M and all-MiniLM-L6-v2: see ``benchmarks/inference.py``
and ``benchmarks/RESULTS.md``.
"""

from smart_batching.inference._common import DEFAULT_MAX_TOKENS
from smart_batching.inference._encode import encode
from smart_batching.inference._generate import generate, tokenize_prompts
from smart_batching.inference._prefix import PrefixGroups, find_prefix_groups
from smart_batching.inference._results import (
    EncodeResult,
    EncodeStats,
    GenerationResult,
    GenerationStats,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "EncodeResult",
    "EncodeStats",
    "GenerationResult",
    "GenerationStats",
    "PrefixGroups",
    "encode",
    "find_prefix_groups",
    "generate",
    "tokenize_prompts",
]
