"""Evening out one optimizer step across ranks, within a strategy's limits (used by :func:`~smart_batching.distributed.distribute`).

- :func:`repartition_step` deals a step's segments again, costliest first to the least-loaded rank;
  :func:`balance_step` moves or swaps single segments between its heaviest and lightest rank.
- :class:`~smart_batching.planners.MicroBatchLimits`: what a micro-batch may hold after balancing, as the
  strategy's spec says (``spec.unit_limits()``).
- Steps these leave uneven are formed again by :mod:`._reform`.

Every segment stays in exactly one micro-batch and no micro-batch is left empty. NumPy, a compiled
deal (ranks in a heap by load: O(segments x log ranks)) and Python over one step's segments; the loops
run only for the uneven steps.
"""

from __future__ import annotations

import heapq

import numpy as np
from numba import njit

from smart_batching.distributed._tuning import (
    BALANCE_TOLERANCE,  # noqa: F401 (re-exported)
    TAIL_POOL_STEPS,
)
from smart_batching.planners import MicroBatchLimits


def argsort_descending(values: np.ndarray) -> np.ndarray:
    """``np.argsort(-values, kind="stable")`` for integer ``values``, by stable radix passes over 16-bit
    keys where the values span less than 2**32 (one pass below 2**16): O(n), about 5x faster than the
    comparison sort on 10M costs."""
    if values.size == 0:
        return np.zeros(0, dtype=np.int64)
    top, low = int(values.max()), int(values.min())
    if top - low >= 2**32:
        return np.argsort(-values, kind="stable")
    key = (top - values).astype(np.uint32)  # ascending key, equal values keep their order
    if top - low < 2**16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    by_low = np.argsort((key & 0xFFFF).astype(np.uint16), kind="stable")
    return by_low[np.argsort((key[by_low] >> 16).astype(np.uint16), kind="stable")]


def gather_segments(order: np.ndarray, start: np.ndarray, end: np.ndarray, units: np.ndarray) -> np.ndarray:
    """The segments of ``units`` (ids into ``start``/``end``; -1 skipped), one after another:
    ``concatenate([order[start[u]:end[u]] for u in units])``, compiled (one pass, no temporaries)."""
    return _gather(order, start, end, np.asarray(units, dtype=np.int64))


@njit(cache=True, nogil=True)
def _gather(order, start, end, units):  # pragma: no cover - compiled
    total = 0
    for u in units:
        if u >= 0:
            total += end[u] - start[u]
    out = np.empty(total, dtype=order.dtype)
    k = 0
    for u in units:
        if u >= 0:
            for i in range(start[u], end[u]):
                out[k] = order[i]
                k += 1
    return out


@njit(cache=True, nogil=True)
def rank_costs(assignment, unit_cost):  # pragma: no cover - compiled
    """``(num_steps, world_size)`` cost of each rank in each step of ``assignment`` ``(num_steps,
    world_size, accum_steps)`` (-1: an empty slot, cost 0)."""
    num_steps, world_size, accum_steps = assignment.shape
    out = np.zeros((num_steps, world_size), dtype=np.int64)
    for s in range(num_steps):
        for r in range(world_size):
            for a in range(accum_steps):
                u = assignment[s, r, a]
                if u >= 0:
                    out[s, r] += unit_cost[u]
    return out


