"""Batched inference with smart batching: generation, encoding and shared-prefix reuse.

Every call tokenises its inputs once, plans batches with the ``token_budget`` planner on token lengths
(so similar lengths share a batch and each batch stays under a padded-token budget), runs the batches,
and puts the outputs back in the caller's order.

* :func:`generate`: causal LMs. A row costs ``prompt + max_new_tokens`` tokens of KV cache, so that is
  the length planned and the memory of a batch is bounded by ``max_tokens``. Prompts are left-padded;
  greedy results equal running each prompt alone (``tests/test_inference.py``).
* :func:`encode`: encoders (BERT & co). Right-padded, sorted batches; optionally ``packed=True``:
  several texts per row with no padding at all, through :mod:`smart_batching.attention`.
* :func:`find_prefix_groups` + ``generate(..., prefix_sharing=True)``: prompts that share a long
  prefix (a system prompt, few-shot examples) are scheduled together and the prefix's KV cache is
  computed once per group and copied into every batch of the group (the BatchLLM idea)::

      without reuse (left padding)        with reuse (the prefix's KV cache is computed once)
      _ _ P P P P a a                     [P P P P] _ _ a a      position_ids 0 1 2 3 . . 4 5
      P P P P b b b b                     [P P P P] b b b b      position_ids 0 1 2 3 4 5 6 7

  The padding sits between the cached prefix and each suffix; the attention mask hides it and
  ``position_ids`` (from the mask's cumulative sum) stay those of the unpadded prompt.

Measured on 2 CPU cores with SmolLM2-135M and all-MiniLM-L6-v2: see ``benchmarks/inference.py``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError, DataError, require
from smart_batching.planners import plan_batches

DEFAULT_MAX_TOKENS = {"cpu": 2048, "cuda": 65536}
"""Default token budget per batch (padded tokens, prompt + new tokens for generation) by device type."""

POOLINGS = ("mean", "cls", None)


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationStats:
    """What a :func:`generate` call did. Tokens are token counts; times are wall-clock seconds.

    Attributes:
        padding_ratio: padding tokens / token slots of the prompt batches (prefill), prefix included.
        prefill_tokens: prompt tokens the model ran (real tokens, without padding): the prompt tokens
            minus ``prefill_tokens_saved``.
        prefill_tokens_saved: prompt tokens not run because a shared prefix's KV cache was reused.
        num_prefix_groups: groups of prompts that shared a prefix (0 without prefix sharing).
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

    @property
    def prompts_per_s(self) -> float:
        return self.num_prompts / self.seconds if self.seconds > 0 else 0.0

    @property
    def generated_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(prompts_per_s=self.prompts_per_s, generated_tokens_per_s=self.generated_tokens_per_s)
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


@dataclass(frozen=True)
class PrefixGroups:
    """Groups of prompts sharing a prefix, stored flat::

        members        [4 9 1 | 0 7]      # (num_grouped,) prompt indices, group by group
        group_offsets  [0 3 5]            # (num_groups + 1,)
        prefix_lengths [120 48]           # (num_groups,) tokens shared by every member of the group

    Every member has at least one token after its group's prefix.
    """

    members: np.ndarray
    group_offsets: np.ndarray
    prefix_lengths: np.ndarray
    num_prompts: int

    def __len__(self) -> int:
        return len(self.prefix_lengths)

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        for g in range(len(self)):
            yield self.members[self.group_offsets[g] : self.group_offsets[g + 1]], int(self.prefix_lengths[g])

    @property
    def tokens_saved(self) -> int:
        """Prefill tokens saved when each group's prefix is run once instead of once per member."""
        sizes = np.diff(self.group_offsets)
        return int(((sizes - 1) * self.prefix_lengths).sum())


# --------------------------------------------------------------------------------------------------
# Prefix groups
# --------------------------------------------------------------------------------------------------


