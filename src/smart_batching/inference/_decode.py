"""Greedy decoding with continuous batching: finished rows leave the batch, queued prompts join it.

``model.generate`` keeps a batch together until its longest answer ends, and on a CPU one decode step
costs about as much for 8 rows as for 20 (the weights are read once per step: SmolLM2-135M, 1 thread,
118 ms for 8 rows, 132 ms for 16, 179 ms for 32). This loop keeps the batch full instead: every step
drops the rows that ended (end-of-sequence token or ``max_new_tokens``) from the batch and from the KV
cache, and admits queued prompts while the token budget allows.

The KV cache is one padded ``DynamicCache`` whose rows are right-aligned: every row's newest token sits
in the last column, its padding on the left. Prompts join as a left-padded prefill of their own,
merged under the running rows (the narrower side gets padding columns on its left), and columns that
are padding in every row are cut when rows leave::

    running rows          + prefilled prompts      = next step's cache        attention_mask
    . a a a a a A          . . d d D               . a a a a a A a'           0 1 1 1 1 1 1 1
    c c c c c c C          e e e e E               c c c c c c C c'           1 1 1 1 1 1 1 1
                                                   . . . d d D d'             0 0 0 1 1 1 1 1
                                                   . . e e e E e'             0 0 1 1 1 1 1 1

``position_ids`` count each row's real tokens, so every row sees the positions it would see alone and
greedy outputs equal one-prompt-at-a-time runs (``tests/test_inference.py``).

Memory: a row reserves ``prompt + max_new_tokens`` tokens, and rows are admitted while
``rows x largest reservation <= max_tokens``, so the padded cache (rows x width) never exceeds the
budget, as with :func:`~smart_batching.inference.generate`'s planned batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Generation-config fields that change greedy outputs, with the values that leave them unchanged.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "do_sample": (None, False),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "force_words_ids": (None,),
    "constraints": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "sequence_bias": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "stop_strings": (None,),
    "max_time": (None,),
    "penalty_alpha": (None,),
    "dola_layers": (None,),
    "prompt_lookup_num_tokens": (None,),
    "remove_invalid_values": (None, False),
}
# Keyword arguments the loop reads itself (the rest of the generation config does not affect greedy).
_OWN_KWARGS = {"pad_token_id", "eos_token_id", "bos_token_id", "use_cache"}


def greedy_model_blocker(model: Any) -> str | None:
    """Why the continuous-batching loop cannot run ``model``; None if it can.

    It can for a decoder-only model whose forward takes ``position_ids``, ``attention_mask`` and a KV
    cache (under the name :func:`~smart_batching.compat.cache_kwarg` reads from the model: ``cache`` on
    transformers >= 5.24, ``past_key_values`` before), with a plain dynamic KV cache.
    """
    from smart_batching import compat

    if getattr(model.config, "is_encoder_decoder", False):
        return "the model is an encoder-decoder"
    missing = [n for n in ("position_ids", "attention_mask") if not compat.forward_accepts(model, n)]
    if compat.cache_kwarg(model) is None:
        missing.append(" or ".join(compat.CACHE_KWARGS))
    if missing:
        return f"{type(model).__name__}.forward takes no {', '.join(missing)}"
    layers = compat.new_dynamic_cache(model).layers
    layer_class = compat.dynamic_layer_class()
    if not layers or any(type(layer) is not layer_class for layer in layers):
        return "the model's cache is not a plain DynamicCache (sliding windows or the like)"
    return None


def greedy_settings_blocker(model: Any, generate_kwargs: Mapping[str, Any]) -> str | None:
    """Why these generation settings are not plain greedy decoding (sampling, beams, logits
    processors, stopping criteria or streamers, in the call or in ``model.generation_config``); None if
    they are."""
    config = getattr(model, "generation_config", None)
    settings = config.to_dict() if config is not None else {}
    for name in generate_kwargs:
        if name not in _NEUTRAL and name not in _OWN_KWARGS and name not in settings:
            return f"generate keyword {name}= is not a generation-config field"
    settings.update(generate_kwargs)
    for name, neutral in _NEUTRAL.items():
        if settings.get(name) not in neutral:
            return f"{name}={settings[name]!r} changes greedy decoding"
    return None


def greedy_loop_blocker(model: Any, generate_kwargs: Mapping[str, Any]) -> str | None:
    """Why the continuous-batching loop cannot stand in for ``model.generate`` here; None if it can
    (:func:`greedy_model_blocker`, then :func:`greedy_settings_blocker`)."""
    return greedy_model_blocker(model) or greedy_settings_blocker(model, generate_kwargs)


@dataclass
class DecodeStats:
    """Counters of one :func:`greedy_continuous` call (rows are prompts in the running batch)."""

    num_prefills: int = 0
    prompt_token_slots: int = 0
    num_decode_steps: int = 0
    decode_rows: int = 0  # rows summed over decode steps
    outputs: dict[int, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Job:
    """A prompt to generate for: its index in the caller's list, token ids and shared prefix (tokens
    already in ``prefix_cache``; 0 and None without one)."""

    index: int
    ids: list[int]
    group: int = -1
    prefix_length: int = 0


@functools.cache
def _buffer_layer() -> type:
    """``DynamicLayer`` that writes new tokens in place into a preallocated buffer.

    ``DynamicLayer.update`` concatenates: every decode step copies the whole cache (half of a
    SmolLM2-135M decode step on the CPU, 12 rows of 150 tokens). Here the step writes one column::

        buffer  (rows, kv_heads, capacity, head_dim)   [k k k k k k k|. . . .]
        keys    buffer[:, :, :width] (a view)           ^ width        ^ capacity
    """
    from smart_batching.compat import dynamic_layer_class

    class BufferLayer(dynamic_layer_class()):  # type: ignore[misc]
        capacity = 0  # columns to allocate when the buffer is (re)made; at least what is needed

        def install(self, keys: Any, values: Any, width: int) -> None:
            """Take ``keys``/``values`` (rows, kv_heads, capacity, head_dim) holding ``width`` columns."""
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True
            self.buffers = (keys, values)
            self.keys, self.values = keys[:, :, :width], values[:, :, :width]

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
            old = self.keys.shape[2]
            width = old + key_states.shape[2]
            buffers = getattr(self, "buffers", None)
            if buffers is None or buffers[0].shape[2] < width or buffers[0].shape[0] != key_states.shape[0]:
                shape = list(key_states.shape)
                shape[2] = max(width, self.capacity)
                buffers = (key_states.new_empty(shape), value_states.new_empty(shape))
                buffers[0][:, :, :old].copy_(self.keys)
                buffers[1][:, :, :old].copy_(self.values)
            buffers[0][:, :, old:width].copy_(key_states)
            buffers[1][:, :, old:width].copy_(value_states)
            self.install(*buffers, width)
            return self.keys, self.values

    return BufferLayer


class _Batch:
    """The running rows: a right-aligned padded KV cache and, per row, what the next step feeds."""

    def __init__(self, cache: Any, mask: Any, positions: Any, last: Any, jobs: list[Job], reserve: list[int]):
        self.cache = cache  # DynamicCache of buffer layers: keys/values (rows, kv_heads, width, head_dim)
        self.mask = mask  # (rows, width) 1 for real tokens
        self.positions = positions  # (rows,) position id of the token fed next
        self.last = last  # (rows,) token fed next
        self.jobs = jobs
        self.reserve = reserve  # prompt + max_new_tokens of each row

    def __len__(self) -> int:
        return len(self.jobs)

    def keep(self, rows: Any) -> None:
        """Keep ``rows`` (an index tensor) and cut the columns that are padding in all of them."""
        mask = self.mask.index_select(0, rows)
        lead = int(mask.any(0).long().argmax()) if len(rows) else mask.shape[1]
        width = mask.shape[1] - lead
        keep = rows.tolist()
        capacity = max((self.reserve[i] for i in keep), default=0)  # no row outgrows its reservation
        for layer in self.cache.layers:
            bufs = []
            for src in (layer.keys, layer.values):
                shape = list(src.shape)
                shape[0], shape[2] = len(keep), max(capacity, width)
                buf = src.new_empty(shape)
                _copy_rows(src.narrow(2, lead, width), rows, buf.narrow(2, 0, width))
                bufs.append(buf)
            layer.install(*bufs, width)
        self.mask = mask[:, lead:]
        self.positions = self.positions.index_select(0, rows)
        self.last = self.last.index_select(0, rows)
        self.jobs = [self.jobs[i] for i in keep]
        self.reserve = [self.reserve[i] for i in keep]

    def extend(self, other: _Batch) -> None:
        """Append ``other``'s rows, right-aligned: the narrower cache gets padding columns on its left."""
        import torch

        width = max(self.mask.shape[1], other.mask.shape[1])
        capacity = max(width, *self.reserve, *other.reserve)
        n, m = len(self), len(other)

        def stack(a: Any, b: Any, dim: int, cols: int) -> Any:  # a: (n, ..., wa, ...), b: (m, ..., wb, ...)
            shape = list(a.shape)
            shape[0], shape[dim] = n + m, cols
            out = a.new_empty(shape)
            for rows, src in ((out.narrow(0, 0, n), a), (out.narrow(0, n, m), b)):
                pad = width - src.shape[dim]
                rows.narrow(dim, 0, pad).zero_()  # padding must be finite: masked, but multiplied by 0
                rows.narrow(dim, pad, src.shape[dim]).copy_(src)
            return out

        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            keys = stack(mine.keys, theirs.keys, 2, capacity)
            values = stack(mine.values, theirs.values, 2, capacity)
            mine.install(keys, values, width)
        self.mask = stack(self.mask, other.mask, 1, width)
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])
        self.jobs += other.jobs
        self.reserve += other.reserve


