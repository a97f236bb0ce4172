"""Steps formed around an anchor, compiled: the deal of :mod:`._mix` for pools whose costliest segments
cannot share a micro-batch (a long example that fills a token budget alone).

Dealing a pool towards equal loads leaves a rank that holds such an example below the others, and no
move within its step can lift it. Here each step is formed in turn, the costliest first: rank 0 (the
anchor) takes the costliest segments left, batched as the strategy would, and its cost is the step's
target; every other rank is filled towards the target, best fit first (the costliest segment that
fits under the gap and in a micro-batch with room). The segments left when the pool runs low are
dealt over the remaining steps (with the last few formed steps) and every step is evened out by
:mod:`._mix`'s moves.

Best fit looks up "the costliest segment left costing at most x" in the pool sorted by cost, through
a union-find over taken positions: O(log s) a look-up, O(s log s) a pool of s segments.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from smart_batching.distributed._balance import _room

_PROBES = 8  # segments tried from the best fit down (one may fit no micro-batch, or leave no reach)
_UNBOUNDED = 2**40  # headroom of a micro-batch without a limit (adds without overflow)


@njit(cache=True, nogil=True)
def _find(parent, i):  # pragma: no cover - compiled
    """The largest position ``<= i`` not taken (``parent[j] == j``), -1 if none; halves the paths."""
    root = i
    while root >= 0 and parent[root] != root:
        root = parent[root]
    while i >= 0 and parent[i] != i:
        nxt = parent[i]
        parent[i] = root
        i = nxt
    return root


@njit(cache=True, nogil=True, inline="always")
def _headroom(rows, tokens, longest, unit_tokens, max_tokens, max_rows, power):  # pragma: no cover
    """Most cost a micro-batch could still take in segments no longer than its longest one
    (:meth:`MicroBatchLimits.headroom`): unbounded when empty or without a limit or a known cost."""
    if rows == 0 or power == 0:
        return _UNBOUNDED
    if unit_tokens >= 0:
        free = unit_tokens - tokens
        return free if power == 1 else free * free
    most = _UNBOUNDED if max_rows < 0 else max_rows
    if max_tokens >= 0:
        most = min(most, max_tokens // max(longest, 1))
    if most == _UNBOUNDED:
        return _UNBOUNDED
    return max(0, most - rows) * (longest if power == 1 else longest * longest)


@njit(cache=True, nogil=True)
def anchored_steps(
    cost,
    length,
    num_steps,
    num_ranks,
    per_rank,
    fill_tol,
    loose_tol,
    power,
    unit_tokens,
    max_tokens,
    max_rows,
    planned_rows,
):  # pragma: no cover - compiled
    """Form steps around an anchor (module docstring) from segments sorted by cost, ascending.

    Args:
        cost, length: (s,) of each segment, ascending in cost.
        num_steps, num_ranks, per_rank: the steps to make, of ``num_ranks`` ranks of ``per_rank``
            micro-batches each.
        fill_tol: a rank stops this close under the target; ``loose_tol``: a pick after which the rank
            can reach only this close is taken where none leaves it in closer reach.
        power: cost as a power of length (1: tokens, 2: attention; 0: neither, so the width a micro-batch
            has room for does not bound the cost).
        unit_tokens, max_tokens, max_rows: the strategy's limits (-1: none); ``planned_rows`` the
            planned batch size the anchor keeps to (-1: none).

    Returns:
        ``(mb_of, formed, used)``: the micro-batch ``(step * num_ranks + rank) * per_rank + slot`` of each
        segment placed (-1: left for the deal), the steps formed, and the segments of each.
    """
    s = cost.shape[0]
    parent = np.arange(s)
    mb_of = np.full(s, -1, dtype=np.int64)
    used = np.zeros(num_steps, dtype=np.int64)
    group = num_ranks * per_rank
    m_cost = np.zeros(group, dtype=np.int64)
    m_tok = np.zeros(group, dtype=np.int64)
    m_rows = np.zeros(group, dtype=np.int64)
    m_long = np.zeros(group, dtype=np.int64)
    left = s
    low = 0  # no position below this one is free
    formed = 0
    for st in range(num_steps):
        later = (num_steps - st - 1) * group  # micro-batches of the steps after this one
        if left < group + later or (st > 0 and left - used[st - 1] < later):
            break  # too few left for a step like the last: the rest is dealt
        m_cost[:] = 0
        m_tok[:] = 0
        m_rows[:] = 0
        m_long[:] = 0
        base = st * group
        target = 0
        for r in range(num_ranks):
            rows_cap = planned_rows if (r == 0 and planned_rows >= 0) else max_rows
            have = 0
            while left > 0:
                while low < s and parent[low] != low:
                    low += 1
                empties = 0
                first_empty = -1
                for a in range(per_rank):
                    if m_rows[r * per_rank + a] == 0:
                        empties += 1
                        if first_empty < 0:
                            first_empty = r * per_rank + a
                # Micro-batches still to get one segment at least, after this pick.
                reserve = later + (num_ranks - r - 1) * per_rank + max(empties - 1, 0)
                if left - 1 < reserve and empties == 0:
                    break
                if r == 0 and empties == 0:
                    i = _find(
                        parent, s - 1
                    )  # the anchor: the costliest left while it fits (a batch as planned)
                else:
                    if r == 0:
                        bound = cost[s - 1]
                    elif left - 1 < reserve:
                        bound = cost[low]  # only enough left to fill the empty ones: the cheapest
                    else:
                        if empties == 0 and have * fill_tol >= target:
                            break
                        bound = target - have - max(empties - 1, 0) * cost[low]
                        if bound <= 0:
                            if empties == 0:
                                break
                            bound = cost[low]
                    # The widest segment a candidate micro-batch (the first empty one, else any) takes.
                    widest = -1
                    for a in range(per_rank):
                        m = r * per_rank + a
                        if first_empty < 0 or m == first_empty:
                            widest = max(
                                widest,
                                _room(m_rows[m], m_tok[m], m_long[m], unit_tokens, max_tokens, rows_cap),
                            )
                    cap = bound
                    if power == 1:
                        cap = min(cap, widest)
                    elif power == 2 and widest < 2**31:  # wider: no width limit to speak of
                        cap = min(cap, widest * widest)
                    j0, j1 = 0, s  # past the last position costing at most cap
                    while j0 < j1:
                        mid = (j0 + j1) // 2
                        if cost[mid] <= cap:
                            j0 = mid + 1
                        else:
                            j1 = mid
                    i = _find(parent, j0 - 1)
                # Of the best fit and a few below it, the first after which the rank can still reach
                # the target (a long example that fills a micro-batch alone may not), else the first
                # that can reach it loosely, else the first that fits.
                picks = np.full(3, -1, dtype=np.int64)  # tight, loose, any: segment
                slots = np.full(3, -1, dtype=np.int64)  # and its micro-batch
                for _ in range(1 if (r == 0 and empties == 0) else _PROBES):
                    if i < 0:
                        break
                    chosen = -1
                    for a in range(per_rank):  # the cheapest candidate micro-batch with room
                        m = r * per_rank + a
                        if first_empty >= 0 and m != first_empty:
                            continue
                        room = _room(m_rows[m], m_tok[m], m_long[m], unit_tokens, max_tokens, rows_cap)
                        if length[i] <= room and (chosen < 0 or m_cost[m] < m_cost[chosen]):
                            chosen = m
                    if chosen >= 0:
                        reach = have + cost[i]
                        for a in range(per_rank):
                            m = r * per_rank + a
                            rows, tok, big = m_rows[m], m_tok[m], m_long[m]
                            if m == chosen:
                                rows, tok, big = rows + 1, tok + length[i], max(big, length[i])
                            reach += _headroom(rows, tok, big, unit_tokens, max_tokens, max_rows, power)
                        for tier, bar in enumerate((target / fill_tol, target / loose_tol, -1.0)):
                            if picks[tier] < 0 and (r == 0 or reach >= bar):
                                picks[tier], slots[tier] = i, chosen
                        if picks[0] >= 0:
                            break
                    i = _find(parent, i - 1)
                chosen = -1
                for tier in range(3):
                    if picks[tier] >= 0:
                        i, chosen = picks[tier], slots[tier]
                        break
                if chosen < 0:
                    if empties:
                        return mb_of, -1, used  # an empty micro-batch that no segment near fits
                    break
                mb_of[i] = base + chosen
                parent[i] = i - 1
                left -= 1
                used[st] += 1
                m_cost[chosen] += cost[i]
                m_tok[chosen] += length[i]
                m_rows[chosen] += 1
                m_long[chosen] = max(m_long[chosen], length[i])
                have += cost[i]
            if r == 0:
                target = have
            for a in range(per_rank):
                if m_rows[r * per_rank + a] == 0:
                    return mb_of, -1, used
        formed += 1
    return mb_of, formed, used
