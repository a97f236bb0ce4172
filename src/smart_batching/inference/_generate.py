"""Generation with smart batching: tokenise, plan, run, restore the caller's order."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from smart_batching import compat
from smart_batching.errors import ConfigError, require
from smart_batching.fallbacks import warn_fallback
from smart_batching.inference._common import (
    _check_int,
    _default_max_tokens,
    _plan_indices,
    _progress,
    _sync,
)
from smart_batching.inference._decode import (
    Job,
    greedy_continuous,
    greedy_model_blocker,
    greedy_settings_blocker,
)
from smart_batching.inference._engine_generate import generate_transformers, generate_vllm
from smart_batching.inference._engines import ORDERS, resolve_engine
from smart_batching.inference._order import shared_prefix_tokens
from smart_batching.inference._prefix import PrefixGroups, find_prefix_groups
from smart_batching.inference._prompts import _eos_ids, _pad_id, tokenize_prompts
from smart_batching.inference._results import GenerationResult, GenerationStats


def _expected_buckets(expected: Any, n: int, max_new_tokens: int) -> np.ndarray:
    """Bucket of each row by expected output length: powers of two, so a batch's rows need at most
    about twice the new tokens of its shortest row."""
    arr = np.asarray(expected, dtype=np.float64)
    if arr.shape != (n,) or not np.all(np.isfinite(arr)) or (arr < 0).any():
        raise ConfigError(f"expected_output_lengths= must hold one non-negative number per prompt ({n})")
    return np.floor(np.log2(np.minimum(arr, max_new_tokens) + 1)).astype(np.int64)


def _left_padded(rows: list[list[int]], prefix: list[int], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``: the prefix, then each row left-padded to the longest row."""
    p = len(prefix)
    width = max(len(r) for r in rows)
    ids = np.full((len(rows), p + width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), p + width), dtype=np.int64)
    ids[:, :p] = prefix
    mask[:, :p] = 1
    for i, r in enumerate(rows):
        ids[i, p + width - len(r) :] = r
        mask[i, p + width - len(r) :] = 1
    return ids, mask


def _cache_name(model: Any, *, for_generate: bool = False) -> str:
    name = compat.generate_cache_kwarg(model) if for_generate else compat.cache_kwarg(model)
    if name is None:
        raise ConfigError(
            f"prefix_sharing=True needs a model whose forward takes a KV cache; {type(model).__name__}.forward "
            f"takes none of {compat.CACHE_KWARGS}: set prefix_sharing=False"
        )
    return name