def _copy_rows(src: Any, rows: Any, out: Any) -> None:
    """``out[i] = src[rows[i]]`` without a temporary (``out`` may be a strided view)."""
    for i, r in enumerate(rows.tolist()):
        if out.data_ptr() != src.data_ptr() or i != r:
            out[i].copy_(src[r])


def _new_cache(model: Any, prefix_cache: Any, rows: int, capacity: int) -> Any:
    """A ``DynamicCache`` of buffer layers for ``rows`` rows: empty, or holding ``prefix_cache``
    (batch 1) expanded to ``rows`` rows as views (copied once, into the buffer)."""
    from smart_batching.compat import new_dynamic_cache

    cache = new_dynamic_cache(model)
    layer_class = _buffer_layer()
    cache.layers = [layer_class() for _ in cache.layers]
    for layer in cache.layers:
        layer.capacity = capacity
    if prefix_cache is not None:
        for layer, src in zip(cache.layers, prefix_cache.layers, strict=True):
            layer.lazy_initialization(src.keys, src.values)
            layer.keys = src.keys.expand(rows, -1, -1, -1)
            layer.values = src.values.expand(rows, -1, -1, -1)
    return cache


def greedy_continuous(
    model: Any,
    jobs: Sequence[Job],
    *,
    max_new_tokens: int,
    max_tokens: int,
    max_batch_size: int | None,
    eos: set[int],
    pad_id: int,
    prefix_cache: Callable[[int, list[int]], Any],
    on_done: Callable[[int], None] = lambda n: None,
) -> DecodeStats:
    """Greedy outputs of ``jobs``, admitted in order under the token budget.

    Args:
        model: A decoder-only transformers model (:func:`greedy_loop_blocker` returned None).
        jobs: Prompts in admission order; a group's jobs must be consecutive (its prefix's KV cache is
            asked for once, when its first job is admitted).
        max_new_tokens: Most new tokens per prompt.
        max_tokens: Budget of the running batch: rows x largest (prompt + ``max_new_tokens``). A prompt
            over the budget runs alone.
        max_batch_size: Most rows in the running batch; None means no limit.
        eos: End-of-sequence token ids (a row ends after emitting one).
        pad_id: Token id written in padding (masked out).
        prefix_cache: ``(group, prefix token ids) -> DynamicCache`` of batch 1.
        on_done: Called with the number of rows that just finished.

    Returns:
        :class:`DecodeStats`, with each job's new token ids (up to and including the first
        end-of-sequence token) in ``outputs``.
    """
    import torch

    from smart_batching.compat import cache_kwarg, forward_accepts

    stats = DecodeStats()
    keep_last = forward_accepts(model, "logits_to_keep")
    cache_name = cache_kwarg(model)  # "cache" on transformers >= 5.24, "past_key_values" before
    cap = max_batch_size or len(jobs) or 1
    reserve = [len(j.ids) + max_new_tokens for j in jobs]
    batch: _Batch | None = None
    cached: tuple[int, Any] = (-1, None)
    nxt = 0  # next job to admit

    def admit() -> None:
        nonlocal batch, cached, nxt
        while nxt < len(jobs):
            rows = len(batch) if batch is not None else 0
            widest = max(batch.reserve, default=0) if batch is not None else 0
            end = nxt
            while (
                end < len(jobs)
                and jobs[end].group == jobs[nxt].group
                and rows + end - nxt < cap
                and (rows + end - nxt + 1) * max(widest, reserve[end]) <= max_tokens
            ):
                widest = max(widest, reserve[end])
                end += 1
            if end == nxt and rows == 0:
                end = nxt + 1  # over the budget on its own: it runs alone
            if end == nxt:
                return
            chunk = list(jobs[nxt:end])
            group, plen = chunk[0].group, chunk[0].prefix_length
            if group >= 0 and cached[0] != group:  # one prefill of the prefix per group
                cached = (group, prefix_cache(group, chunk[0].ids[:plen]))
            prefix = cached[1] if group >= 0 else None
            new = _prefill(model, chunk, reserve[nxt:end], prefix, pad_id, keep_last, cache_name, stats)
            _finish(new, max_new_tokens, eos, stats, on_done)
            if len(new):
                if batch is None or len(batch) == 0:
                    batch = new
                else:
                    batch.extend(new)
            nxt = end

    with torch.inference_mode():
        admit()
        while batch is not None and len(batch):
            ones = batch.mask.new_ones((len(batch), 1))
            batch.mask = torch.cat([batch.mask, ones], dim=1)
            out = model(
                input_ids=batch.last[:, None],
                attention_mask=batch.mask,
                position_ids=batch.positions[:, None],
                use_cache=True,
                **{cache_name: batch.cache},
            )
            batch.last = out.logits[:, -1].float().argmax(-1)
            batch.positions = batch.positions + 1
            stats.num_decode_steps += 1
            stats.decode_rows += len(batch)
            if _finish(batch, max_new_tokens, eos, stats, on_done):
                admit()
    return stats