def find_prefix_groups(
    token_id_lists: Sequence[Sequence[int]], *, min_prefix: int = 32, min_group_size: int = 2
) -> PrefixGroups:
    """Find prompts that share a long common prefix, over the whole input at once.

    The token sequences are sorted lexicographically (sequences with a common prefix become
    neighbours), the longest common prefix (LCP) of each pair of neighbours is computed in one
    vectorised comparison, and maximal runs of neighbours whose LCP is at least ``min_prefix`` form
    the groups; a group's prefix is the smallest LCP inside its run, capped so that every member keeps
    one token of its own. O(n * L) time and memory for n prompts of at most L tokens.

    One level only: prompts sharing a 500-token system prompt, some of which also share 300 more
    tokens of examples, form one group with a 500-token prefix.

    Args:
        token_id_lists: token ids of each prompt.
        min_prefix: shortest shared prefix (tokens) worth a group.
        min_group_size: fewest prompts in a group.

    Returns:
        The groups; prompts in no group are absent from ``members``.
    """
    if min_prefix < 1 or min_group_size < 2:
        raise ConfigError(
            f"min_prefix= must be >= 1 and min_group_size= >= 2; got {min_prefix}, {min_group_size}"
        )
    n = len(token_id_lists)
    lens = np.fromiter((len(t) for t in token_id_lists), dtype=np.int64, count=n)
    empty = PrefixGroups(np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.int64), n)
    if n < min_group_size or lens.max(initial=0) <= min_prefix:
        return empty
    width = int(lens.max())
    grid = np.full((n, width), -1, dtype=np.int64)  # -1 pads: sorts a prefix before its extensions
    grid[np.arange(width) < lens[:, None]] = np.concatenate(
        [np.asarray(t, dtype=np.int64) for t in token_id_lists]
    )
    order = np.lexsort(grid.T[::-1])  # (n,) lexicographic, column 0 first
    rows = grid[order]
    eq = (rows[1:] == rows[:-1]) & (rows[1:] >= 0)  # (n - 1, width): equal real tokens
    lcp = np.logical_and.accumulate(eq, axis=1).sum(axis=1)  # (n - 1,)
    slens = lens[order]
    lcp = np.minimum(lcp, np.minimum(slens[1:], slens[:-1]) - 1)  # every member keeps one own token
    link = lcp >= min_prefix  # (n - 1,) neighbours i, i+1 share a prefix
    starts = np.flatnonzero(np.r_[True, ~link])  # (num_runs,) first sorted position of each run
    sizes = np.diff(np.r_[starts, n])
    keep = sizes >= min_group_size
    if not keep.any():
        return empty
    big = np.iinfo(np.int64).max
    # Between two kept runs lie only non-links (set to `big`), so each segment's min is its run's prefix.
    prefix = np.minimum.reduceat(np.where(link, lcp, big), starts[keep])
    run_of = np.repeat(np.arange(len(starts)), sizes)  # (n,) run of each sorted position
    members = order[keep[run_of]]
    offsets = np.r_[0, np.cumsum(sizes[keep])].astype(np.int64)
    return PrefixGroups(members.astype(np.int64), offsets, prefix.astype(np.int64), n)


# --------------------------------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------------------------------


def _default_max_tokens(model: Any) -> int:
    device = getattr(model, "device", None)
    return DEFAULT_MAX_TOKENS["cuda" if getattr(device, "type", "cpu") == "cuda" else "cpu"]


def _check_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name}= must be an integer >= {minimum}, got {value!r}")


def _plan_indices(
    indices: np.ndarray, lengths: np.ndarray, max_tokens: int, max_batch_size: int | None
) -> list[np.ndarray]:
    """Token-budget batches over ``indices`` (positions into ``lengths``), widest batch first.

    Rows longer than the budget run alone: one row is the least memory they can take.
    """
    over = lengths[indices] > max_tokens
    fit = indices[~over]
    batches: list[np.ndarray] = [indices[over][i : i + 1] for i in range(int(over.sum()))]
    if fit.size:
        plan = plan_batches(
            lengths[fit], "token_budget", max_tokens=max_tokens, max_batch_size=max_batch_size
        )
        batches.extend(fit[b] for b in plan)
    # Widest first, so that running out of memory shows in the first batch, not the last.
    return sorted(batches, key=lambda b: -int(lengths[b].max()) * len(b))


def _progress(total: int, desc: str, unit: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, leave=False)


def _sync(device: Any) -> None:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------------


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