def _prefix_cache(model: Any, prefix: list[int]) -> Any:
    """The KV cache (a ``DynamicCache``, batch 1) of ``prefix``."""
    import torch

    cache = compat.new_dynamic_cache(model)
    ids = torch.tensor([prefix], dtype=torch.long, device=model.device)
    kwargs: dict[str, Any] = {_cache_name(model): cache, "use_cache": True}
    if compat.forward_accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1  # the prefix's logits are never read
    with torch.inference_mode():
        model(input_ids=ids, **kwargs)
    return cache


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    engine: str = "auto",
    order: str = "smart",
    max_new_tokens: int = 64,
    max_tokens: int | None = None,
    max_batch_size: int | None = None,
    continuous_batching: bool | None = None,
    expected_output_lengths: Sequence[float] | None = None,
    prefix_sharing: bool = False,
    min_prefix: int = 32,
    progress: bool = True,
    **generate_kwargs: Any,
) -> GenerationResult:
    """Generate for many prompts on an engine, with smart batching's planning on top.

    The engine (:mod:`smart_batching.inference._engines`): ``"vllm"`` (vLLM's offline
    ``LLM.generate``; ``model`` is a ``vllm.LLM``, or a model folder loaded with prefix caching),
    ``"transformers"`` (transformers' continuous batching, ``model.generate_batch``), ``"loop"`` (the
    library's own loop, below), or ``"auto"``: vLLM for a ``vllm.LLM`` or a path, else the loop (on
    CPU measured 1.57x ``generate_batch``). Engines get the prompts in the order of
    :func:`~smart_batching.inference._order.submission_order`: prompts sharing a prefix together
    (recursively, over a prefix tree of token ids, so the engine's prefix cache reuses it), and the
    costliest work first (prompt + expected new tokens) so the tail is short.

    On ``engine="loop"``, greedy decoding runs in a continuous batch (:mod:`smart_batching.inference._decode`): prompts are
    queued by length, longest first, a row leaves the batch when its answer ends and queued prompts
    take its place, so no step is spent on finished rows. Other decoding (sampling, beams, logits
    processors) runs ``model.generate`` on planned batches, each until its longest answer ends.

    Args:
        model: A transformers causal LM, on its device, in eval mode; for vLLM a ``vllm.LLM`` or a
            model folder.
        tokenizer: Its tokenizer (used to tokenise, for the chat template and to decode); None with a
            ``vllm.LLM`` means the engine's tokenizer.
        engine: ``"auto"``, ``"vllm"``, ``"transformers"`` or ``"loop"`` (see above).
        order: ``"smart"`` (prefix groups together, long work first) or ``"input"`` (as given), for
            the ``vllm`` and ``transformers`` engines; the loop plans its own order.
        prompts: Strings, lists of chat messages (rendered with the chat template), or token id lists.
        max_new_tokens: Most new tokens per prompt.
        max_tokens: Budget in tokens: rows × (longest prompt + ``max_new_tokens``) of the running
            batch, which bounds its KV cache. None: :data:`DEFAULT_MAX_TOKENS` for the model's device.
            A prompt longer than the budget runs alone. On ``transformers``, the paged cache's size;
            on a vLLM model folder, it sets the tokens per step (``max_num_batched_tokens``).
        max_batch_size: Most prompts per batch (per step on ``transformers``, ``max_num_seqs`` on a
            vLLM model folder); None means no limit (the engine's default).
        continuous_batching: None: the continuous greedy loop where it gives ``model.generate``'s
            outputs (greedy, no logits processors), else planned batches through ``model.generate``.
            True: the loop, or :class:`ConfigError` saying why not. False: always ``model.generate``.
        expected_output_lengths: Expected new tokens of each prompt (e.g. from earlier runs): on the
            engines, part of the expected work that orders prompts; for the loop's ``model.generate``
            batches: prompts are first bucketed by it (powers of two), so a
            batch does not keep decoding for one long answer while its other rows are done. None: plan
            on prompt length only. The continuous loop needs no such guess.
        prefix_sharing: Group prompts sharing a prefix of at least ``min_prefix`` tokens
            (:func:`find_prefix_groups`) and compute each group's prefix KV cache once.
        min_prefix: Shortest shared prefix, in tokens, used with ``prefix_sharing``.
        progress: Show a progress bar (prompts).
        **generate_kwargs: Generation settings, as for ``model.generate`` (``do_sample`` defaults to
            False: greedy).

    Returns:
        Texts and token ids in the order of ``prompts``, and :class:`GenerationStats`.
    """
    _check_int("max_new_tokens", max_new_tokens)
    _check_int("max_tokens", max_tokens, allow_none=True)
    _check_int("max_batch_size", max_batch_size, allow_none=True)
    if order not in ORDERS:
        raise ConfigError(f"order={order!r} must be one of {', '.join(map(repr, ORDERS))}")
    generate_kwargs.setdefault("do_sample", False)
    if compat.is_vllm_llm(model) or isinstance(model, str | os.PathLike):
        settings = {k: v for k, v in generate_kwargs.items() if k not in ("do_sample", "pad_token_id")}
        blocker = f"generate keywords {sorted(settings)} were given" if settings else None
        if generate_kwargs["do_sample"]:
            blocker = "do_sample=True"
        resolve_engine(engine, model, continuous_batching=continuous_batching, settings_blocker=blocker)
        return generate_vllm(
            model, tokenizer, prompts, order=order, max_new_tokens=max_new_tokens, max_tokens=max_tokens,
            max_batch_size=max_batch_size, expected_output_lengths=expected_output_lengths,
            min_prefix=min_prefix,
        )  # fmt: skip
    require("torch", "hf")
    if max_tokens is None:
        max_tokens = _default_max_tokens(model)
    for name in compat.CACHE_KWARGS:
        if name in generate_kwargs:
            raise ConfigError(f"generate() manages the KV cache itself; do not pass {name}=")
    if generate_kwargs.get("num_return_sequences", 1) != 1:
        raise ConfigError("num_return_sequences= must be 1 (repeat the prompt to get several outputs)")
    if prefix_sharing and generate_kwargs.get("num_beams", 1) != 1:
        raise ConfigError("prefix_sharing=True works with greedy or sampling only; set num_beams=1")
    chosen = resolve_engine(
        engine,
        model,
        continuous_batching=continuous_batching,
        settings_blocker=greedy_settings_blocker(model, generate_kwargs),
    )
    if chosen == "transformers":
        return generate_transformers(
            model, tokenizer, prompts, order=order, max_new_tokens=max_new_tokens, max_tokens=max_tokens,
            max_batch_size=max_batch_size, expected_output_lengths=expected_output_lengths,
            min_prefix=min_prefix, generate_kwargs=generate_kwargs,
        )  # fmt: skip
    model_blocker = greedy_model_blocker(model) if continuous_batching is not False else None
    blocker = model_blocker
    if continuous_batching is not False and blocker is None:
        blocker = greedy_settings_blocker(model, generate_kwargs)
    if continuous_batching and blocker:
        raise ConfigError(f"continuous_batching=True needs plain greedy decoding, but {blocker}")
    continuous = continuous_batching is not False and blocker is None
    # The default promises the continuous loop for greedy decoding: a model that cannot run it is a
    # fallback to warn about. Sampling or beams (the caller's choice) take model.generate as documented.
    fallback = blocker if continuous_batching is None else None
    if model_blocker is not None and continuous_batching is None:
        warn_fallback(
            "generate.continuous",
            f"greedy decoding runs through model.generate on planned batches, not the continuous batch, "
            f"because {model_blocker}; outputs are the same, generation is slower. Pass "
            "continuous_batching=False to choose this path (and silence this warning).",
        )

    start = time.perf_counter()
    ids = tokenize_prompts(tokenizer, prompts)
    n = len(ids)
    buckets = (
        _expected_buckets(expected_output_lengths, n, max_new_tokens)
        if expected_output_lengths is not None
        else np.zeros(n, dtype=np.int64)
    )
    prompt_lens = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
    groups = find_prefix_groups(ids, min_prefix=min_prefix) if prefix_sharing else None
    eos = _eos_ids(model, tokenizer, generate_kwargs)
    pad_id = _pad_id(model, tokenizer, eos)
    generate_kwargs.setdefault("pad_token_id", pad_id)
    with _progress(n, "generating", "prompt", progress) as bar:
        if continuous:
            out_ids, counts = _run_continuous(
                model, ids, groups, max_new_tokens, max_tokens, max_batch_size, eos, pad_id, bar
            )
        else:
            out_ids, counts = _run_planned(
                model,
                ids,
                groups,
                buckets,
                max_new_tokens,
                max_tokens,
                max_batch_size,
                eos,
                bar,
                generate_kwargs,
            )
    _sync(getattr(model, "device", None))
    texts = tokenizer.batch_decode(out_ids, skip_special_tokens=True)
    seconds = time.perf_counter() - start
    prompt_tokens = int(prompt_lens.sum())
    saved = groups.tokens_saved if groups is not None else 0
    slots = counts["slots"]
    stats = GenerationStats(
        num_prompts=n,
        num_batches=counts["batches"],
        seconds=seconds,
        prompt_tokens=prompt_tokens,
        generated_tokens=sum(len(r) for r in out_ids),
        prompt_token_slots=slots,
        padding_ratio=(slots - prompt_tokens) / slots if slots else 0.0,
        prefill_tokens=prompt_tokens - saved,
        prefill_tokens_saved=saved,
        num_prefix_groups=len(groups) if groups is not None else 0,
        max_tokens=int(max_tokens),
        continuous_batching=continuous,
        fallback=fallback,
        engine="loop",
        shared_prefix_tokens=shared_prefix_tokens(ids),
        num_decode_steps=counts["steps"],
        mean_decode_rows=counts["rows"] / counts["steps"] if counts["steps"] else 0.0,
    )
    return GenerationResult(texts, out_ids, prompt_lens.tolist(), stats)


