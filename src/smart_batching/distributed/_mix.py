"""Forming uneven steps again with donor steps, compiled (used by :func:`~smart_batching.distributed.distribute`).

A step still uneven after :mod:`._balance` holds segments too coarse to even out among its own ranks
(the cheapest step of a packed plan of near-capacity examples: one example per micro-batch, a few
short ones alone). It is pooled with donor steps, its neighbours in cost order and the steps with the
most segments to spare (the fine material that closes gaps), and the pool is formed into as many
steps again (:func:`mix_steps`):

1. deal: the pool's segments, costliest first, each to the cheapest of ``k × world_size`` rank loads
   of ``accum_steps`` micro-batches that admits it (re-forms the micro-batches), or its units whole,
   as many to every load (keeps the strategy's batches); a micro-batch left empty takes the cheapest
   segment of a micro-batch that holds several, of its own rank first; where neither gets within
   :data:`~._tuning.MIX_TOLERANCE`, the steps are also formed one by one around an anchor
   (:mod:`._anchor`: a long example that fills a token budget alone gets partners built to its cost);
2. even out all loads towards their common mean, then sort them by cost and cut them into ``k`` steps
   of ``world_size`` (like loads share a step), and even out each step: passes that pair the heaviest
   rank with the lightest and move one segment between them or swap two, whichever brings the pair
   closest to even, within the strategy's limits and emptying no micro-batch (every move lowers
   Σ cost², so it ends).

:func:`mix_uneven` tries pools of 1, 2, 4, ... donors per uneven step and keeps the first whose steps
are all within :data:`~._tuning.REFORM_TOLERANCE`; a step it cannot even out is left as it was for
:mod:`._reform` (token budgets whose long examples fill a micro-batch alone). Cost: O(s log s) for a
pool of s segments plus the moves (each O(segments of two ranks × log)), no Python loop per segment.
Every segment stays in exactly one micro-batch, no micro-batch is left empty, the step count holds.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from smart_batching.distributed._anchor import anchored_steps
from smart_batching.distributed._balance import (
    MicroBatchLimits,
    _deal,
    _sift_down,
    gather_segments,
    rank_costs,
)
from smart_batching.distributed._tuning import (
    FILL_TOLERANCE,
    MAX_MIX_DONORS,
    MIX_GIVE_UP_LEVELS,
    MIX_KEEP_TOLERANCE,
    MIX_SEGMENT_BUDGET,
    MIX_TOLERANCE,
    REFORM_TOLERANCE,
    TAIL_STEPS,
)


@njit(cache=True, nogil=True, inline="always")
def _admits(rows, tokens, longest, unit_tokens, max_tokens, max_rows):  # pragma: no cover - compiled
    """:meth:`MicroBatchLimits.admits` (no slack-free ``planned`` mode); -1: no such limit."""
    if unit_tokens >= 0:
        return tokens <= unit_tokens
    if max_rows >= 0 and rows > max_rows:
        return False
    return max_tokens < 0 or rows * longest <= max_tokens


@njit(cache=True, nogil=True)
def _fill_empty(mb_of, cost, num_mbs, per_rank):  # pragma: no cover - compiled
    """Give every empty micro-batch one segment, in place: the cheapest segment of its own rank that
    sits in a micro-batch of two or more (the rank's cost is unchanged), else the cheapest such segment
    anywhere. A segment alone always fits its limits. False when there are too few segments."""
    s = mb_of.shape[0]
    rows = np.zeros(num_mbs, dtype=np.int64)
    for i in range(s):
        rows[mb_of[i]] += 1
    by_mb = np.argsort(mb_of, kind="mergesort")  # (s,) rank-major: a rank's segments are contiguous
    num_ranks = num_mbs // per_rank
    rank_start = np.zeros(num_ranks + 1, dtype=np.int64)
    for i in range(s):
        rank_start[mb_of[i] // per_rank + 1] += 1
    for r in range(num_ranks):
        rank_start[r + 1] += rank_start[r]
    for m in range(num_mbs):
        if rows[m]:
            continue
        r = m // per_rank
        best = -1
        for j in range(rank_start[r], rank_start[r + 1]):
            i = by_mb[j]
            if rows[mb_of[i]] >= 2 and (best < 0 or cost[i] < cost[best]):
                best = i
        if best >= 0:
            rows[mb_of[best]] -= 1
            mb_of[best] = m
            rows[m] = 1
    cheap = np.argsort(cost, kind="mergesort")  # (s,) cheapest first
    p = 0
    for m in range(num_mbs):
        if rows[m]:
            continue
        while p < s and rows[mb_of[cheap[p]]] < 2:  # a micro-batch only loses rows here: skip for good
            p += 1
        if p == s:
            return False
        i = cheap[p]
        rows[mb_of[i]] -= 1
        mb_of[i] = m
        rows[m] = 1
        p += 1
    return True


_PASSES = 64  # most pairing passes over one set of ranks
_PARTNERS = 64  # lightest ranks tried against the heaviest where a pass changes nothing
_ROOM = 16  # segments a rank may gain by moves (room kept in its segment list)


@njit(cache=True, nogil=True)
def _state(mb_of, length, cost, num_ranks, per_rank):  # pragma: no cover - compiled
    """Running totals of a deal: per micro-batch tokens, rows and longest segment; per rank cost and
    its segments, ``segs[first[r] : first[r] + fill[r]]`` (with :data:`_ROOM` spare places)."""
    num_mbs = num_ranks * per_rank
    m_tok = np.zeros(num_mbs, dtype=np.int64)
    m_rows = np.zeros(num_mbs, dtype=np.int64)
    m_long = np.zeros(num_mbs, dtype=np.int64)
    r_cost = np.zeros(num_ranks, dtype=np.int64)
    first = np.zeros(num_ranks + 1, dtype=np.int64)
    for i in range(mb_of.shape[0]):
        m = mb_of[i]
        m_tok[m] += length[i]
        m_rows[m] += 1
        m_long[m] = max(m_long[m], length[i])
        r_cost[m // per_rank] += cost[i]
        first[m // per_rank + 1] += 1
    for r in range(num_ranks):
        first[r + 1] += first[r] + _ROOM
    segs = np.empty(first[num_ranks], dtype=np.int64)
    fill = np.zeros(num_ranks, dtype=np.int64)
    for i in range(mb_of.shape[0]):
        r = mb_of[i] // per_rank
        segs[first[r] + fill[r]] = i
        fill[r] += 1
    return m_tok, m_rows, m_long, r_cost, first, segs, fill


@njit(cache=True, nogil=True)
def _best_op(h, lo, mb_of, cost, length, per_rank, state, limits):  # pragma: no cover - compiled
    """The move of one segment of rank ``h`` to rank ``lo``, or the swap of one of each, that leaves
    the two closest to even, within the limits and emptying no micro-batch. Returns ``(x, y, b)``:
    segment ``x`` of ``h`` goes to micro-batch ``b`` of ``lo`` and ``y`` (-1 for a move) comes back;
    ``x = -1`` when nothing brings them closer."""
    m_tok, m_rows, m_long, r_cost, first, segs, fill = state
    unit_tokens, max_tokens, max_rows = limits
    gap = r_cost[h] - r_cost[lo]
    nl = fill[lo]
    light = segs[first[lo] : first[lo] + nl].copy()
    light = light[np.argsort(cost[light], kind="mergesort")]  # (nl,) lo's segments by cost
    can_move = nl < first[lo + 1] - first[lo]
    # Moving delta from h to lo leaves the pair |gap - 2 delta| apart: below gap is closer.
    best, bx, by, bmb = gap, -1, -1, -1
    for k in range(fill[h]):
        x = segs[first[h] + k]
        a = mb_of[x]
        cx = cost[x]
        if can_move and m_rows[a] > 1 and cx < gap and abs(gap - 2 * cx) < best:
            for b in range(lo * per_rank, lo * per_rank + per_rank):
                if _admits(
                    m_rows[b] + 1, m_tok[b] + length[x], max(m_long[b], length[x]),
                    unit_tokens, max_tokens, max_rows,
                ):  # fmt: skip
                    best, bx, by, bmb = abs(gap - 2 * cx), x, -1, b
                    break
        want = cx - gap / 2  # the ideal partner's cost
        j0, j1 = 0, nl
        while j0 < j1:
            mid = (j0 + j1) // 2
            if cost[light[mid]] < want:
                j0 = mid + 1
            else:
                j1 = mid
        for j in range(max(j0 - 3, 0), min(j0 + 3, nl)):
            y = light[j]
            d = cx - cost[y]
            if d <= 0 or d >= gap or abs(gap - 2 * d) >= best:
                continue
            b = mb_of[y]
            # The longest after the swap is at most the larger of the two: a safe check.
            if _admits(
                m_rows[a], m_tok[a] - length[x] + length[y], max(m_long[a], length[y]),
                unit_tokens, max_tokens, max_rows,
            ) and _admits(
                m_rows[b], m_tok[b] - length[y] + length[x], max(m_long[b], length[x]),
                unit_tokens, max_tokens, max_rows,
            ):  # fmt: skip
                best, bx, by, bmb = abs(gap - 2 * d), x, y, b
    return bx, by, bmb


@njit(cache=True, nogil=True)
def _apply(h, lo, x, y, b, mb_of, cost, length, per_rank, state):  # pragma: no cover - compiled
    """Carry out :func:`_best_op`'s choice and bring the running totals up to date."""
    m_tok, m_rows, m_long, r_cost, first, segs, fill = state
    a = mb_of[x]
    mb_of[x] = b
    m_tok[a] -= length[x]
    m_tok[b] += length[x]
    r_cost[h] -= cost[x]
    r_cost[lo] += cost[x]
    for k in range(first[h], first[h] + fill[h]):
        if segs[k] == x:
            if y < 0:
                segs[k] = segs[first[h] + fill[h] - 1]
            else:
                segs[k] = y
            break
    if y < 0:
        fill[h] -= 1
        m_rows[a] -= 1
        m_rows[b] += 1
        segs[first[lo] + fill[lo]] = x
        fill[lo] += 1
    else:
        mb_of[y] = a
        m_tok[a] += length[y]
        m_tok[b] -= length[y]
        r_cost[h] += cost[y]
        r_cost[lo] -= cost[y]
        for k in range(first[lo], first[lo] + fill[lo]):
            if segs[k] == y:
                segs[k] = x
                break
    for m, r in ((a, h), (b, lo)):  # the exact longest of the two micro-batches changed
        big = 0
        for k in range(first[r], first[r] + fill[r]):
            if mb_of[segs[k]] == m:
                big = max(big, length[segs[k]])
        m_long[m] = big


@njit(cache=True, nogil=True)
def _balance_ranks(ranks, tol, mb_of, cost, length, per_rank, state, limits):  # pragma: no cover - compiled
    """Even out ``ranks`` until the heaviest is within ``tol`` of their mean: passes that pair the
    k-th heaviest rank with the k-th lightest (one :func:`_best_op` each), and where a pass changes
    nothing, the heaviest rank with each of the lightest :data:`_PARTNERS`. Each op lowers Σ cost²."""
    r_cost = state[3]
    mean = r_cost[ranks].sum() / ranks.shape[0]
    heaviest = np.inf
    for _ in range(_PASSES):
        ranks = ranks[np.argsort(r_cost[ranks], kind="mergesort")]
        if r_cost[ranks[-1]] <= tol * mean or r_cost[ranks[-1]] >= heaviest:
            return  # even, or the last pass did not lower the heaviest rank
        heaviest = r_cost[ranks[-1]]
        ops = 0
        i, j = 0, ranks.shape[0] - 1
        while i < j and r_cost[ranks[j]] > tol * mean:
            x, y, b = _best_op(ranks[j], ranks[i], mb_of, cost, length, per_rank, state, limits)
            if x >= 0:
                _apply(ranks[j], ranks[i], x, y, b, mb_of, cost, length, per_rank, state)
                ops += 1
            i += 1
            j -= 1
        if ops:
            continue
        h = ranks[-1]  # no pair came closer: the heaviest against each of the lightest few
        for t in range(min(_PARTNERS, ranks.shape[0] - 1)):
            x, y, b = _best_op(h, ranks[t], mb_of, cost, length, per_rank, state, limits)
            if x >= 0:
                _apply(h, ranks[t], x, y, b, mb_of, cost, length, per_rank, state)
                break
        else:
            return


@njit(cache=True, nogil=True)
def _even_out(mb_of, cost, length, num_steps, num_ranks, per_rank, tol, limits, regroup):  # pragma: no cover
    """Step 2 of the module docstring, in place on ``mb_of`` (flat ``(load, slot)`` micro-batch of each
    segment, ``num_steps * num_ranks`` loads): with ``regroup``, every load evened out towards the mean
    of all and the loads sorted by cost into steps of ``num_ranks``; then each step evened out."""
    num_loads = num_steps * num_ranks
    state = _state(mb_of, length, cost, num_loads, per_rank)
    if regroup:
        _balance_ranks(np.arange(num_loads), tol, mb_of, cost, length, per_rank, state, limits)
        place = np.empty(num_loads, dtype=np.int64)
        place[np.argsort(-state[3], kind="mergesort")] = np.arange(num_loads)
        for i in range(mb_of.shape[0]):
            mb_of[i] = place[mb_of[i] // per_rank] * per_rank + mb_of[i] % per_rank
        state = _state(mb_of, length, cost, num_loads, per_rank)
    for st in range(num_steps):
        ranks = np.arange(st * num_ranks, (st + 1) * num_ranks)
        _balance_ranks(ranks, tol, mb_of, cost, length, per_rank, state, limits)


@njit(cache=True, nogil=True)
def _deal_units(unit_cost, num_loads, per_load):  # pragma: no cover - compiled
    """Slot (``load * per_load + k``) of each unit, costliest first to the cheapest load with a free
    slot (ties: the lowest load); ``len(unit_cost) == num_loads * per_load``. A heap over the loads
    with a free slot: O(units log loads)."""
    order = np.argsort(-unit_cost, kind="mergesort")
    slot_of = np.empty(unit_cost.shape[0], dtype=np.int64)
    load = np.zeros(num_loads, dtype=np.int64)
    used = np.zeros(num_loads, dtype=np.int64)
    heap = np.arange(num_loads)  # equal loads: index order is already a heap
    size = num_loads
    for u in order:
        r = heap[0]
        slot_of[u] = r * per_load + used[r]
        used[r] += 1
        load[r] += unit_cost[u]
        if used[r] == per_load:
            size -= 1
            heap[0] = heap[size]
        _sift_down(heap, size, 0, load)
    return slot_of


def _limit_args(limits: MicroBatchLimits) -> tuple[int, int, int]:
    return (
        -1 if limits.capacity is None else limits.capacity * limits.rows_per_micro_batch,
        -1 if limits.max_tokens is None else limits.max_tokens,
        -1 if limits.max_rows is None else limits.max_rows,
    )


def step_imbalance(mb_of: np.ndarray, cost: np.ndarray, num_steps: int, world_size: int, accum_steps: int):
    """(num_steps,) max / mean rank cost of each step of a flat ``(step, rank, slot)`` assignment."""
    rank_cost = np.bincount(mb_of // accum_steps, weights=cost, minlength=num_steps * world_size)
    rank_cost = rank_cost.reshape(num_steps, world_size)
    mean = rank_cost.mean(axis=1)
    return np.divide(rank_cost.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def mix_steps(
    segs: np.ndarray,
    unit_sizes: np.ndarray,
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    num_steps: int,
    world_size: int,
    accum_steps: int,
    limits: MicroBatchLimits,
) -> tuple[float, np.ndarray, np.ndarray] | None:
    """Form ``num_steps`` steps from the segments ``segs`` (the units of a few steps, ``unit_sizes``
    segments each, one after another).

    Two deals are evened out (steps 2-4 of the module docstring) and the more even kept: the segments
    dealt one by one (re-forms the micro-batches: what packed rows of single examples need) and the
    units dealt whole, as many to every rank (keeps the strategy's batches: what token budgets need,
    where a segment dealt alone can leave a micro-batch without room for its like).

    Returns:
        ``(imbalance, order, mb_of)``: the worst step's max / mean rank cost; the segments and, for
        each, its micro-batch ``(step * world_size + rank) * accum_steps + slot``, every micro-batch
        non-empty. None when neither deal can be made.
    """
    num_mbs = num_steps * world_size * accum_steps
    if segs.shape[0] < num_mbs:
        return None
    limit_args = _limit_args(limits)
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    order = segs[np.argsort(-seg_cost[segs], kind="stable")]  # (s,) costliest first
    mb_of = _deal(order, seg_cost, seg_len, num_steps * world_size, accum_steps, limits)
    cost = seg_cost[order].astype(np.int64)
    if not (mb_of.shape[0] and mb_of[0] < 0) and _fill_empty(mb_of, cost, num_mbs, accum_steps):
        length = seg_len[order].astype(np.int64)
        _even_out(mb_of, cost, length, num_steps, world_size, accum_steps, MIX_TOLERANCE, limit_args, True)
        best = (float(step_imbalance(mb_of, cost, num_steps, world_size, accum_steps).max()), order, mb_of)
    if unit_sizes.shape[0] == num_mbs and (best is None or best[0] > MIX_TOLERANCE):
        cost = seg_cost[segs].astype(np.int64)
        firsts = np.cumsum(unit_sizes) - unit_sizes
        unit_cost = np.add.reduceat(cost, firsts) if segs.size else np.zeros(0, dtype=np.int64)
        mb_of = np.repeat(_deal_units(unit_cost, num_steps * world_size, accum_steps), unit_sizes)
        length = seg_len[segs].astype(np.int64)
        _even_out(mb_of, cost, length, num_steps, world_size, accum_steps, MIX_TOLERANCE, limit_args, True)
        score = float(step_imbalance(mb_of, cost, num_steps, world_size, accum_steps).max())
        if best is None or score < best[0]:
            best = (score, segs, mb_of)
    if best is None or best[0] > MIX_TOLERANCE:
        anchored = _anchored_deal(segs, seg_cost, seg_len, num_steps, world_size, accum_steps, limits)
        if anchored is not None and (best is None or anchored[0] < best[0]):
            best = anchored
    return best


def _anchored_deal(
    segs: np.ndarray,
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    num_steps: int,
    world_size: int,
    accum_steps: int,
    limits: MicroBatchLimits,
) -> tuple[float, np.ndarray, np.ndarray] | None:
    """The third deal of :func:`mix_steps`: steps formed around an anchor (:mod:`._anchor`), the rest
    (alone, or with the last formed step or three) dealt and every step evened out; the most even."""
    group = world_size * accum_steps
    asc = segs[np.argsort(seg_cost[segs], kind="stable")]  # (s,) cheapest first
    cost = seg_cost[asc].astype(np.int64)
    length = seg_len[asc].astype(np.int64)
    power = 1 if np.array_equal(cost, length) else 2 if np.array_equal(cost, length * length) else 0
    limit_args = _limit_args(limits)
    planned = -1 if limits.batch_size is None else limits.batch_size
    formed_of, formed, _ = anchored_steps(
        cost,
        length,
        num_steps,
        world_size,
        accum_steps,
        FILL_TOLERANCE,
        REFORM_TOLERANCE,
        power,
        *limit_args,
        planned,
    )
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for back in sorted({0, 1, min(TAIL_STEPS, formed)}) if formed > 0 else ():
        keep = formed - back
        mb_of = np.where(formed_of < keep * group, formed_of, -1)
        rest = np.flatnonzero(mb_of < 0)[::-1]  # (r,) costliest first
        steps_left = num_steps - keep
        if rest.shape[0] < steps_left * group or (rest.shape[0] and not steps_left):
            continue
        if rest.shape[0]:
            dealt = _deal(asc[rest], seg_cost, seg_len, steps_left * world_size, accum_steps, limits)
            if (dealt.shape[0] and dealt[0] < 0) or not _fill_empty(
                dealt, cost[rest], steps_left * group, accum_steps
            ):
                continue
            mb_of[rest] = keep * group + dealt
        _even_out(mb_of, cost, length, num_steps, world_size, accum_steps, MIX_TOLERANCE, limit_args, False)
        score = float(step_imbalance(mb_of, cost, num_steps, world_size, accum_steps).max())
        if best is None or score < best[0]:
            best = (score, asc, mb_of)
    return best


def _imbalance(rank_cost: np.ndarray) -> np.ndarray:
    return rank_cost.max(axis=1) / np.maximum(rank_cost.mean(axis=1), 1e-9)


def mix_uneven(
    assignment: np.ndarray,
    rank_cost: np.ndarray,
    order: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    seg_cost: np.ndarray,
    seg_len: np.ndarray,
    limits: MicroBatchLimits,
    keep_below: float = MIX_KEEP_TOLERANCE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Form every step more than :data:`REFORM_TOLERANCE` uneven again with donor steps, in place.

    Args:
        assignment: ``(num_steps, world_size, accum_steps)`` unit ids (-1: empty slot), steps in cost
            order (the costliest first, as dealt).
        rank_cost: ``(num_steps, world_size)`` cost of each rank at each step.
        order, start, end: unit ``u`` is the segments ``order[start[u]:end[u]]``.
        seg_cost, seg_len: per segment of the base plan.
        limits: what a micro-batch may hold.
        keep_below: where no pool gets a step within the tolerance, the most even result that beats
            the step as it was is kept if its worst step is under this (else the step is left as it
            was, for :mod:`._reform`: a partial result can hamper it).

    Returns:
        ``(assignment, rank_cost, new_segments, new_sizes)``: the assignment and rank costs given,
        updated (formed steps keep their positions), and the new units, numbered from ``len(start)``
        on, ``new_sizes[k]`` segments each, one after another in ``new_segments`` (so that they
        extend ``order``).

    Work outside the compiled deals is O(num_steps) per uneven step plus the pools: the whole plan is
    read once.
    """
    num_steps, world_size, accum_steps = assignment.shape
    group = world_size * accum_steps
    base = start.shape[0]
    sizes = end - start
    imbalance = _imbalance(rank_cost)
    spare = rank_costs(assignment, sizes - 1).sum(axis=1)  # (num_steps,) segments beyond one per slot
    # Formed units, numbered from `base`: their segments new_order[new_start[k]:new_start[k + 1]].
    new_sizes: list[np.ndarray] = []
    flat, new_start = np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    budget = MIX_SEGMENT_BUDGET
    for s in np.flatnonzero(imbalance > REFORM_TOLERANCE).tolist():
        if imbalance[s] <= REFORM_TOLERANCE or budget <= 0:
            continue  # evened out as a donor of an earlier step
        donors = np.argsort(-spare, kind="stable")  # (num_steps,) most segments to spare first
        by_cost = np.argsort(-rank_cost.sum(axis=1), kind="stable")  # (num_steps,) costliest first
        at = int(np.flatnonzero(by_cost == s)[0])
        best: tuple[float, np.ndarray, np.ndarray, np.ndarray] | None = None
        reach, misses = 1, 0
        while True:
            near = by_cost[max(0, at - reach) : at + reach + 1]  # its neighbours in cost order
            chosen = np.union1d(near, donors[:reach])
            units = assignment[chosen].reshape(-1)
            old, new = units[(units >= 0) & (units < base)], units[units >= base] - base
            pool = np.concatenate(
                [
                    gather_segments(order, start, end, old),
                    gather_segments(flat, new_start[:-1], new_start[1:], new),
                ]
            )
            pool_sizes = np.concatenate([sizes[old], new_start[new + 1] - new_start[new]])
            budget -= pool.shape[0]
            found = mix_steps(
                pool, pool_sizes, seg_cost, seg_len, chosen.shape[0], world_size, accum_steps, limits
            )
            misses += 1
            if found is not None and found[0] < (best[0] if best else float(imbalance[chosen].max())):
                best, misses = (found[0], chosen, found[1], found[2]), 0
            if best is not None and best[0] <= REFORM_TOLERANCE:
                break
            if chosen.shape[0] >= min(num_steps, MAX_MIX_DONORS + 1) or budget <= 0:
                break
            if best is not None and best[0] <= MIX_KEEP_TOLERANCE and misses >= MIX_GIVE_UP_LEVELS:
                break  # good enough, and larger pools stopped helping
            reach *= 2
        if best is None or best[0] >= keep_below:
            continue
        _, chosen, seg_order, mb_of = best
        by_mb = np.argsort(mb_of, kind="stable")
        counts = np.bincount(mb_of, minlength=chosen.shape[0] * group)  # (k * group,) segments per unit
        ids = base + new_start.shape[0] - 1 + np.arange(counts.shape[0])
        new_sizes.append(counts)
        flat = np.concatenate([flat, seg_order[by_mb]])
        new_start = np.concatenate([new_start, new_start[-1] + np.cumsum(counts)])
        assignment[chosen] = ids.reshape(chosen.shape[0], world_size, accum_steps)
        rank_cost[chosen] = np.bincount(
            mb_of // accum_steps, weights=seg_cost[seg_order], minlength=chosen.shape[0] * world_size
        ).reshape(chosen.shape[0], world_size)
        imbalance[chosen] = _imbalance(rank_cost[chosen])
        spare[chosen] = (counts - 1).reshape(chosen.shape[0], -1).sum(axis=1)
    if not new_sizes:
        return assignment, rank_cost, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return assignment, rank_cost, flat, np.concatenate(new_sizes)