def tail_pool(by_cost: np.ndarray, sizes: np.ndarray, group: int) -> np.ndarray:
    """Units to pool and deal again so that the number of units becomes a multiple of ``group``.

    The ``B mod G`` cheapest units and the step before them, grown by whole steps (at most
    :data:`~._tuning.TAIL_POOL_STEPS`) until the pool holds more segments than its whole steps have
    slots. Where the cheapest units are single examples (near the capacity) that is not enough: the
    units with the most segments to spare join the pool, as few as cover the gap. All of them when no
    choice covers it (fewer examples than slots).

    Args:
        by_cost: (num_units,) unit ids, costliest first.
        sizes: (num_units,) segments per unit.
        group: ``G``, slots per step.

    Returns:
        (pool_units,) ids, the cheapest first (donors last); empty when ``B`` is a multiple of ``G``.
    """
    num = by_cost.shape[0]
    m = num % group
    if not m:
        return np.zeros(0, dtype=np.int64)
    cheap = by_cost[::-1]  # (num,) cheapest first
    takes = m + group * np.arange(1, min(max((num - m) // group, 1), TAIL_POOL_STEPS + 1) + 1)
    held = np.cumsum(sizes[cheap[: min(int(takes[-1]), num)]])  # segments in the cheapest k + 1 units
    slots = -(-takes // group) * group
    enough = (takes >= num) | (held[np.minimum(takes, num) - 1] > slots)
    if enough.any():  # the first pool that holds enough, within the steps allowed
        return cheap[: min(int(takes[int(np.argmax(enough))]), num)]
    take = int(takes[TAIL_POOL_STEPS])
    pool = cheap[:take]
    # Donors: the units with the most segments (ties: the lowest id), a few thousand at most, so only
    # the largest sizes are sorted (counting down from the largest size until they hold twice the gap).
    gap = -(-take // group) * group + group - int(held[take - 1])
    counts = np.bincount(sizes)
    counts[: np.bincount(sizes[pool]).shape[0]] -= np.bincount(sizes[pool])  # (max_size + 1,) outside
    spare = np.cumsum((counts * np.maximum(np.arange(counts.shape[0]) - 1, 0))[::-1])[::-1]
    floor = max(int(np.flatnonzero(spare >= 2 * gap).max(initial=2)), 2)
    outside = np.ones(num, dtype=bool)
    outside[pool] = False
    big = np.flatnonzero((sizes >= floor) & outside)
    donors = big[np.argsort(-sizes[big], kind="stable")]  # most segments first
    units = take + np.arange(1, donors.shape[0] + 1)  # pool units with 1, 2, ... donors
    segments = int(held[take - 1]) + np.cumsum(sizes[donors])
    covered = np.flatnonzero(segments > units + group - m)  # more segments than pieces to make
    if not covered.size:
        return cheap
    return np.concatenate([pool, donors[: int(covered[0]) + 1]])


def halve_units(
    segments: np.ndarray, sizes: np.ndarray, seg_cost: np.ndarray, group: int, remainder: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Split the costliest units with two or more segments in two until the count is ``remainder``
    more than a multiple of ``group``; empty units pad the rest when nothing is left to split (fewer
    segments than slots).

    Units are given and returned as ``(segments, sizes)``: unit ``k`` is the next ``sizes[k]`` of
    ``segments``. Empty units given are dropped. The units not split keep their order, the halves
    follow in the order they were made; ties go to the unit that came first. A heap over (cost,
    order): O(splits log units) plus one vectorised pass, ``group - 1`` splits at most."""
    sizes = np.asarray(sizes, dtype=np.int64)
    firsts = np.cumsum(sizes) - sizes
    keep = sizes > 0
    segments, sizes, firsts = np.asarray(segments, dtype=np.int64), sizes[keep], firsts[keep]
    count = sizes.shape[0]
    if not (count - remainder) % group:
        return segments, sizes
    unit_cost = np.add.reduceat(seg_cost[segments], firsts) if count else np.zeros(0, dtype=np.int64)
    heap = [(-int(unit_cost[i]), int(i)) for i in np.flatnonzero(sizes > 1)]
    heapq.heapify(heap)
    halves: dict[int, np.ndarray] = {}  # creation order -> the segments of a half
    split = np.zeros(count, dtype=bool)
    seq = count
    while (count - remainder) % group and heap:
        _, i = heapq.heappop(heap)
        if i < split.shape[0]:
            split[i] = True
            unit = segments[firsts[i] : firsts[i] + sizes[i]]
        else:
            unit = halves.pop(i)
        cum = np.cumsum(seg_cost[unit])
        cut = int(np.argmin(np.abs(cum[:-1] - cum[-1] / 2))) + 1
        for half, cost in ((unit[:cut], int(cum[cut - 1])), (unit[cut:], int(cum[-1] - cum[cut - 1]))):
            halves[seq] = half
            if half.shape[0] > 1:
                heapq.heappush(heap, (-cost, seq))
            seq += 1
        count += 1
    pad = (remainder - count) % group  # nothing left to split: empty units
    kept = np.flatnonzero(~split)
    parts = [gather_segments(segments, firsts, firsts + sizes, kept)] + [halves[k] for k in sorted(halves)]
    new_sizes = np.concatenate([sizes[kept], [halves[k].shape[0] for k in sorted(halves)], np.zeros(pad)])
    return np.concatenate(parts), new_sizes.astype(np.int64)


def lpt_pieces(
    segs: np.ndarray, seg_cost: np.ndarray, seg_len: np.ndarray, num_pieces: int, limits: MicroBatchLimits
) -> tuple[np.ndarray, np.ndarray] | None:
    """Deal segments, costliest first, each to the cheapest piece that can take it (ties: the lowest
    piece index); None if one fits nowhere. Compiled, with a heap over (load, piece): O(s log pieces)
    for s segments where the cheapest piece takes them.

    Returns:
        ``(segments, sizes)``: piece ``k`` is the next ``sizes[k]`` of ``segments``, in dealing order.
    """
    segs = np.asarray(segs, dtype=np.int64)
    order = segs[np.argsort(-seg_cost[segs], kind="stable")]  # (s,) costliest first
    piece_of = _deal(order, seg_cost, seg_len, num_pieces, 1, limits)
    if piece_of.shape[0] and piece_of[0] < 0:
        return None
    by_piece = np.argsort(piece_of, kind="stable")
    return order[by_piece], np.bincount(piece_of, minlength=num_pieces).astype(np.int64)


_NO_LIMIT = 2**62  # the room of a micro-batch without a length limit


@njit(cache=True, nogil=True, inline="always")
def _before(load, a, b):  # pragma: no cover - compiled
    return load[a] < load[b] or (load[a] == load[b] and a < b)


@njit(cache=True, nogil=True)
def _sift_down(heap, size, i, load):  # pragma: no cover - compiled
    while True:
        c = 2 * i + 1
        if c >= size:
            return
        if c + 1 < size and _before(load, heap[c + 1], heap[c]):
            c += 1
        if not _before(load, heap[c], heap[i]):
            return
        heap[i], heap[c] = heap[c], heap[i]
        i = c


@njit(cache=True, nogil=True)
def _sift_up(heap, i, load):  # pragma: no cover - compiled
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(load, heap[i], heap[parent]):
            return
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent


@njit(cache=True, nogil=True, inline="always")
def _room(rows, tokens, longest, max_unit_tokens, max_tokens, max_rows):  # pragma: no cover - compiled
    """Longest segment a micro-batch still admits (:meth:`MicroBatchLimits.admits` is monotone in the
    length: it admits exactly the segments no longer than this); -1: none; -1 limits are absent."""
    if max_unit_tokens >= 0:
        return max_unit_tokens - tokens
    n_rows = rows + 1
    if max_rows >= 0 and n_rows > max_rows:
        return -1
    if max_tokens < 0:
        return _NO_LIMIT
    if n_rows * longest > max_tokens:
        return -1
    return max_tokens // n_rows


@njit(cache=True, nogil=True)
def _lpt_deal(
    order, seg_cost, seg_len, num_ranks, per_rank, max_unit_tokens, max_tokens, max_rows
):  # pragma: no cover
    """Micro-batch (``rank * per_rank + slot``) of each segment of ``order`` (costliest first): the
    first rank in (load, index) order, and in it the first micro-batch in (load, slot) order, whose
    limits admit the segment, as :meth:`MicroBatchLimits.admits` (-1: no limit). All -1 when a segment fits
    nowhere.

    Ranks sit in a heap by load; a rank too full for the segment at hand is parked in a second heap,
    by the longest segment it still admits, and comes back when a segment that short comes up. So a
    segment costs O(log ranks + per_rank²) plus the parkings, however full the ranks are."""
    s = order.shape[0]
    num_units = num_ranks * per_rank
    unit_of = np.full(s, -1, dtype=np.int64)
    rank_load = np.zeros(num_ranks, dtype=np.int64)
    load = np.zeros(num_units, dtype=np.int64)
    rows = np.zeros(num_units, dtype=np.int64)
    tokens = np.zeros(num_units, dtype=np.int64)
    longest = np.zeros(num_units, dtype=np.int64)
    room = np.full(num_units, _room(0, 0, 0, max_unit_tokens, max_tokens, max_rows), dtype=np.int64)
    neg_room = -np.full(num_ranks, room[0], dtype=np.int64)  # (num_ranks,) the parked heap's key
    heap = np.arange(num_ranks)  # equal loads: index order is already a heap
    size = num_ranks
    parked = np.empty(num_ranks, dtype=np.int64)  # ranks too full for a recent segment, roomiest first
    num_parked = 0
    slots = np.empty(per_rank, dtype=np.int64)
    for i in range(s):
        seg = order[i]
        length = seg_len[seg]
        while num_parked > 0 and -neg_room[parked[0]] >= length:  # roomy enough again
            r = parked[0]
            num_parked -= 1
            parked[0] = parked[num_parked]
            _sift_down(parked, num_parked, 0, neg_room)
            heap[size] = r
            _sift_up(heap, size, rank_load)
            size += 1
        chosen = -1
        while size > 0:
            r = heap[0]
            size -= 1
            heap[0] = heap[size]
            _sift_down(heap, size, 0, rank_load)
            if -neg_room[r] < length:
                parked[num_parked] = r
                _sift_up(parked, num_parked, neg_room)
                num_parked += 1
                continue
            for a in range(per_rank):  # the rank's micro-batches by (load, slot): insertion sort
                u = r * per_rank + a
                b = a
                while b > 0 and load[slots[b - 1]] > load[u]:
                    slots[b] = slots[b - 1]
                    b -= 1
                slots[b] = u
            for a in range(per_rank):
                if room[slots[a]] >= length:
                    chosen = slots[a]
                    break
            break
        if chosen < 0:
            unit_of[:] = -1
            return unit_of
        unit_of[i] = chosen
        r = chosen // per_rank
        load[chosen] += seg_cost[seg]
        rank_load[r] += seg_cost[seg]
        rows[chosen] += 1
        tokens[chosen] += length
        if length > longest[chosen]:
            longest[chosen] = length
        room[chosen] = _room(
            rows[chosen], tokens[chosen], longest[chosen], max_unit_tokens, max_tokens, max_rows
        )
        best = -1
        for a in range(per_rank):
            best = max(best, room[r * per_rank + a])
        neg_room[r] = -best
        heap[size] = r
        _sift_up(heap, size, rank_load)
        size += 1
    return unit_of


def _deal(
    order: np.ndarray,
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    num_ranks: int,
    per_rank: int,
    limits: MicroBatchLimits,
) -> np.ndarray:
    return _lpt_deal(
        order,
        seg_cost.astype(np.int64, copy=False),
        seg_len.astype(np.int64, copy=False),
        num_ranks,
        per_rank,
        -1 if limits.capacity is None else limits.capacity * limits.rows_per_micro_batch,
        -1 if limits.max_tokens is None else limits.max_tokens,
        -1 if limits.max_rows is None else limits.max_rows,
    )


def _group(order: np.ndarray, unit_of: np.ndarray, num_units: int) -> list[list[int]]:
    """Segments of ``order`` grouped by their unit, in dealing order."""
    by_unit = np.argsort(unit_of, kind="stable")
    bounds = np.searchsorted(unit_of[by_unit], np.arange(num_units + 1))
    dealt = order[by_unit].tolist()
    return [dealt[bounds[k] : bounds[k + 1]] for k in range(num_units)]


def _step_imbalance(step: np.ndarray, members: dict[int, list[int]], seg_cost: np.ndarray) -> float:
    rc = [sum(int(seg_cost[members[u]].sum()) for u in step[r] if u >= 0) for r in range(step.shape[0])]
    mean = sum(rc) / len(rc)
    return max(rc) / mean if mean else 1.0


def repartition_step(
    step: np.ndarray,
    members: dict[int, list[int]],
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    limits: MicroBatchLimits,
) -> bool:
    """Pool the step's segments and deal them again, costliest first, to the least-loaded rank (and its
    least-loaded micro-batch) that can take them. Kept only when it is more even and leaves no
    micro-batch empty. Returns whether it was kept."""
    units_of = [[int(u) for u in step[r] if u >= 0] for r in range(step.shape[0])]
    if any(not units for units in units_of):
        return False
    pool = np.concatenate([np.asarray(members[u], dtype=np.int64) for units in units_of for u in units])
    pool = pool[np.argsort(-seg_cost[pool], kind="stable")]
    # Compiled deal where every rank holds the same number of micro-batches (always, but with empty slots).
    per_rank = max(len(units) for units in units_of)
    if any(len(units) != per_rank for units in units_of):
        return _repartition_ragged(step, members, seg_cost, seg_len, limits, units_of, pool)
    slot_of = _deal(pool, seg_cost, seg_len, len(units_of), per_rank, limits)
    if slot_of.shape[0] and slot_of[0] < 0:
        return False
    grouped = _group(pool, slot_of, len(units_of) * per_rank)
    new: dict[int, list[int]] = {
        u: grouped[r * per_rank + a] for r, units in enumerate(units_of) for a, u in enumerate(units)
    }
    return _keep_if_better(step, members, new, seg_cost)


def _repartition_ragged(
    step: np.ndarray,
    members: dict[int, list[int]],
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    limits: MicroBatchLimits,
    units_of: list[list[int]],
    pool: np.ndarray,
) -> bool:
    """:func:`repartition_step` where ranks hold different numbers of micro-batches (rare: empty slots)."""
    new: dict[int, list[int]] = {u: [] for units in units_of for u in units}
    unit_load = dict.fromkeys(new, 0)
    rank_load = [0] * len(units_of)
    for seg in pool.tolist():
        placed = False
        for r in sorted(range(len(units_of)), key=rank_load.__getitem__):
            for u in sorted(units_of[r], key=unit_load.__getitem__):
                if limits.fits(seg_len[new[u] + [seg]]):
                    new[u].append(seg)
                    unit_load[u] += int(seg_cost[seg])
                    rank_load[r] += int(seg_cost[seg])
                    placed = True
                    break
            if placed:
                break
        if not placed:
            return False
    return _keep_if_better(step, members, new, seg_cost)


def _keep_if_better(
    step: np.ndarray, members: dict[int, list[int]], new: dict[int, list[int]], seg_cost: np.ndarray
) -> bool:
    if any(not segs for segs in new.values()):
        return False
    if _step_imbalance(step, new, seg_cost) >= _step_imbalance(step, members, seg_cost):
        return False
    members.update(new)
    return True


def balance_step(
    step: np.ndarray,
    members: dict[int, list[int]],
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    limits: MicroBatchLimits,
    rounds: int,
) -> bool:
    """Even out one step in place: move a segment from the heaviest rank to the lightest, or swap the
    pair that best halves the gap, keeping every micro-batch within the strategy's limits. Returns
    whether anything changed."""
    changed = False
    units_of = [[int(u) for u in step[r] if u >= 0] for r in range(step.shape[0])]
    # Rank costs, kept up to date as the two ranks of each round change (one pass over the step).
    unit_cost = {u: int(seg_cost[members[u]].sum()) for units in units_of for u in units}
    rc = [sum(unit_cost[u] for u in units) for units in units_of]
    for _ in range(rounds):
        hi, lo = int(np.argmax(rc)), int(np.argmin(rc))
        if rc[hi] <= BALANCE_TOLERANCE * (sum(rc) / len(rc)) or not units_of[lo]:
            break
        gap = rc[hi] - rc[lo]
        # Candidates as columns (score, unit_from, i, unit_to, j); j = -1 is a move. Lower score = gap
        # closer to halved. Built with numpy, only the best few become Python tuples.
        cols: list[np.ndarray] = []
        for uh in units_of[hi]:
            hc = seg_cost[members[uh]]
            for ul in units_of[lo]:
                lc = seg_cost[members[ul]]
                if len(members[uh]) > 1:  # a move never empties a micro-batch
                    i = np.flatnonzero(hc < gap)
                    cols.append(
                        np.stack(
                            [
                                np.abs(gap - 2 * hc[i]),
                                np.full_like(i, uh),
                                i,
                                np.full_like(i, ul),
                                -np.ones_like(i),
                            ]
                        )
                    )
                if lc.size:
                    diff = hc[:, None] - lc[None, :]
                    i, j = np.nonzero((diff > 0) & (diff < gap))
                    cols.append(
                        np.stack(
                            [np.abs(gap - 2 * diff[i, j]), np.full_like(i, uh), i, np.full_like(i, ul), j]
                        )
                    )
        table = np.concatenate(cols, axis=1) if cols else np.zeros((5, 0), dtype=np.int64)
        if table.shape[1] > 64:
            table = table[:, np.argpartition(table[0], 63)[:64]]
        cands = sorted(map(tuple, table.T.tolist()))
        for score, uh, i, ul, j in cands:
            if score >= gap:
                break
            a, b = list(members[uh]), list(members[ul])
            if j < 0:
                b.append(a.pop(i))
            else:
                a[i], b[j] = b[j], a[i]
            if limits.fits(seg_len[a]) and limits.fits(seg_len[b]):
                members[uh], members[ul] = a, b
                for u in (uh, ul):
                    unit_cost[u] = int(seg_cost[members[u]].sum())
                for r in (hi, lo):
                    rc[r] = sum(unit_cost[u] for u in units_of[r])
                changed = True
                break
        else:
            break
    return changed
