"""Forming uneven steps again (used by :func:`~smart_batching.distributed.distribute` after :mod:`._balance`).

- :class:`Reformer` forms new steps from a pool of segments: the first rank of a step takes the
  costliest segments left, batched as the strategy would, and sets the step's target; every other rank
  is filled towards it, best fit first (a long example that would fill a token budget alone is passed
  over for shorter ones that reach the target together). The last segments of the pool are dealt over
  the steps still to make, every rank of a step taking as many segments as the others.
- :func:`reform_uneven` dissolves the steps still uneven with their neighbours in cost order and the
  finest steps (1, 2, 4, ... on each side) and forms them again with the :class:`Reformer`.

Every segment stays in exactly one micro-batch, no micro-batch is left empty and the number of steps
is kept where that can be even (``reform_uneven`` adds steps only where it cannot). Pure NumPy and
Python over a few steps' segments; the loops run only for the uneven steps.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator

import numpy as np
from numba import njit

from smart_batching.distributed._balance import MicroBatchLimits, balance_step
from smart_batching.distributed._tuning import (
    BALANCE_TOLERANCE,
    FILL_RETRIES,
    FILL_TOLERANCE,
    GIVE_UP_INFEASIBLE,
    GIVE_UP_LEVELS,
    GIVE_UP_SEGMENTS,
    HALVE_CANDIDATES,
    MAX_REFORM_SEGMENTS,
    PROBE_LADDER,
    PROBE_WIDTH,
    REFORM_BUDGET_RANKS,
    REFORM_TOLERANCE,
    TAIL_STEPS,
)


def heap_cost(load: Load) -> int:
    """A load's cost, as a heap of loads keys it."""
    return sum(mb.cost for mb in load)


class _Pool:
    """Segments not yet placed, in ascending cost: best-fit look-ups by bisection."""

    def __init__(self, segs: np.ndarray, seg_cost: np.ndarray, seg_len: np.ndarray | None = None) -> None:
        order = np.argsort(seg_cost[segs], kind="stable")
        self.segs: list[int] = segs[order].tolist()
        self.costs: list[int] = seg_cost[segs[order]].tolist()
        self.seg_len = seg_len
        self.tokens = int(seg_len[segs].sum()) if seg_len is not None else 0  # tokens in the pool

    def __len__(self) -> int:
        return len(self.segs)

    def at_most(self, bound: float) -> int:
        """Index of the costliest segment costing at most ``bound``; -1 if none."""
        return bisect.bisect_right(self.costs, bound) - 1

    def pop(self, i: int) -> int:
        del self.costs[i]
        seg = self.segs.pop(i)
        if self.seg_len is not None:
            self.tokens -= int(self.seg_len[seg])
        return seg

    def push(self, seg: int, cost: int) -> None:
        i = bisect.bisect_right(self.costs, cost)
        self.costs.insert(i, cost)
        self.segs.insert(i, seg)
        if self.seg_len is not None:
            self.tokens += int(self.seg_len[seg])


def _probes(pool: _Pool, bound: float) -> Iterator[int]:
    """Pool indices to try for a best fit under ``bound``: the nearest few, then a few near each of a
    ladder of lower costs (a rank held back by a row limit needs a much shorter segment)."""
    top = pool.at_most(bound)
    last = top + 1  # indices below this one are not yet tried
    for f in PROBE_LADDER:
        if last <= 0:
            return
        j = min(pool.at_most(pool.costs[top] * f), last - 1)
        yield from range(j, max(j - PROBE_WIDTH, -1), -1)
        last = max(j - PROBE_WIDTH + 1, 0)


class _Batch:
    """A micro-batch being formed: its segments and running totals."""

    __slots__ = ("segs", "cost", "tokens", "longest")

    def __init__(
        self,
        segs: list[int] | None = None,
        seg_cost: np.ndarray | None = None,
        seg_len: np.ndarray | None = None,
    ) -> None:
        self.segs: list[int] = []
        self.cost = self.tokens = self.longest = 0
        for seg in segs or []:
            self.add(seg, int(seg_cost[seg]), int(seg_len[seg]))

    def add(self, seg: int, cost: int, length: int) -> None:
        self.segs.append(seg)
        self.cost += cost
        self.tokens += length
        self.longest = max(self.longest, length)


