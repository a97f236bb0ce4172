"""Evening out one optimizer step across ranks, within a strategy's limits (used by :func:`~smart_batching.distributed.distribute`).

- :func:`repartition_step` deals a step's segments again, costliest first to the least-loaded rank;
  :func:`balance_step` moves or swaps single segments between its heaviest and lightest rank.
- :class:`~smart_batching.planners.UnitLimits`: what a micro-batch may hold after balancing, as the
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

from smart_batching.distributed._tuning import BALANCE_TOLERANCE  # noqa: F401 (re-exported)
from smart_batching.planners import UnitLimits


def halve_units(units: list[list[int]], seg_cost: np.ndarray, group: int) -> list[list[int]] | None:
    """Split the costliest units with two or more segments in two until the count is a multiple of
    ``group``; empty units pad the rest when nothing is left to split (fewer segments than slots).

    Ties go to the unit that came first (the halves of a split unit come after all others), found
    through a heap over (cost, order): O(splits log units), where a scan of every unit per split grew
    with the world size (group - 1 splits at most)."""
    units = [u for u in units if u]
    if not len(units) % group:
        return units
    lengths = np.array([len(u) for u in units], dtype=np.int64)
    flat = np.concatenate([np.asarray(u, dtype=np.int64) for u in units])
    unit_cost = np.add.reduceat(seg_cost[flat], np.concatenate([[0], np.cumsum(lengths)[:-1]])).tolist()
    by_seq = dict(enumerate(units))  # creation order -> unit
    heap = [(-int(c), i) for i, c in enumerate(unit_cost) if lengths[i] > 1]
    heapq.heapify(heap)
    seq = len(units)
    count = len(units)
    while count % group:
        if not heap:
            by_seq.update({seq + k: [] for k in range((-count) % group)})
            break
        _, i = heapq.heappop(heap)
        unit = by_seq.pop(i)
        cum = np.cumsum(seg_cost[unit])
        cut = int(np.argmin(np.abs(cum[:-1] - cum[-1] / 2))) + 1
        for half, cost in ((unit[:cut], int(cum[cut - 1])), (unit[cut:], int(cum[-1] - cum[cut - 1]))):
            by_seq[seq] = half
            if len(half) > 1:
                heapq.heappush(heap, (-cost, seq))
            seq += 1
        count += 1
    return [by_seq[k] for k in sorted(by_seq)]


def lpt_pieces(
    segs: np.ndarray, seg_cost: np.ndarray, seg_len: np.ndarray, num_pieces: int, limits: UnitLimits
) -> list[list[int]] | None:
    """Deal segments, costliest first, each to the cheapest piece that can take it (ties: the lowest
    piece index); None if one fits nowhere. Compiled, with a heap over (load, piece): O(s log pieces)
    for s segments where the cheapest piece takes them (it was O(s · pieces log pieces), the cost that
    grew with the world size)."""
    segs = np.asarray(segs, dtype=np.int64)
    order = segs[np.argsort(-seg_cost[segs], kind="stable")]  # (s,) costliest first
    piece_of = _deal(order, seg_cost, seg_len, num_pieces, 1, limits)
    if piece_of.shape[0] and piece_of[0] < 0:
        return None
    return _group(order, piece_of, num_pieces)


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


@njit(cache=True, nogil=True)
def _lpt_deal(
    order, seg_cost, seg_len, num_ranks, per_rank, max_unit_tokens, max_tokens, max_rows
):  # pragma: no cover
    """Micro-batch (``rank * per_rank + slot``) of each segment of ``order`` (costliest first): the
    first rank in (load, index) order, and in it the first micro-batch in (load, slot) order, whose
    limits admit the segment, as :meth:`UnitLimits.admits` (-1: no limit). All -1 when a segment fits
    nowhere. Ranks sit in a heap, so a segment the cheapest rank takes costs O(log ranks + per_rank²)."""
    s = order.shape[0]
    num_units = num_ranks * per_rank
    unit_of = np.full(s, -1, dtype=np.int64)
    rank_load = np.zeros(num_ranks, dtype=np.int64)
    load = np.zeros(num_units, dtype=np.int64)
    rows = np.zeros(num_units, dtype=np.int64)
    tokens = np.zeros(num_units, dtype=np.int64)
    longest = np.zeros(num_units, dtype=np.int64)
    heap = np.arange(num_ranks)  # equal loads: index order is already a heap
    held = np.empty(num_ranks, dtype=np.int64)  # ranks popped that could not take the segment
    slots = np.empty(per_rank, dtype=np.int64)
    for i in range(s):
        seg = order[i]
        length = seg_len[seg]
        size = num_ranks
        num_held = 0
        chosen = -1
        while size > 0 and chosen < 0:
            r = heap[0]
            size -= 1
            heap[0] = heap[size]
            _sift_down(heap, size, 0, rank_load)
            for a in range(per_rank):  # the rank's micro-batches by (load, slot): insertion sort
                u = r * per_rank + a
                b = a
                while b > 0 and load[slots[b - 1]] > load[u]:
                    slots[b] = slots[b - 1]
                    b -= 1
                slots[b] = u
            for a in range(per_rank):
                u = slots[a]
                n_rows = rows[u] + 1
                big = longest[u] if longest[u] > length else length
                if max_unit_tokens >= 0:
                    ok = tokens[u] + length <= max_unit_tokens
                else:
                    ok = not (max_rows >= 0 and n_rows > max_rows)
                    if ok and max_tokens >= 0 and n_rows * big > max_tokens:
                        ok = False
                if ok:
                    chosen = u
                    break
            if chosen < 0:
                held[num_held] = r
                num_held += 1
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
        for h in range(num_held):
            heap[size] = held[h]
            _sift_up(heap, size, rank_load)
            size += 1
        heap[size] = r
        _sift_up(heap, size, rank_load)
    return unit_of


def _deal(
    order: np.ndarray,
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    num_ranks: int,
    per_rank: int,
    limits: UnitLimits,
) -> np.ndarray:
    return _lpt_deal(
        order,
        seg_cost.astype(np.int64, copy=False),
        seg_len.astype(np.int64, copy=False),
        num_ranks,
        per_rank,
        -1 if limits.capacity is None else limits.capacity * limits.rows_per_unit,
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
    limits: UnitLimits,
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
    limits: UnitLimits,
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
    limits: UnitLimits,
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
