""":func:`~smart_batching.inference.generate` on an engine (vLLM, transformers' ``generate_batch``):
tokenise once, analyse prefixes over all prompts, order, run, restore the caller's order."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from smart_batching import compat
from smart_batching.inference._engines import load_vllm, run_transformers, run_vllm
from smart_batching.inference._order import expected_work, shared_prefix_tokens, submission_order
from smart_batching.inference._prompts import _eos_ids, _pad_id, tokenize_prompts
from smart_batching.inference._results import GenerationResult, GenerationStats


def _order(
    ids: list[list[int]],
    order: str,
    max_new_tokens: int,
    expected_output_lengths: Sequence[float] | None,
    min_prefix: int,
) -> np.ndarray:
    work = expected_work(ids, max_new_tokens, expected_output_lengths)  # validates the hint
    if order == "input":
        return np.arange(len(ids), dtype=np.int64)
    return submission_order(ids, work, min_prefix=min_prefix)


def _result(
    tokenizer: Any,
    ids: list[list[int]],
    out_ids: list[list[int]],
    start: float,
    *,
    engine: str,
    order: str,
    max_tokens: int,
    info: Mapping[str, Any],
) -> GenerationResult:
    texts = tokenizer.batch_decode(out_ids, skip_special_tokens=True)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(map(len, ids))
    cached = info["cached_tokens"]
    stats = GenerationStats(
        num_prompts=len(ids),
        num_batches=1,
        seconds=seconds,
        prompt_tokens=prompt_tokens,
        generated_tokens=sum(map(len, out_ids)),
        prompt_token_slots=prompt_tokens,  # paged caches: no padding
        padding_ratio=0.0,
        prefill_tokens=prompt_tokens - (cached or 0),
        prefill_tokens_saved=cached or 0,
        num_prefix_groups=0,
        max_tokens=int(max_tokens),
        continuous_batching=True,
        engine=engine,
        order=order,
        shared_prefix_tokens=shared_prefix_tokens(ids),
        cached_prompt_tokens=cached,
        step_tokens=info["step_tokens"],
    )
    return GenerationResult(texts, out_ids, [len(r) for r in ids], stats)


def generate_transformers(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    order: str,
    max_new_tokens: int,
    max_tokens: int,
    max_batch_size: int | None,
    expected_output_lengths: Sequence[float] | None,
    min_prefix: int,
    generate_kwargs: Mapping[str, Any],
) -> GenerationResult:
    """``generate(..., engine="transformers")``: greedy, on ``model.generate_batch``."""
    start = time.perf_counter()
    ids = tokenize_prompts(tokenizer, prompts)
    eos = _eos_ids(model, tokenizer, generate_kwargs)
    pad_id = int(generate_kwargs.get("pad_token_id", _pad_id(model, tokenizer, eos)))
    ranked = _order(ids, order, max_new_tokens, expected_output_lengths, min_prefix)
    out_ids, info = run_transformers(
        model, ids, ranked, max_new_tokens=max_new_tokens, max_tokens=max_tokens,
        max_batch_size=max_batch_size, eos=eos, pad_id=pad_id,
    )  # fmt: skip
    return _result(
        tokenizer, ids, out_ids, start, engine="transformers", order=order, max_tokens=max_tokens, info=info
    )


def generate_vllm(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    order: str,
    max_new_tokens: int,
    max_tokens: int | None,
    max_batch_size: int | None,
    expected_output_lengths: Sequence[float] | None,
    min_prefix: int,
) -> GenerationResult:
    """``generate(..., engine="vllm")``: greedy, on ``LLM.generate``; a model folder is loaded here
    with prefix caching and a step budget from ``max_tokens``."""
    start = time.perf_counter()
    if tokenizer is None:
        if not compat.is_vllm_llm(model):
            from smart_batching.data.tokenizers import load_tokenizer

            tokenizer = load_tokenizer(os.fspath(model))
        else:
            tokenizer = model.get_tokenizer()
    ids = tokenize_prompts(tokenizer, prompts)
    ranked = _order(ids, order, max_new_tokens, expected_output_lengths, min_prefix)
    llm = model
    if not compat.is_vllm_llm(model):
        longest = max(map(len, ids), default=1)
        llm = load_vllm(model, max_tokens=max_tokens, longest_prompt=longest, max_batch_size=max_batch_size)
    out_ids, info = run_vllm(llm, ids, ranked, max_new_tokens=max_new_tokens)
    budget = max_tokens if max_tokens is not None else (info["step_tokens"] or 0)
    return _result(tokenizer, ids, out_ids, start, engine="vllm", order=order, max_tokens=budget, info=info)