def _prefix_cache(model: Any, prefix: list[int]) -> Any:
    """The KV cache (a ``DynamicCache``, batch 1) of ``prefix``."""
    import inspect

    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prefix], dtype=torch.long, device=model.device)
    kwargs: dict[str, Any] = {"past_key_values": cache, "use_cache": True}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the prefix's logits are never read
    with torch.inference_mode():
        model(input_ids=ids, **kwargs)
    return cache


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int = 64,
    max_tokens: int | None = None,
    max_batch_size: int | None = None,
    expected_output_lengths: Sequence[float] | None = None,
    prefix_sharing: bool = False,
    min_prefix: int = 32,
    progress: bool = True,
    **generate_kwargs: Any,
) -> GenerationResult:
    """Generate for many prompts in token-budget batches of similar prompt length.

    Args:
        model: A transformers causal LM (``model.generate``), on its device, in eval mode.
        tokenizer: Its tokenizer (used to tokenise, for the chat template and to decode).
        prompts: Strings, lists of chat messages (rendered with the chat template), or token id lists.
        max_new_tokens: Most new tokens per prompt.
        max_tokens: Budget of one batch in tokens: rows × (longest prompt + ``max_new_tokens``), which
            bounds the KV cache of a batch. None: :data:`DEFAULT_MAX_TOKENS` for the model's device.
            A prompt longer than the budget runs alone.
        max_batch_size: Most prompts per batch; None means no limit.
        expected_output_lengths: Expected new tokens of each prompt (e.g. from earlier runs). When
            given, prompts are first bucketed by it (powers of two), so a batch does not keep decoding
            for one long answer while its other rows are done. None: plan on prompt length only.
        prefix_sharing: Group prompts sharing a prefix of at least ``min_prefix`` tokens
            (:func:`find_prefix_groups`) and compute each group's prefix KV cache once.
        min_prefix: Shortest shared prefix, in tokens, used with ``prefix_sharing``.
        progress: Show a progress bar (prompts).
        **generate_kwargs: Passed to ``model.generate`` (``do_sample`` defaults to False: greedy).

    Returns:
        Texts and token ids in the order of ``prompts``, and :class:`GenerationStats`.
    """
    torch = require("torch", "hf")
    _check_int("max_new_tokens", max_new_tokens)
    _check_int("max_tokens", max_tokens, allow_none=True)
    _check_int("max_batch_size", max_batch_size, allow_none=True)
    if max_tokens is None:
        max_tokens = _default_max_tokens(model)
    generate_kwargs.setdefault("do_sample", False)
    if "past_key_values" in generate_kwargs:
        raise ConfigError("generate() manages the KV cache itself; do not pass past_key_values=")
    if generate_kwargs.get("num_return_sequences", 1) != 1:
        raise ConfigError("num_return_sequences= must be 1 (repeat the prompt to get several outputs)")
    if prefix_sharing and generate_kwargs.get("num_beams", 1) != 1:
        raise ConfigError("prefix_sharing=True works with greedy or sampling only; set num_beams=1")

    start = time.perf_counter()
    ids = tokenize_prompts(tokenizer, prompts)
    n = len(ids)
    prompt_lens = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
    lengths = prompt_lens + max_new_tokens  # (n,) KV-cache tokens each row can reach
    buckets = (
        _expected_buckets(expected_output_lengths, n, max_new_tokens)
        if expected_output_lengths is not None
        else np.zeros(n, dtype=np.int64)
    )
    groups = find_prefix_groups(ids, min_prefix=min_prefix) if prefix_sharing else None

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

    eos = _eos_ids(model, tokenizer, generate_kwargs)
    pad_id = _pad_id(model, tokenizer, eos)
    generate_kwargs.setdefault("pad_token_id", pad_id)
    out_ids: list[list[int]] = [[] for _ in range(n)]
    slots = 0
    cached_group, cache = -1, None
    with _progress(n, "generating", "prompt", progress) as bar:
        for g, batch in jobs:
            prefix: list[int] = []
            past = None
            if g >= 0:
                plen = int(groups.prefix_lengths[g])
                prefix = ids[batch[0]][:plen]
                if g != cached_group:  # one prefill of the prefix per group, kept for its batches
                    cached_group, cache = g, _prefix_cache(model, prefix)
                past = copy.deepcopy(cache)
                past.batch_repeat_interleave(len(batch))
            rows = [ids[i][len(prefix) :] for i in batch]
            input_ids, mask = _left_padded(rows, prefix, pad_id)
            slots += input_ids.size
            kwargs = dict(generate_kwargs)
            if past is not None:
                kwargs["past_key_values"] = past
            with torch.inference_mode():
                out = model.generate(
                    input_ids=torch.from_numpy(input_ids).to(model.device),
                    attention_mask=torch.from_numpy(mask).to(model.device),
                    max_new_tokens=max_new_tokens,
                    **kwargs,
                )
            new = out[:, input_ids.shape[1] :].tolist()
            for i, row in zip(batch.tolist(), new, strict=True):
                cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
                out_ids[i] = row[:cut]
            bar.update(len(batch))
    _sync(getattr(model, "device", None))
    texts = tokenizer.batch_decode(out_ids, skip_special_tokens=True)
    seconds = time.perf_counter() - start
    prompt_tokens = int(prompt_lens.sum())
    saved = groups.tokens_saved if groups is not None else 0
    stats = GenerationStats(
        num_prompts=n,
        num_batches=len(jobs),
        seconds=seconds,
        prompt_tokens=prompt_tokens,
        generated_tokens=sum(len(r) for r in out_ids),
        prompt_token_slots=slots,
        padding_ratio=(slots - prompt_tokens) / slots if slots else 0.0,
        prefill_tokens=prompt_tokens - saved,
        prefill_tokens_saved=saved,
        num_prefix_groups=len(groups) if groups is not None else 0,
        max_tokens=int(max_tokens),
    )
    return GenerationResult(texts, out_ids, prompt_lens.tolist(), stats)