Load = list[_Batch]  # one rank's micro-batches of one step


class Reformer:
    """Forms steps from a pool of segments so that every rank of a step carries the same cost.

    Rank 0 of a step takes the costliest segments left, batched as the strategy would (its cost is the
    step's target); every other rank is filled towards the target, best fit first, preferring segments
    after which the target stays in reach (a long example that fills a token budget alone is passed
    over). Leftover gaps are closed by swapping segments with the pool, then between ranks. The last
    segments (the cheapest) are dealt, costliest first, over the steps still to make: a
    :class:`Reformer` returns as many steps as it was given.
    """

    def __init__(
        self,
        seg_cost: np.ndarray,
        seg_len: np.ndarray,
        limits: MicroBatchLimits,
        world_size: int,
        accum_steps: int,
        cost: str,
        rounds: int,
    ) -> None:
        self.seg_cost, self.seg_len, self.limits = seg_cost, seg_len, limits
        self.world_size, self.accum_steps, self.rounds = world_size, accum_steps, rounds
        self.cost_of_length: Callable[[int], int] = (
            (lambda n: n * n) if cost == "attention" else (lambda n: n)
        )

    def _admits(self, mb: _Batch, seg: int, *, planned: bool = False) -> bool:
        n = int(self.seg_len[seg])
        return self.limits.admits(len(mb.segs) + 1, mb.tokens + n, max(mb.longest, n), planned=planned)

    def _headroom(self, mb: _Batch) -> float:
        return self.limits.headroom(len(mb.segs), mb.tokens, mb.longest, self.cost_of_length)

    def _add(self, mb: _Batch, seg: int) -> None:
        mb.add(seg, int(self.seg_cost[seg]), int(self.seg_len[seg]))

    def _new_load(self) -> Load:
        return [_Batch() for _ in range(self.accum_steps)]

    @staticmethod
    def imbalance(loads: list[Load]) -> float:
        costs = [sum(mb.cost for mb in load) for load in loads]
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def reform(
        self, segs: np.ndarray, num_steps: int, max_steps: int | None = None
    ) -> list[list[Load]] | None:
        """``num_steps`` to ``max_steps`` (default ``num_steps``) steps holding every segment of ``segs``
        once, every micro-batch non-empty; None when they cannot hold them within the limits.

        Steps are formed until the pool runs low; the rest is dealt over the fewest steps that hold it.
        Fewer steps than ``num_steps`` are made up by cutting the finest steps in two (every rank's
        micro-batches halved), so the plan's length stays what a Trainer sized its run on.
        """
        group = self.world_size * self.accum_steps
        if num_steps < 1 or segs.shape[0] < num_steps * group:
            return None
        pool = _Pool(segs, self.seg_cost, self.seg_len)
        steps: list[list[Load]] = []
        while len(pool):
            step = self._form_step(pool)
            self._refine(step, pool)
            steps.append(step)
            if len(pool) < sum(len(mb.segs) for load in step for mb in load):
                break  # not enough left for another step like it
        # The rest: dealt alone, or with the last step or the last few formed (more segments to even
        # the last steps out with), over the fewest steps: whichever is the most even.
        best: tuple[float, int, list[list[Load]]] | None = None
        for back in sorted({0, 1, min(TAIL_STEPS + 1, len(steps))}):
            again = [
                seg for st in steps[len(steps) - back :] for load in st for mb in load for seg in mb.segs
            ]
            rest = np.asarray(pool.segs + again, dtype=np.int64)
            if rest.shape[0] == 0:
                tail: list[list[Load]] | None = []
            elif rest.shape[0] < group:
                continue
            else:
                tail = self._split(_Pool(rest, self.seg_cost))
            if tail is not None:
                score = max((self.imbalance(st) for st in steps[: len(steps) - back] + tail), default=1.0)
                if best is None or score < best[0]:
                    best = (score, back, tail)
        if best is None:
            return None
        steps = steps[: len(steps) - best[1]] + best[2]
        while len(steps) < num_steps:
            if not self._halve_finest(steps):
                return None
        return steps if len(steps) <= (max_steps or num_steps) else None

    def _halve_finest(self, steps: list[list[Load]]) -> bool:
        """Deal one step again as two (:meth:`_split`): of the few finest steps (costliest segment
        small against the mean rank cost), the one whose halves are the most even."""
        group = self.world_size * self.accum_steps

        def grain(st: list[Load]) -> float:
            costs = [mb.cost for load in st for mb in load]
            big = max(int(self.seg_cost[mb.segs].max()) for load in st for mb in load)
            return big / max(sum(costs) / self.world_size, 1)

        sized = [
            s for s, st in enumerate(steps) if sum(len(mb.segs) for load in st for mb in load) >= 2 * group
        ]
        best: tuple[float, int, list[list[Load]]] | None = None
        for s in sorted(sized, key=lambda s: grain(steps[s]))[:HALVE_CANDIDATES]:
            segs = np.asarray([seg for load in steps[s] for mb in load for seg in mb.segs], dtype=np.int64)
            halves = self._split(_Pool(segs, self.seg_cost), num_steps=2)
            if halves is not None:
                score = max(map(self.imbalance, halves))
                if best is None or score < best[0]:
                    best = (score, s, halves)
                if score <= BALANCE_TOLERANCE:
                    break
        if best is None:
            return False
        steps[best[1] : best[1] + 1] = best[2]
        return True

    def _form_step(self, pool: _Pool) -> list[Load]:
        loads = [self._new_load() for _ in range(self.world_size)]
        anchor = loads[0]
        for mb in anchor:
            self._add(mb, pool.pop(len(pool) - 1))
        while len(pool):  # natural fill: the costliest segments, batched as the strategy would
            seg = pool.segs[-1]
            fitting = [mb for mb in anchor if self._admits(mb, seg, planned=True)]
            if not fitting:
                break
            self._add(min(fitting, key=lambda mb: mb.cost), pool.pop(len(pool) - 1))
        target = sum(mb.cost for mb in anchor)
        for r in range(1, self.world_size):
            loads[r] = self._fill(pool, target)
        return loads

    def _fill(self, pool: _Pool, target: int) -> Load:
        """A load filled towards ``target``: within the planned batch size first, then with the slack
        (fixed-size batches); when greedy best fit falls short, again with the first pick lowered,
        keeping the best attempt."""
        floor = target / FILL_TOLERANCE
        best: tuple[int, int, bool] = (-1, 0, True)  # (cost, -skip, planned)
        for planned in (True, False) if self.limits.batch_size is not None else (False,):
            for skip in range(FILL_RETRIES):
                load = self._fill_once(pool, target, floor, skip, planned)
                have = sum(mb.cost for mb in load)
                if have >= floor:
                    return load
                best = max(best, (have, -skip, planned))
                for mb in load:
                    for seg in mb.segs:
                        pool.push(seg, int(self.seg_cost[seg]))
        return self._fill_once(pool, target, floor, -best[1], best[2])

    def _fill_once(self, pool: _Pool, target: int, floor: float, skip: int, planned: bool = False) -> Load:
        """Greedy best fit: the costliest segment under ``target`` that fits and keeps ``floor`` in
        reach, else one that keeps ``target / REFORM_TOLERANCE`` in reach, else the costliest that fits;
        the first ``skip`` fitting picks are passed over."""
        load = self._new_load()
        have = 0
        loose = target / REFORM_TOLERANCE
        while len(pool) and have < floor:
            empty = [mb for mb in load if not mb.segs]
            bound = target - have - max(0, len(empty) - 1) * pool.costs[0]
            order = empty[:1] or sorted(load, key=lambda mb: mb.cost)
            # What the other micro-batches of the load could still reach, for each micro-batch: the
            # load only changes between picks, so once per pick, not once per probe (same sums).
            room = [m.cost + self._headroom(m) for m in load]
            other_of = {id(mb): sum(r for m, r in zip(load, room, strict=True) if m is not mb) for mb in load}
            picks: list[tuple[int, _Batch] | None] = [None, None, None]  # tight, loose, fallback
            for j in _probes(pool, bound):
                seg, c = pool.segs[j], pool.costs[j]
                mb = next((m for m in order if self._admits(m, seg, planned=planned)), None)
                if mb is None:
                    continue
                if skip:
                    skip -= 1
                    continue
                n = int(self.seg_len[seg])
                after = self.limits.headroom(
                    len(mb.segs) + 1, mb.tokens + n, max(mb.longest, n), self.cost_of_length
                )
                reach = other_of[id(mb)] + mb.cost + c + after
                for level, bar in enumerate((floor, loose)):
                    if picks[level] is None and reach >= bar:
                        picks[level] = (j, mb)
                picks[2] = picks[2] or (j, mb)
                if picks[0] is not None:
                    break
            pick = next((p for p in picks if p is not None), None)
            if pick is None:
                break
            j, mb = pick
            have += pool.costs[j]
            self._add(mb, pool.pop(j))
        for mb in load:
            if not mb.segs and len(pool):
                self._add(mb, pool.pop(0))
        return load

    def _refine(self, loads: list[Load], pool: _Pool) -> None:
        """Swap single segments between the lightest or heaviest rank and the pool while that evens
        the step out, then move or swap segments between ranks (:func:`balance_step`)."""
        for _ in range(self.rounds):
            now = self.imbalance(loads)
            if now <= BALANCE_TOLERANCE or not len(pool):
                break
            costs = [sum(mb.cost for mb in load) for load in loads]
            lo, hi = int(np.argmin(costs)), int(np.argmax(costs))
            best: tuple[float, int, int, int, int] | None = None  # (imbalance, rank, mb, i, pool index)
            for r, want in ((lo, costs[hi] - costs[lo]), (hi, -(costs[hi] - costs[lo]) / 2)):
                for a, mb in enumerate(loads[r]):
                    for i, seg in enumerate(mb.segs):
                        y = int(self.seg_cost[seg])
                        near = pool.at_most(y + want)
                        for j in (near, near + 1):
                            if not 0 <= j < len(pool) or pool.costs[j] == y:
                                continue
                            trial = [*costs]
                            trial[r] += pool.costs[j] - y
                            imb = max(trial) / (sum(trial) / len(trial))
                            if imb < now and (best is None or imb < best[0]):
                                new = [*mb.segs]
                                new[i] = pool.segs[j]
                                if self.limits.fits(self.seg_len[new]):
                                    best = (imb, r, a, i, j)
            if best is None:
                break
            _, r, a, i, j = best
            segs = [*loads[r][a].segs]
            old, segs[i] = segs[i], pool.pop(j)
            pool.push(old, int(self.seg_cost[old]))
            loads[r][a] = _Batch(segs, self.seg_cost, self.seg_len)
        self._balance_in_step(loads)

    def _balance_in_step(self, loads: list[Load], rounds: int | None = None) -> None:
        """:func:`balance_step` over ``loads`` (one step's ranks, or every load of the last steps)."""
        if self.imbalance(loads) <= BALANCE_TOLERANCE:
            return
        step = np.arange(len(loads) * self.accum_steps).reshape(len(loads), self.accum_steps)
        members = {int(u): list(loads[r][a].segs) for (r, a), u in np.ndenumerate(step)}
        if balance_step(step, members, self.seg_cost, self.seg_len, self.limits, rounds or self.rounds):
            for r in range(len(loads)):
                loads[r] = [_Batch(members[int(u)], self.seg_cost, self.seg_len) for u in step[r]]

    def _split(self, pool: _Pool, num_steps: int | None = None) -> list[list[Load]] | None:
        """Deal every segment left over ``num_steps`` steps, None: the fewest that hold them within the
        limits.

        Three deals are tried and the most even kept. Chunks: runs of segments consecutive in cost order
        and of equal cost, one per micro-batch (the least padding, for token budgets). Plain: costliest first to the lightest rank, all
        these ranks evened out together, ranks of similar cost sharing a step. By count: every rank of a
        step gets the same number of segments, consecutive in cost order (so one segment more or less
        never decides a step), except one step that takes the ``num_segments mod world_size`` left
        over: its extra segments go to ranks made of the cheapest segments and its other ranks are
        matched to them from the costliest.
        """
        segs = pool.segs[::-1]
        counts = range(1, len(segs) // (self.world_size * self.accum_steps) + 1)
        for count in [num_steps] if num_steps else counts:
            best: list[list[Load]] | None = None
            for deal in (self._deal_plain, self._deal_by_count, self._deal_chunks):
                steps = deal(segs, count)
                if steps is None:
                    continue
                for step in steps:
                    self._balance_in_step(step)
                if best is None or max(map(self.imbalance, steps)) < max(map(self.imbalance, best)):
                    best = steps
            if best is not None:
                return best
        return None

    def _place(self, load: Load, seg: int) -> bool:
        """Put ``seg`` into an empty micro-batch of ``load``, else the cheapest that admits it."""
        empty = [mb for mb in load if not mb.segs]
        mb = next((m for m in empty[:1] or sorted(load, key=lambda m: m.cost) if self._admits(m, seg)), None)
        if mb is None:
            return False
        self._add(mb, seg)
        return True

    def _first_placed(self, heap: list[tuple[int, int]], loads: list[Load], seg: int) -> int | None:
        """Place ``seg`` in the first load in (cost, index) order that takes it (:meth:`_place`) and pop
        that load off ``heap``; the loads tried before it go back. O(log loads) where the cheapest load
        takes it: sorting all loads for every segment grew with the world size."""
        held = []
        chosen = None
        while heap:
            entry = heapq.heappop(heap)
            if self._place(loads[entry[1]], seg):
                chosen = entry[1]
                break
            held.append(entry)
        for entry in held:
            heapq.heappush(heap, entry)
        return chosen

    def _deal_chunks(self, segs: list[int], num_steps: int) -> list[list[Load]] | None:
        """Consecutive runs (in cost order) of equal cost, one per micro-batch: the least padding."""
        num_mb = num_steps * self.world_size * self.accum_steps
        cum = np.cumsum(self.seg_cost[segs])  # (n,) costliest first
        if len(segs) < num_mb:
            return None
        # Cut where the running cost is nearest each multiple of the mean; every run at least one segment.
        targets = cum[-1] * np.arange(1, num_mb) / num_mb
        after = np.searchsorted(cum, targets)  # first segment reaching each target
        nearer = np.abs(cum[np.maximum(after - 1, 0)] - targets) < np.abs(cum[after] - targets)
        bounds = [0]
        for i, b in enumerate(np.where(nearer, after, after + 1).tolist()):
            bounds.append(min(max(b, bounds[-1] + 1), len(segs) - (num_mb - 1 - i)))
        bounds.append(len(segs))
        mbs = [
            _Batch(segs[a:b], self.seg_cost, self.seg_len)
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        if not all(self.limits.admits(len(m.segs), m.tokens, m.longest) for m in mbs):
            return None
        loads = [
            mbs[k * self.accum_steps : (k + 1) * self.accum_steps] for k in range(num_mb // self.accum_steps)
        ]
        return [loads[s * self.world_size : (s + 1) * self.world_size] for s in range(num_steps)]

    def _deal_plain(self, segs: list[int], num_steps: int) -> list[list[Load]] | None:
        loads = [self._new_load() for _ in range(num_steps * self.world_size)]
        heap = [(0, k) for k in range(len(loads))]  # (cost, load): a heap already
        for seg in segs:
            k = self._first_placed(heap, loads, seg)
            if k is None:
                return None
            heapq.heappush(heap, (heap_cost(loads[k]), k))
        if any(not mb.segs for load in loads for mb in load):
            return None
        self._balance_in_step(loads, rounds=self.rounds * num_steps)  # all these ranks alike
        loads.sort(key=lambda load: sum(mb.cost for mb in load), reverse=True)
        return [loads[s * self.world_size : (s + 1) * self.world_size] for s in range(num_steps)]

    def _deal_lpt(self, segs: list[int], counts: list[int]) -> list[Load] | None:
        """Deal ``segs`` (costliest first) to loads of exactly ``counts`` segments, lightest first."""
        loads = [self._new_load() for _ in counts]
        left = list(counts)
        heap = [(0, k) for k in range(len(loads)) if left[k]]  # (cost, load): a heap already
        for seg in segs:
            k = self._first_placed(heap, loads, seg)
            if k is None:
                return None
            left[k] -= 1
            if left[k]:
                heapq.heappush(heap, (heap_cost(loads[k]), k))
        return None if any(not mb.segs for load in loads for mb in load) else loads

    def _deal_by_count(self, segs: list[int], num_steps: int) -> list[list[Load]] | None:
        w = self.world_size
        q, extra = divmod(len(segs), num_steps * w)
        extra %= w
        steps: list[list[Load]] = []
        if extra:
            # The odd step: `extra` ranks of q + 1 of the cheapest segments, the others matched to them.
            cheap = self._deal_lpt(segs[len(segs) - extra * (q + 1) :], [q + 1] * extra)
            if cheap is None:
                return None
            rest = _Pool(np.asarray(segs[: len(segs) - extra * (q + 1)], dtype=np.int64), self.seg_cost)
            target = max(sum(mb.cost for mb in load) for load in cheap)
            odd = list(cheap)
            for _ in range(w - extra):
                load = self._new_load()
                for i in range(q):
                    want = (target - sum(mb.cost for mb in load)) / (q - i)
                    near = rest.at_most(want)
                    for j in sorted(
                        {near, near + 1} - {-1, len(rest)}, key=lambda j: abs(rest.costs[j] - want)
                    ):
                        if self._place(load, rest.segs[j]):
                            rest.pop(j)
                            break
                    else:
                        return None
                odd.append(load)
            steps.append(odd)
            segs = rest.segs[::-1]
            num_steps -= 1
        if num_steps:
            per_rank, more = divmod(len(segs) // w, num_steps)
            start = 0
            for s in range(num_steps):
                q_s = per_rank + (s < more)
                loads = self._deal_lpt(segs[start : start + q_s * w], [q_s] * w)
                if loads is None:
                    return None
                steps.append(loads)
                start += q_s * w
        return steps


def unit_max_costs(
    seg_cost: np.ndarray, order: np.ndarray, unit_start: np.ndarray, unit_end: np.ndarray
) -> np.ndarray:
    """(num_units,) the cost of the costliest segment of each unit ``order[unit_start:unit_end]`` (0 when
    empty), compiled: one pass over the units' segments, no temporaries the size of ``order``."""
    return _unit_max(seg_cost, order, unit_start, unit_end)


@njit(cache=True, nogil=True)
def _unit_max(seg_cost, order, unit_start, unit_end):  # pragma: no cover - compiled
    out = np.zeros(unit_start.shape[0], dtype=np.int64)
    for u in range(unit_start.shape[0]):
        best = 0
        for i in range(unit_start[u], unit_end[u]):
            c = seg_cost[order[i]]
            if c > best:
                best = c
        out[u] = best
    return out


def _steps_finest(assignment: np.ndarray, unit_max: np.ndarray) -> np.ndarray:
    """(num_steps,) the cost of the costliest segment of each step (0 for a step of empty slots)."""
    if assignment.size == 0:
        return np.zeros(assignment.shape[0], dtype=np.int64)
    per_slot = np.where(assignment >= 0, unit_max[np.maximum(assignment, 0)], 0)
    return np.maximum(per_slot.reshape(assignment.shape[0], -1).max(axis=1), 0)


def reform_uneven(
    assignment: np.ndarray,
    unit_segs: Callable[[int], np.ndarray],
    uneven: np.ndarray,
    reformer: Reformer,
    imbalance: np.ndarray,
    max_extra_steps: int | None = 0,
    unit_max: np.ndarray | None = None,
) -> tuple[np.ndarray, list[list[Load]]] | None:
    """Dissolve the uneven steps with their neighbours in cost order (1, 2, 4, ... on each side) and the
    finest steps, and form as many new steps from their segments. Only when no such result is within
    :data:`REFORM_TOLERANCE` are up to ``max_extra_steps`` more steps allowed (None: as many as it takes) (a long example alone in a
    token budget leaves its step light, so the others may not hold the rest); pool sizes that cannot
    hold their segments in as many steps at all, :data:`GIVE_UP_INFEASIBLE` in a row, end the search
    at the same step count early. The first result within
    tolerance wins, else the most even one that beats the old steps. ``unit_max``: (num_units,) the
    costliest segment of each unit (:func:`unit_max_costs`), computed from ``unit_segs`` when None.
    Returns (dissolved steps, new steps) or None."""
    num_steps = assignment.shape[0]
    pos = np.searchsorted(uneven, np.arange(num_steps))
    left = np.abs(np.arange(num_steps) - uneven[np.clip(pos - 1, 0, uneven.shape[0] - 1)])
    right = np.abs(np.arange(num_steps) - uneven[np.clip(pos, 0, uneven.shape[0] - 1)])
    distance = np.minimum(left, right)  # (num_steps,) steps to the nearest uneven one
    if unit_max is None:  # (num_units,) costliest segment of each unit
        num_units = int(assignment.max(initial=-1)) + 1
        unit_max = np.array(
            [int(reformer.seg_cost[unit_segs(u)].max(initial=0)) for u in range(num_units)], dtype=np.int64
        )
    finest = np.argsort(_steps_finest(assignment, unit_max), kind="stable")
    # Python work per segment grows with the ranks of a step: the budget shrinks as they grow.
    budget = MAX_REFORM_SEGMENTS * REFORM_BUDGET_RANKS // max(reformer.world_size, REFORM_BUDGET_RANKS)
    best: tuple[np.ndarray, list[list[Load]]] | None = None
    best_score = float(imbalance[uneven].max())
    extras = sorted({0, num_steps if max_extra_steps is None else max_extra_steps})
    for extra in extras:
        reach, spent, worse, infeasible = 1, 0, 0, 0
        while worse < GIVE_UP_LEVELS or spent < GIVE_UP_SEGMENTS:
            if infeasible >= GIVE_UP_INFEASIBLE and extra != extras[-1]:
                break  # the same step count cannot hold these segments: allow extra steps
            # The steps near the uneven ones hold segments like theirs; the finest steps hold what
            # evens the last new steps out.
            chosen = np.union1d(np.flatnonzero(distance <= reach), finest[:reach])
            units = assignment[chosen].reshape(-1)
            segs = np.concatenate([unit_segs(int(u)) for u in units if u >= 0])
            spent += segs.shape[0]
            if spent > budget:
                break
            steps = reformer.reform(segs, chosen.shape[0], chosen.shape[0] + extra)
            worse += 1  # larger pools hold more of the long tail: stop when they stop helping
            infeasible = infeasible + 1 if steps is None else 0
            if steps is not None:
                score = max(reformer.imbalance(step) for step in steps)
                if score < best_score:
                    best, best_score, worse = (chosen, steps), score, 0
                if score <= REFORM_TOLERANCE:
                    return best
            if chosen.shape[0] == num_steps:
                break
            reach *= 2
    return best
