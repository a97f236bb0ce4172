"""Segment plans: where each packed example starts, from cu_seq_lens or restarting position_ids (cached)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from smart_batching.errors import ConfigError

# --------------------------------------------------------------------------------------------------
# Segment plans
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _SegmentPlan:
    """How to cut ``T`` flattened tokens into segments and batch equal-length segments together.

    ``groups`` holds one entry per distinct segment length ``L``: ``(L, index)`` where ``index`` is a
    ``(num_segments_of_length_L, L)`` long tensor of token positions, or, when the group is a single
    segment, its ``int`` start offset (sliced as a view, no gather). ``order`` lists, for each segment in
    token order, ``(group, member)`` so outputs can be put back in place with one ``torch.cat``.
    ``cu_seq_lens`` is the int32 ``(num_segments + 1,)`` offsets tensor varlen kernels take.
    """

    num_tokens: int
    lengths: tuple[int, ...]
    groups: tuple[tuple[int, torch.Tensor | int], ...]
    order: tuple[tuple[int, int], ...]
    max_length: int
    cu_seq_lens: torch.Tensor


def _group_segments(
    starts: list[int], lengths: list[int], device: torch.device
) -> tuple[tuple[tuple[int, torch.Tensor | int], ...], tuple[tuple[int, int], ...]]:
    """``(groups, order)`` of a :class:`_SegmentPlan` for segments at ``starts`` of ``lengths`` (empty
    segments left out; the segments need not tile the row)."""
    by_length: dict[int, list[int]] = {}
    for seg, length in enumerate(lengths):
        if length > 0:
            by_length.setdefault(length, []).append(seg)
    groups: list[tuple[int, torch.Tensor | int]] = []
    order: list[tuple[int, int] | None] = [None] * len(lengths)
    for length, segs in by_length.items():
        g = len(groups)
        if len(segs) == 1:
            groups.append((length, starts[segs[0]]))
        else:
            seg_starts = torch.tensor([starts[s] for s in segs], device=device, dtype=torch.long)
            # index: (num_segments_of_this_length, length)
            index = seg_starts[:, None] + torch.arange(length, device=device)
            groups.append((length, index))
        for member, seg in enumerate(segs):
            order[seg] = (g, member)
    return tuple(groups), tuple(o for o in order if o is not None)


def _plan_from_starts(starts: list[int], num_tokens: int, device: torch.device) -> _SegmentPlan:
    ends = starts[1:] + [num_tokens]
    lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    groups, order = _group_segments(starts, lengths, device)
    return _SegmentPlan(
        num_tokens=num_tokens,
        lengths=tuple(lengths),
        groups=groups,
        order=order,
        max_length=max(lengths, default=0),
        cu_seq_lens=torch.tensor([*starts, num_tokens], device=device, dtype=torch.int32),
    )


class _PlanCache:
    """Remembers the plan of the last boundary tensor seen, so the layers of one forward share it.

    Keyed by the tensor's identity (through a weak reference, so a freed tensor never matches) and
    its in-place version counter; every layer of a forward receives the same ``cu_seq_lens_q`` or
    ``position_ids`` object, so the host sync that turns boundaries into a plan happens once.
    """

    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._key: tuple | None = None
        self._plan: _SegmentPlan | None = None

    def get(self, tensor: torch.Tensor, key: tuple) -> _SegmentPlan | None:
        if self._ref is not None and self._ref() is tensor and self._key == key:
            return self._plan
        return None

    def put(self, tensor: torch.Tensor, key: tuple, plan: _SegmentPlan) -> None:
        try:
            self._ref = weakref.ref(tensor)
        except TypeError:  # pragma: no cover - tensors support weak references
            self._ref = None
            return
        self._key, self._plan = key, plan


_PLAN_CACHE = _PlanCache()


def _is_tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _plan_from_cu_seq_lens(cu: torch.Tensor, num_tokens: int, device: torch.device) -> _SegmentPlan:
    key = ("cu", cu._version, num_tokens, str(device))
    plan = None if _is_tracing() else _PLAN_CACHE.get(cu, key)
    if plan is None:
        bounds = [int(b) for b in cu.tolist()]
        if (
            bounds[0] != 0
            or bounds[-1] != num_tokens
            or any(b > a for a, b in zip(bounds[1:], bounds[:-1], strict=True))
        ):
            raise ConfigError(
                f"cu_seq_lens_q must rise from 0 to the number of tokens ({num_tokens}); got "
                f"{bounds[:8]}{'...' if len(bounds) > 8 else ''}. Build the batch with PackingCollator."
            )
        plan = _plan_from_starts(bounds[:-1], num_tokens, device)
        if not _is_tracing():
            _PLAN_CACHE.put(cu, key, plan)
    return plan


def segment_starts_from_position_ids(position_ids: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Flattened start offsets of the segments that ``position_ids`` describe.

    A segment starts at the beginning of each row and wherever a position is not the previous one plus
    one (the rule transformers uses to detect packed ``position_ids``).

    Args:
        position_ids: ``(batch, seq)`` or ``(1, seq)`` (broadcast over the batch) token positions.
        batch_size: Rows in the batch.

    Returns:
        ``(num_segments,)`` long tensor of offsets into the flattened ``batch * seq`` tokens.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    position_ids = position_ids.expand(batch_size, -1)
    seq = position_ids.shape[1]
    flat = position_ids.reshape(-1)
    is_start = torch.ones_like(flat, dtype=torch.bool)
    is_start[1:] = flat[1:] != flat[:-1] + 1
    is_start[::seq] = True
    return is_start.nonzero().flatten()


def _plan_from_position_ids(
    position_ids: torch.Tensor, batch_size: int, device: torch.device
) -> _SegmentPlan:
    num_tokens = batch_size * position_ids.shape[-1]
    key = ("pos", position_ids._version, batch_size, str(device))
    plan = None if _is_tracing() else _PLAN_CACHE.get(position_ids, key)
    if plan is None:
        starts = segment_starts_from_position_ids(position_ids, batch_size).tolist()
        plan = _plan_from_starts(starts, num_tokens, device)
        if not _is_tracing():
            _PLAN_CACHE.put(position_ids, key, plan)
    return plan