# --------------------------------------------------------------------------------------------------
# Encoding
# --------------------------------------------------------------------------------------------------


def _max_positions(model: Any, tokenizer: Any) -> int:
    limits = [
        getattr(model.config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    limits = [int(x) for x in limits if isinstance(x, int | np.integer) and 0 < x < 1_000_000]
    return min(limits) if limits else 512


def _pool(hidden: Any, mask: Any, pooling: str) -> Any:
    if pooling == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)  # (rows, seq, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def _model_accepts(model: Any, name: str) -> bool:
    import inspect

    return name in inspect.signature(model.forward).parameters


def encode(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_tokens: int | None = None,
    max_batch_size: int | None = None,
    max_length: int | None = None,
    pooling: str | None = "mean",
    normalize: bool = False,
    packed: bool = False,
    progress: bool = True,
) -> EncodeResult:
    """Encode texts with an encoder in token-budget batches of similar length.

    Args:
        model: A transformers encoder (``BertModel``, ``AutoModel``...) or, with ``pooling=None``, a model
            whose output has ``logits`` (e.g. ``BertForSequenceClassification``).
        tokenizer: Its tokenizer.
        texts: The texts.
        max_tokens: Padded tokens (rows × longest) per batch; with ``packed=True`` the tokens of one
            packed row. None: :data:`DEFAULT_MAX_TOKENS` for the model's device.
        max_batch_size: Most texts per batch; None means no limit.
        max_length: Texts are truncated to this many tokens; None means the model's position limit.
        pooling: ``"mean"`` (mean of the token states over the attention mask), ``"cls"`` (the first
            token's state) or None (the model's ``logits``).
        normalize: L2-normalise each output row.
        packed: Several texts per row with no padding, attention kept within each text
            (:func:`smart_batching.attention.enable_packed_attention`, switched on for the call and
            restored after). Needs ``pooling`` "mean" or "cls" and a model that takes ``position_ids``.

    Returns:
        :class:`EncodeResult` with ``(num_texts, dim)`` outputs in the order of ``texts``.
    """
    torch = require("torch", "hf")
    if pooling not in POOLINGS:
        raise ConfigError(f"pooling={pooling!r} must be one of {POOLINGS}")
    _check_int("max_tokens", max_tokens, allow_none=True)
    _check_int("max_batch_size", max_batch_size, allow_none=True)
    _check_int("max_length", max_length, allow_none=True)
    if packed and pooling is None:
        raise ConfigError(
            "packed=True needs pooling='mean' or 'cls': a model head reads one token per row, not per text"
        )
    if packed and not _model_accepts(model, "position_ids"):
        raise ConfigError(
            f"packed=True: {type(model).__name__}.forward takes no position_ids; use packed=False"
        )
    if max_tokens is None:
        max_tokens = _default_max_tokens(model)
    limit = max_length if max_length is not None else _max_positions(model, tokenizer)
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise DataError("texts= must be a sequence of strings")

    start = time.perf_counter()
    ids = tokenizer(list(texts), truncation=True, max_length=limit)["input_ids"] if len(texts) else []
    n = len(ids)
    lengths = np.fromiter((len(r) for r in ids), dtype=np.int64, count=n)
    if n and lengths.min() == 0:
        raise DataError(f"text {int(np.argmin(lengths))} has no tokens; encoding needs at least one")
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    device = model.device
    accepts_types = _model_accepts(model, "token_type_ids")
    outputs: list[Any] = [None] * n
    real = int(lengths.sum())
    slots = 0
    if packed:
        plan = plan_batches(
            lengths, "packed", capacity=max(int(max_tokens), int(lengths.max(initial=1))), shuffle=False
        )
        batches = list(plan)
    else:
        batches = _plan_indices(np.arange(n), lengths, max_tokens, max_batch_size)
    restore = _enable_packed(model) if packed else None
    try:
        # no_grad, not inference_mode, when packed: the packed attention keys its plan cache on tensor
        # version counters, which inference tensors do not have.
        grad_off = torch.no_grad() if packed else torch.inference_mode()
        with _progress(n, "encoding", "text", progress) as bar, grad_off:
            for batch in batches:
                rows = [ids[i] for i in batch]
                if packed:
                    pooled = _encode_packed(model, rows, pooling, accepts_types)
                    slots += sum(len(r) for r in rows)
                else:
                    width = max(len(r) for r in rows)
                    arr = np.full((len(rows), width), pad_id, dtype=np.int64)
                    mask = np.zeros((len(rows), width), dtype=np.int64)
                    for k, r in enumerate(rows):
                        arr[k, : len(r)] = r
                        mask[k, : len(r)] = 1
                    slots += arr.size
                    t_mask = torch.from_numpy(mask).to(device)
                    inputs = {"input_ids": torch.from_numpy(arr).to(device), "attention_mask": t_mask}
                    if accepts_types:
                        inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
                    out = model(**inputs)
                    if pooling is None:
                        pooled = getattr(out, "logits", None)
                        if pooled is None:
                            raise ConfigError(
                                f"pooling=None needs a model with logits; {type(model).__name__} has none"
                            )
                    else:
                        pooled = _pool(out.last_hidden_state, t_mask, pooling)
                if normalize:
                    pooled = torch.nn.functional.normalize(pooled.float(), dim=-1).to(pooled.dtype)
                pooled = pooled.cpu()
                for k, i in enumerate(batch.tolist()):
                    outputs[i] = pooled[k]
                bar.update(len(batch))
    finally:
        if restore is not None:
            restore()
    embeddings = torch.stack(outputs) if n else torch.zeros(0)
    seconds = time.perf_counter() - start
    stats = EncodeStats(
        num_texts=n,
        num_batches=len(batches),
        seconds=seconds,
        real_tokens=real,
        token_slots=slots,
        padding_ratio=(slots - real) / slots if slots else 0.0,
        packed=packed,
        max_tokens=int(max_tokens),
    )
    return EncodeResult(embeddings, stats)


def _enable_packed(model: Any) -> Any:
    """Switch ``model`` to packed attention; returns a function that switches it back."""
    from smart_batching.attention import enable_packed_attention

    old_impl = model.config._attn_implementation
    old_cache = getattr(model.config, "use_cache", None)
    enable_packed_attention(model, backend="auto")

    def restore() -> None:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(old_impl)
        else:
            model.config._attn_implementation = old_impl
        if old_cache is not None:
            model.config.use_cache = old_cache

    return restore


def _encode_packed(model: Any, rows: list[list[int]], pooling: str, accepts_types: bool) -> Any:
    """One packed row of ``rows`` (no padding); returns ``(len(rows), dim)`` pooled states::

    input_ids     a0 a1 a2 b0 b1 c0 c1 c2 c3
    position_ids   0  1  2  0  1  0  1  2  3
    cu_seq_lens_q [0, 3, 5, 9]
    """
    import torch

    device = model.device
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    flat = torch.tensor([t for r in rows for t in r], dtype=torch.long, device=device)[None]
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    starts = cu[:-1].long()
    pos = torch.arange(flat.shape[1]) - torch.repeat_interleave(starts, lens)  # (T,) restarts per text
    inputs: dict[str, Any] = {
        "input_ids": flat,
        "position_ids": pos[None].to(device),
        "cu_seq_lens_q": cu.to(device),
        "cu_seq_lens_k": cu.to(device),
        "max_length_q": int(lens.max()),
        "max_length_k": int(lens.max()),
    }
    if accepts_types:
        inputs["token_type_ids"] = torch.zeros_like(flat)
    hidden = model(**inputs).last_hidden_state[0]  # (T, dim)
    if pooling == "cls":
        return hidden[starts.to(device)]
    seg = torch.repeat_interleave(torch.arange(len(rows)), lens).to(device)  # (T,) text of each token
    sums = torch.zeros(len(rows), hidden.shape[-1], dtype=hidden.dtype, device=device).index_add_(
        0, seg, hidden
    )
    return sums / lens.to(device=device, dtype=hidden.dtype)[:, None]


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
