"""Result types of :mod:`smart_batching.inference`: what a call returned and what it did."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GenerationStats:
    """What a :func:`generate` call did. Tokens are token counts; times are wall-clock seconds.

    Attributes:
        padding_ratio: padding tokens / token slots of the prompt batches (prefill), prefix included.
        prefill_tokens: prompt tokens the model ran (real tokens, without padding): the prompt tokens
            minus ``prefill_tokens_saved``.
        prefill_tokens_saved: prompt tokens not run because a shared prefix's KV cache was reused.
        num_prefix_groups: groups of prompts that shared a prefix (0 without prefix sharing).
        num_batches: prefill batches (with ``continuous_batching``, groups of prompts admitted together).
        continuous_batching: whether the continuous greedy loop ran (else ``model.generate``).
        fallback: why the continuous loop, the default, did not run (None when it ran or when
            ``continuous_batching=False`` asked for ``model.generate``). A reason that lies in the
            model, not in the decoding settings, is also warned about once
            (:class:`~smart_batching.fallbacks.FallbackWarning`).
        num_decode_steps: forward passes after the prefills (one new token per running row each).
        mean_decode_rows: rows per decode step, on average.
        engine: what ran: ``"vllm"``, ``"transformers"`` (``generate_batch``) or ``"loop"``.
        order: ``"smart"`` (prefix groups together, long work first), ``"input"``, or ``"planned"``
            (the loop's own plan).
        shared_prefix_tokens: prompt tokens that repeat a prefix of another prompt (prefix-tree
            analysis of all prompts): what a perfect prefix cache would not compute.
        cached_prompt_tokens: prompt tokens the engine found in its prefix cache (vLLM reports it;
            None where the engine does not).
        step_tokens: tokens per engine step (``max_num_batched_tokens``), None for the loop.
    """

    num_prompts: int
    num_batches: int
    seconds: float
    prompt_tokens: int
    generated_tokens: int
    prompt_token_slots: int
    padding_ratio: float
    prefill_tokens: int
    prefill_tokens_saved: int
    num_prefix_groups: int
    max_tokens: int
    continuous_batching: bool = False
    fallback: str | None = None
    num_decode_steps: int = 0
    mean_decode_rows: float = 0.0
    engine: str = "loop"
    order: str = "planned"
    shared_prefix_tokens: int = 0
    cached_prompt_tokens: int | None = None
    step_tokens: int | None = None

    @property
    def cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the engine's prefix cache / prompt tokens (None: not reported)."""
        if self.cached_prompt_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_prompt_tokens / self.prompt_tokens

    @property
    def prompts_per_s(self) -> float:
        return self.num_prompts / self.seconds if self.seconds > 0 else 0.0

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            prompts_per_s=self.prompts_per_s,
            generated_tokens_per_s=self.generated_tokens_per_s,
            cache_hit_rate=self.cache_hit_rate,
        )
        return d


@dataclass(frozen=True)
class GenerationResult:
    """Outputs of :func:`generate`, in the order of the prompts.

    Attributes:
        texts: decoded new tokens (special tokens skipped).
        token_ids: new token ids of each prompt, up to and including the first end-of-sequence token.
        prompt_lengths: prompt tokens of each prompt (after the chat template).
    """

    texts: list[str]
    token_ids: list[list[int]]
    prompt_lengths: list[int]
    stats: GenerationStats


@dataclass(frozen=True)
class EncodeStats:
    """What an :func:`encode` call did (tokens are token counts, ``padding_ratio`` = padding / slots)."""

    num_texts: int
    num_batches: int
    seconds: float
    real_tokens: int
    token_slots: int
    padding_ratio: float
    packed: bool
    max_tokens: int

    @property
    def texts_per_s(self) -> float:
        return self.num_texts / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(texts_per_s=self.texts_per_s, tokens_per_s=self.tokens_per_s)
        return d


@dataclass(frozen=True)
class EncodeResult:
    """Outputs of :func:`encode`: ``embeddings`` is ``(num_texts, dim)`` (or ``(num_texts, num_labels)``
    logits with ``pooling=None``), on the CPU, in the order of the texts."""

    embeddings: Any
    stats: EncodeStats
