"""Evening out one optimizer step across ranks, within a strategy's limits (used by :func:`~smart_batching.distributed.distribute`).

- :func:`repartition_step` deals a step's segments again, costliest first to the least-loaded rank;
  :func:`balance_step` moves or swaps single segments between its heaviest and lightest rank.
- :class:`~smart_batching.planners.UnitLimits`: what a micro-batch may hold after balancing, as the
  strategy's spec says (``spec.unit_limits()``).
- Steps these leave uneven are formed again by :mod:`._reform`.

Every segment stays in exactly one micro-batch and no micro-batch is left empty. Pure NumPy and
Python over one step's segments; the loops run only for the uneven steps.
"""

from __future__ import annotations

import numpy as np

from smart_batching.distributed._tuning import BALANCE_TOLERANCE  # noqa: F401 (re-exported)
from smart_batching.planners import UnitLimits


def halve_units(units: list[list[int]], seg_cost: np.ndarray, group: int) -> list[list[int]] | None:
    """Split the costliest units with two or more segments in two until the count is a multiple of
    ``group``; empty units pad the rest when nothing is left to split (fewer segments than slots)."""
    units = [u for u in units if u]
    while len(units) % group:
        splittable = [i for i, u in enumerate(units) if len(u) > 1]
        if not splittable:
            units += [[] for _ in range((-len(units)) % group)]
            break
        i = max(splittable, key=lambda k: int(seg_cost[units[k]].sum()))
        unit = units.pop(i)
        cum = np.cumsum(seg_cost[unit])
        cut = int(np.argmin(np.abs(cum[:-1] - cum[-1] / 2))) + 1
        units += [unit[:cut], unit[cut:]]
    return units


def lpt_pieces(
    segs: np.ndarray, seg_cost: np.ndarray, seg_len: np.ndarray, num_pieces: int, limits: UnitLimits
) -> list[list[int]] | None:
    """Deal segments, costliest first, each to the cheapest piece that can take it; None if one fits nowhere."""
    pieces: list[list[int]] = [[] for _ in range(num_pieces)]
    load = np.zeros(num_pieces, dtype=np.int64)
    for seg in segs[np.argsort(-seg_cost[segs], kind="stable")].tolist():
        for p in np.argsort(load, kind="stable").tolist():
            if limits.fits(seg_len[pieces[p] + [seg]]):
                pieces[p].append(seg)
                load[p] += int(seg_cost[seg])
                break
        else:
            return None
    return pieces


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
    for _ in range(rounds):
        rc = [sum(int(seg_cost[members[u]].sum()) for u in units) for units in units_of]
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
                changed = True
                break
        else:
            break
    return changed
