"""Every tuning constant of :func:`~smart_batching.distributed.distribute`, with the reason for its value.

Imbalance is ``max / mean`` of the ranks' costs in one optimizer step (1.0: perfectly even). The
values were set on GSM8K and LIMA lengths at 2 and 4 ranks (``benchmarks/distributed_balance.py``),
where they bring every step under 1 % for every strategy, and checked at 1,024 ranks on 1M examples.
"""

from __future__ import annotations

BALANCE_TOLERANCE = 1.005
"""Steps more uneven than this get their segments dealt again and moved between ranks. Half of
:data:`REFORM_TOLERANCE`: what balancing leaves between the two is cheap to accept, and below 0.5 %
the moves stop paying (an all-reduce wait that short is lost in step-time noise)."""

REFORM_TOLERANCE = 1.01
"""Steps more uneven than this are dissolved with their neighbours and formed again: 1 %, the
promise of the docs (docs/guides/distributed.md, "every step within 1-2 %")."""

FILL_TOLERANCE = 1.002
"""A rank filled towards its step's target stops this close to it: a fifth of the reform tolerance,
so that the step's last rank still has room to land within 1 %."""

PROBE_LADDER = (1.0, 0.97, 0.94, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)
"""Costs tried for the next segment of a rank being filled, as fractions of the best fit: dense near
1 (most ranks close there) and coarse below, so a rank short of its target tries a spread of smaller
segments in a dozen look-ups instead of all of them."""

PROBE_WIDTH = 4
"""Segments tried at each rung of :data:`PROBE_LADDER` (neighbours in cost order): 4 covers ties of
equal-length examples, which are common (templated data), at 48 look-ups per fill at most."""

TAIL_STEPS = 3
"""Steps already formed that are dealt again together with the last segments of a pool: the tail of a
pool is its cheapest segments, too few to even out one step alone; three steps give them enough to
mix with, and more only costs time."""

HALVE_CANDIDATES = 8
"""The finest steps tried when one step must be dealt again as two (a lone long example): finest
first, since they split most evenly; eight bounds the attempts per uneven step."""

FILL_RETRIES = 4
"""First picks tried for a rank that greedy best fit leaves short of its target: greedy fails on a
few unlucky first picks; four retries recover almost all of them on LIMA."""

MAX_REFORM_SEGMENTS = 100_000
"""The most segments dissolved in one series of attempts to even out uneven steps: bounds the Python
loop whatever the dataset size. That loop costs about 0.1 to 0.3 ms per dissolved segment at 8 to 16
ranks, so it is kept for what the compiled mixer cannot even out (a second pass of the mixer runs
first, see :func:`~smart_batching.distributed.distribute._reform_uneven`)."""

REFORM_BUDGET_RANKS = 8
"""World size up to which the Python re-forming may dissolve :data:`MAX_REFORM_SEGMENTS`; beyond it the
budget shrinks in proportion (its loops over one step's ranks grow with them: 11 s for 100K segments
at 1,024 ranks), which leaves the steps of large worlds to the compiled mixer (:mod:`._mix`)."""

GIVE_UP_LEVELS = 3
"""Pool sizes tried in a row without a more even result before giving up, once
:data:`GIVE_UP_SEGMENTS` segments have been dissolved: larger pools rarely help after three misses."""

GIVE_UP_SEGMENTS = 20_000
"""Segments dissolved before :data:`GIVE_UP_LEVELS` may end the search (small plans always try every
pool size)."""

GIVE_UP_INFEASIBLE = 2
"""Pool sizes in a row that cannot hold their segments in as many steps at all (a token budget that
the base plan fills tightly) before the search moves on to allowing extra steps: each pool size costs
about twice the one before, and a third miss cost 3 s of a 5.7 s call (30k GSM8K-like lengths, 16
ranks × 4) that one extra step then settled in 0.4 s."""

TAIL_POOL_STEPS = 8
"""Whole steps the pool of the ragged tail may grow by before the units with the most segments join
it instead: where the cheapest units are single examples near the capacity, growing it step by step
would pool most of the plan (and deal it all again); eight steps cover every tail of GSM8K and LIMA
(one step suffices there) and cost a few milliseconds at 1,024 ranks."""

MIX_TOLERANCE = 1.002
"""Each step formed with donors is refined until its heaviest rank is this close to the mean: a fifth
of :data:`REFORM_TOLERANCE`, like :data:`FILL_TOLERANCE`, so that what a deal leaves uneven is closed
well inside the promise; the moves are compiled, so aiming lower costs little."""

MIX_KEEP_TOLERANCE = 1.02
"""Where no pool of donors gets a step within :data:`REFORM_TOLERANCE`, the most even result is kept if
within this (the 1-2 % of docs/guides/distributed.md); worse ones are left for the Python re-forming, which evens out long
examples alone in a token budget better (and is hampered by a half-mixed step), and are taken only if
that fails too."""

MAX_MIX_DONORS = 64
"""Most donor steps pooled with one uneven step (1, 2, 4, ... are tried): the near-capacity and
bimodal tails even out with 1 to 16 at every world size from 8 to 1,024; more rarely helps, and
each try deals its whole pool again."""

MIX_GIVE_UP_LEVELS = 2
"""Pool sizes tried in a row without a more even result before the donor search of a step stops, once
it has a result it would keep: past the best size, larger pools mix in ever more unlike steps and
rarely help (a step still far from even keeps trying up to :data:`MAX_MIX_DONORS`)."""

MIX_SEGMENT_BUDGET = 4_000_000
"""Segments dealt again, over every try of every uneven step, before the donor search stops (the
Python re-forming then takes what is left, bounded by :data:`MAX_REFORM_SEGMENTS`): about a second of
compiled dealing, whatever the dataset and world size."""