def _prefill(
    model: Any,
    chunk: list[Job],
    reserve: list[int],
    prefix_cache: Any,
    pad_id: int,
    keep_last: bool,
    cache_name: str,
    stats: DecodeStats,
) -> _Batch:
    """Run ``chunk``'s prompts (after the shared prefix, if any) as one left-padded batch::

        [P P P P] _ _ a a      position_ids 0 1 2 3 . . 4 5
        [P P P P] b b b b      position_ids 0 1 2 3 4 5 6 7

    Returns the rows with their first new token as ``last``.
    """
    import torch

    device = model.device
    plen = chunk[0].prefix_length if prefix_cache is not None else 0
    rows = [j.ids[plen:] for j in chunk]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), plen + width), dtype=torch.long)
    mask[:, :plen] = 1
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, plen + width - len(r) :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    cache = _new_cache(model, prefix_cache, len(rows), max(reserve))
    kwargs: dict[str, Any] = {cache_name: cache}
    if keep_last:
        kwargs["logits_to_keep"] = 1
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions[:, plen:], use_cache=True, **kwargs
    )
    stats.num_prefills += 1
    stats.prompt_token_slots += mask.numel()  # the prefix counted in every row, as without reuse
    first = out.logits[:, -1].float().argmax(-1)
    return _Batch(cache, mask, positions[:, -1] + 1, first, list(chunk), list(reserve))


def _finish(
    batch: _Batch, max_new_tokens: int, eos: set[int], stats: DecodeStats, on_done: Callable[[int], None]
) -> bool:
    """Record each row's newest token (``batch.last``); drop the rows that ended. True if any did."""
    import torch

    tokens = batch.last.tolist()
    done = []
    for k, (job, token) in enumerate(zip(batch.jobs, tokens, strict=True)):
        out = stats.outputs.setdefault(job.index, [])
        out.append(token)
        if len(out) >= max_new_tokens or token in eos:
            done.append(k)
    if not done:
        return False
    keep = torch.tensor(
        sorted(set(range(len(batch))) - set(done)), dtype=torch.long, device=batch.last.device
    )
    batch.keep(keep)
    on_done(len(done))
    return True


__all__ = [
    "DecodeStats",
    "Job",
    "greedy_continuous",
    "greedy_loop_blocker",
    "greedy_model_blocker",
    "greedy_settings_blocker",
]