def _run_continuous(
    model: Any,
    ids: list[list[int]],
    groups: PrefixGroups | None,
    max_new_tokens: int,
    max_tokens: int,
    max_batch_size: int | None,
    eos: set[int],
    pad_id: int,
    bar: Any,
) -> tuple[list[list[int]], dict[str, int]]:
    """The greedy continuous batch: each prefix group's prompts, then the others, longest first."""
    lens = np.fromiter((len(r) for r in ids), dtype=np.int64, count=len(ids))
    jobs: list[Job] = []
    grouped = np.zeros(len(ids), dtype=bool)
    for g, (members, plen) in enumerate(groups or ()):
        grouped[members] = True
        for i in members[np.argsort(-lens[members], kind="stable")].tolist():
            jobs.append(Job(i, ids[i], g, plen))
    rest = np.flatnonzero(~grouped)
    jobs.extend(Job(i, ids[i]) for i in rest[np.argsort(-lens[rest], kind="stable")].tolist())
    s = greedy_continuous(
        model,
        jobs,
        max_new_tokens=max_new_tokens,
        max_tokens=max_tokens,
        max_batch_size=max_batch_size,
        eos=eos,
        pad_id=pad_id,
        prefix_cache=lambda g, prefix: _prefix_cache(model, prefix),
        on_done=bar.update,
    )
    out_ids = [s.outputs[i] for i in range(len(ids))]
    counts = {
        "batches": s.num_prefills,
        "slots": s.prompt_token_slots,
        "steps": s.num_decode_steps,
        "rows": s.decode_rows,
    }
    return out_ids, counts


