"""Held-out evaluation that runs only the trained layers: the frozen prefix's output computed once.

When a model trains only its last ``k`` decoder layers (``trainable_layers``), the hidden states entering
its first trained layer depend on the input tokens alone: the embeddings and the layers before it never
change, and eval mode has no dropout. :class:`FrozenPrefixCache` keeps them, per held-out batch, the
first time a batch is evaluated (one full forward, its layers' inputs recorded by
:func:`~smart_batching.compat.capture_layer_inputs`); every later evaluation of the batch runs the trained
layers, the final norm and the LM head only (:func:`~smart_batching.compat.run_decoder_tail`), with the
same inputs, so the logits are the full forward's.

The cache belongs to one bench (its fixed held-out set) and serves every model of it: the initial
weights fill it and each run's fresh copy reuses it while its frozen weights are the same: a SHA-256
digest of their bytes (0.3 s for SmolLM2-135M's embeddings and 26 frozen layers, 480 MB) taken once per
model, and again only when one of its frozen tensors is written in place; the cache holds no copy of
them. A batch is reused only when all its inputs (``input_ids``, ``attention_mask`` or a packed row's
``position_ids`` and ``cu_seq_lens_*``) are equal to the recorded ones.

A model whose structure :mod:`~smart_batching.compat` does not know, with frozen parameters, takes the
full forward with a fallback warning (``eval.frozen_prefix``); a model that trains everything takes it
quietly (there is no prefix to keep).

SmolLM2-135M with its last 4 of 30 layers trained: an evaluation costs the 4 layers and the LM head at
the target positions, about a fifth of the full forward.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from smart_batching import compat
from smart_batching.fallbacks import warn_fallback


@dataclass
class _Entry:
    inputs: dict[str, Any]
    hidden_states: torch.Tensor
    layer_kwargs: list[dict[str, Any]]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _same_inputs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)


def _frozen_tensors(model: Any, start: int) -> list[torch.Tensor]:
    inner = model.model
    modules = [inner.embed_tokens, *inner.layers[:start]]
    return [p.detach() for m in modules for p in m.parameters()]


def _versions(tensors: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    return tuple((t.data_ptr(), t._version) for t in tensors)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(f"{tuple(t.shape)}{t.dtype};".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


class FrozenPrefixCache:
    """The hidden states entering the first trained layer, per held-out batch (see the module doc).

    Attributes:
        num_filled: batches evaluated with the full forward (and recorded).
        num_reused: batches evaluated from the recorded hidden states.
    """

    def __init__(self) -> None:
        self.start: int | None = None
        self.digest: str | None = None
        self.entries: dict[int, _Entry] = {}
        self.num_filled = 0
        self.num_reused = 0
        # model -> (versions of its frozen tensors, their digest)
        self._digests: weakref.WeakKeyDictionary[Any, tuple[tuple[tuple[int, int], ...], str]] = (
            weakref.WeakKeyDictionary()
        )

    def __getstate__(self) -> dict[str, Any]:
        # The cache belongs to the process that fills it: a copy sent to another process (the bench context
        # handed to torchrun ranks, which never evaluate) starts empty, without the recorded hidden states
        # and without the weak references to this process's models, which cannot be pickled.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def _prefix(self, model: Any) -> int:
        """The first trained layer of ``model`` when its prefix can be kept (the cache emptied when its
        frozen weights differ from the recorded ones), else 0."""
        if model.training or not any(not p.requires_grad for p in model.parameters()):
            return 0
        reason = compat.decoder_tail_unsupported(model)
        if reason is not None:
            warn_fallback(
                "eval.frozen_prefix",
                f"held-out loss by the full forward at every evaluation: {reason}",
            )
            return 0
        start = compat.frozen_prefix_length(model)
        if start == 0:
            return 0
        tensors = _frozen_tensors(model, start)
        versions = _versions(tensors)
        seen = self._digests.get(model)
        if seen is None or seen[0] != versions:
            seen = (versions, _digest(tensors))
            self._digests[model] = seen
        if (start, seen[1]) != (self.start, self.digest):
            self.start, self.digest = start, seen[1]
            self.entries.clear()
        return start

    def logits(self, model: Any, index: int, inputs: dict[str, torch.Tensor], logits_to_keep: Any) -> Any:
        """The logits of held-out batch number ``index`` (``inputs``: the model's keyword arguments)
        at ``logits_to_keep``, from the recorded prefix when it is there and still valid."""
        start = self._prefix(model)
        if start == 0:
            return model(**inputs, logits_to_keep=logits_to_keep).logits
        entry = self.entries.get(index)
        if entry is not None and _same_inputs(entry.inputs, inputs):
            self.num_reused += 1
            return compat.run_decoder_tail(
                model, start, entry.hidden_states, entry.layer_kwargs, logits_to_keep
            )
        with compat.capture_layer_inputs(model, start) as captured:
            logits = model(**inputs, logits_to_keep=logits_to_keep, use_cache=False).logits
        recorded = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        self.entries[index] = _Entry(recorded, captured["hidden_states"], captured["layer_kwargs"])
        self.num_filled += 1
        return logits


__all__ = ["FrozenPrefixCache"]
