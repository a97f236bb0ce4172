"""Prompts to token ids, and the special tokens generation needs (end of sequence, padding)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from smart_batching.errors import DataError


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and all(isinstance(m, Mapping) for m in prompt)
    )


def tokenize_prompts(tokenizer: Any, prompts: Sequence[Any]) -> list[list[int]]:
    """Token ids of each prompt.

    A prompt is a string (tokenised with the tokenizer's special tokens), a list of chat messages
    (``{"role", "content"}``, rendered with the chat template and a generation prompt), or a list of
    token ids (used as is).

    Raises:
        DataError: a prompt of another type, chat messages for a tokenizer with no chat template, or
            a prompt with no tokens.
    """
    out: list[list[int] | None] = [None] * len(prompts)
    texts: list[tuple[int, str, bool]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            texts.append((i, p, True))
        elif _is_messages(p) and len(p) > 0:
            if not getattr(tokenizer, "chat_template", None):
                raise DataError(
                    f"prompt {i} is a list of chat messages but the tokenizer has no chat template"
                )
            text = tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True)
            texts.append((i, text, False))  # the template already wrote BOS and the like
        elif isinstance(p, Sequence | np.ndarray) and all(isinstance(t, int | np.integer) for t in p):
            out[i] = [int(t) for t in p]
        else:
            raise DataError(
                f"prompt {i} must be a string, a list of chat messages or a list of token ids; got {type(p).__name__}"
            )
    for special in (True, False):
        chunk = [(i, t) for i, t, s in texts if s is special]
        if chunk:
            ids = tokenizer([t for _, t in chunk], add_special_tokens=special)["input_ids"]
            for (i, _), row in zip(chunk, ids, strict=True):
                out[i] = list(row)
    for i, row in enumerate(out):
        if not row:
            raise DataError(f"prompt {i} has no tokens; generation needs at least one")
    return out  # type: ignore[return-value]


def _eos_ids(model: Any, tokenizer: Any, generate_kwargs: Mapping[str, Any]) -> set[int]:
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])}


def _pad_id(model: Any, tokenizer: Any, eos: set[int]) -> int:
    for pad in (
        getattr(tokenizer, "pad_token_id", None),
        getattr(model.generation_config, "pad_token_id", None),
    ):
        if pad is not None:
            return int(pad)
    return min(eos) if eos else 0