def _run_planned(
    model: Any,
    ids: list[list[int]],
    groups: PrefixGroups | None,
    buckets: np.ndarray,
    max_new_tokens: int,
    max_tokens: int,
    max_batch_size: int | None,
    eos: set[int],
    bar: Any,
    generate_kwargs: dict[str, Any],
) -> tuple[list[list[int]], dict[str, int]]:
    """Token-budget batches through ``model.generate``, each until its longest answer ends."""
    import torch

    n = len(ids)
    lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n) + max_new_tokens
    # Jobs: (prefix group or -1, batch of prompt indices); the batches of a group follow one another.
    jobs: list[tuple[int, np.ndarray]] = []
    grouped = np.zeros(n, dtype=bool)
    for g, (members, _) in enumerate(groups or ()):
        grouped[members] = True
        for b in np.unique(buckets[members]):
            sub = members[buckets[members] == b]
            jobs.extend((g, batch) for batch in _plan_indices(sub, lengths, max_tokens, max_batch_size))
    rest = np.flatnonzero(~grouped)
    for b in np.unique(buckets[rest]):
        sub = rest[buckets[rest] == b]
        jobs.extend((-1, batch) for batch in _plan_indices(sub, lengths, max_tokens, max_batch_size))

    pad_id = generate_kwargs["pad_token_id"]
    out_ids: list[list[int]] = [[] for _ in range(n)]
    slots = steps = rows_summed = 0
    cached_group, cache = -1, None
    for g, batch in jobs:
        prefix: list[int] = []
        past = None
        if g >= 0:
            assert groups is not None
            prefix = ids[batch[0]][: int(groups.prefix_lengths[g])]
            if g != cached_group:  # one prefill of the prefix per group, kept for its batches
                cached_group, cache = g, _prefix_cache(model, prefix)
            past = copy.deepcopy(cache)
            past.batch_repeat_interleave(len(batch))
        input_ids, mask = _left_padded([ids[i][len(prefix) :] for i in batch], prefix, pad_id)
        slots += input_ids.size
        kwargs = dict(generate_kwargs)
        if past is not None:
            kwargs[_cache_name(model, for_generate=True)] = past
        with torch.inference_mode():
            out = model.generate(
                input_ids=torch.from_numpy(input_ids).to(model.device),
                attention_mask=torch.from_numpy(mask).to(model.device),
                max_new_tokens=max_new_tokens,
                **kwargs,
            )
        new = out[:, input_ids.shape[1] :].tolist()
        steps += len(new[0]) - 1
        rows_summed += len(batch) * (len(new[0]) - 1)
        for i, row in zip(batch.tolist(), new, strict=True):
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            out_ids[i] = row[:cut]
        bar.update(len(batch))
    counts = {"batches": len(jobs), "slots": slots, "steps": steps, "rows": rows_summed}
    return out_ids, counts
