"""The costliest batch first (issue 17): step 0 holds the batch that fills memory most, so a budget that
does not fit fails at the first step. ``group_by_length`` always (HF's rule: the longest example first),
``token_budget`` and ``packed`` with ``costliest_first`` (the default). Single process, streaming and
distributed plans; footprints are measured here batch by batch, independently of the library's helpers.
"""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest
from strategy_cases import cases
from test_planners import check_plan

import smart_batching as sb
from smart_batching.distributed import distribute
from smart_batching.errors import ConfigError
from smart_batching.planners import REGISTRY, GroupByLengthSpec, make_spec
from smart_batching.planners._common import lay_out
from smart_batching.streaming import StreamingBatcher


def leads(spec) -> bool:
    return spec.leads_with_costliest()


def has_option(spec) -> bool:
    return "costliest_first" in type(spec).__dataclass_fields__


# Every registered strategy whose plans lead with the costliest batch, with the option sets its spec
# gives (lengths of at most 250 tokens); OPTIONAL: those where it is the costliest_first option.
CONFIGS = {p.id: p.values[1] for p in cases(250, leads)}
STRATEGY_OF = {p.id: p.values[0] for p in cases(250, leads)}
OPTIONAL = [p for p in cases(250, lambda s: leads(s) and has_option(s), first_only=True)]


def strategy_of(key: str) -> str:
    return STRATEGY_OF[key]


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    rng = np.random.default_rng(11)
    return np.clip(rng.lognormal(4.0, 0.8, 997), 1, 250).astype(np.int64)


def measure(
    batches: list[np.ndarray], widths: list[int] | None, packs_rows: bool, rows: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(footprint, longest) of each batch, given its segment lengths: token slots (rows × width) for
    padded rows, real tokens for packed ones."""
    foot, longest = [], []
    for b, lens in enumerate(batches):
        n_rows = len(lens) if rows is None else rows[b]
        width = int(lens.max(initial=0)) if widths is None else widths[b]
        foot.append(int(lens.sum()) if packs_rows else n_rows * width)
        longest.append(int(lens.max(initial=0)))
    return np.array(foot), np.array(longest)


def plan_measure(plan: sb.BatchPlan):
    batches = [plan.seg_lengths[slice(*plan.segment_range(b))] for b in range(len(plan))]
    return measure(batches, plan.batch_width.tolist(), plan.spec.packs_rows, plan.rows_per_batch.tolist())


def assert_costliest_first(foot: np.ndarray, longest: np.ndarray, strategy: str) -> None:
    if strategy == "group_by_length":  # HF's rule: the longest example, ties to the largest footprint
        assert longest[0] == longest.max()
        assert foot[0] == foot[longest == longest.max()].max()
    else:  # the largest footprint, ties to the longest example
        assert foot[0] == foot.max()
        assert longest[0] == longest[foot == foot.max()].max()


def raw_plan(lengths: np.ndarray, key: str, seed: int, epoch: int) -> list[list[int]]:
    """The planner's own batches, before the costliest one is swapped to the front."""
    name = strategy_of(key)
    spec = make_spec(name, **CONFIGS[key])
    rng = np.random.default_rng(np.random.SeedSequence([seed, epoch]))
    parts = REGISTRY[name][1](lengths, spec, rng)
    segments, batches = lay_out(parts.segments, parts.batches)  # the planner's shuffle, nothing moved
    ids, bounds = segments.example, batches.bounds
    return [ids[bounds[b] : bounds[b + 1]].tolist() for b in range(len(bounds) - 1)]


# --- One process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(CONFIGS))
def test_batch_zero_is_the_costliest(key: str, lengths: np.ndarray) -> None:
    for seed, epoch in ((0, 0), (0, 1), (3, 0), (5, 2)):
        plan = sb.plan_batches(lengths, strategy_of(key), seed=seed, epoch=epoch, **CONFIGS[key])
        check_plan(plan, lengths, CONFIGS[key])  # every example exactly once, limits respected
        assert_costliest_first(*plan_measure(plan), strategy_of(key))


@pytest.mark.parametrize("key", list(CONFIGS))
def test_one_swap_with_batch_zero(key: str, lengths: np.ndarray) -> None:
    """The plan is the planner's own with the costliest batch and batch 0 swapped: every other batch
    keeps its place (the cost in randomness is one batch position per epoch)."""
    swaps = 0
    for seed in range(6):
        got = sb.plan_batches(lengths, strategy_of(key), seed=seed, **CONFIGS[key]).to_lists()
        raw = raw_plan(lengths, key, seed, 0)
        k = raw.index(got[0])
        expected = list(raw)
        expected[0], expected[k] = raw[k], raw[0]
        assert got == expected
        swaps += k > 0
    if CONFIGS[key].get("mode") != "megabatch":  # megabatch mode has the longest example first already
        assert swaps > 0, "no seed moved a batch: the test would pass without the rule"


@pytest.mark.parametrize("name, options", OPTIONAL)
def test_costliest_first_off_is_the_planner_order(name: str, options: dict, lengths: np.ndarray) -> None:
    for seed in range(3):
        off = sb.plan_batches(lengths, name, seed=seed, costliest_first=False, **options)
        assert off.to_lists() == raw_plan(lengths, name, seed, 0)
        on = sb.plan_batches(lengths, name, seed=seed, **options)
        assert on.fingerprint != off.fingerprint  # the option is part of what produced the plan
        assert sorted(map(sorted, on.to_lists())) == sorted(map(sorted, off.to_lists()))


@pytest.mark.parametrize("name", [p.values[0] for p in OPTIONAL])
def test_costliest_first_must_be_a_bool(name: str) -> None:
    with pytest.raises(ConfigError, match="costliest_first="):
        make_spec(name, costliest_first="no")


def test_unshuffled_packing_keeps_its_order() -> None:
    # shuffle=False keeps the packing order (longest first), costliest_first or not.
    lengths = [5, 3, 9, 1, 7, 2, 8, 4, 6, 10]
    a = sb.plan_batches(lengths, "packed", capacity=12, shuffle=False, algorithm="bfd")
    b = sb.plan_batches(lengths, "packed", capacity=12, shuffle=False, algorithm="bfd", costliest_first=False)
    assert a.to_lists() == b.to_lists() == [[9, 5], [2, 1], [6, 7], [4, 0], [8, 3]]


# Golden tables: literal lengths in, literal first batch out, whatever the seed.
GOLDEN_LENGTHS = [5, 3, 9, 1, 7, 2, 8, 4, 6, 10]


def test_golden_token_budget_first_batch() -> None:
    # Ascending 1 2 3 4 | 5 6 | 7 8 | 9 10 under 20 padded tokens: slots 16, 12, 16, 20.
    firsts = {
        tuple(sorted(sb.plan_batches(GOLDEN_LENGTHS, "token_budget", max_tokens=20, seed=s)[0]))
        for s in range(8)
    }
    assert firsts == {(2, 9)}
    off = {
        tuple(
            sorted(
                sb.plan_batches(GOLDEN_LENGTHS, "token_budget", max_tokens=20, seed=s, costliest_first=False)[
                    0
                ]
            )
        )
        for s in range(8)
    }
    assert len(off) > 1  # without the rule the first batch is any of them


def test_golden_token_budget_ties_go_to_the_longest() -> None:
    # 4 x 5 = 20 slots and 2 x 10 = 20 slots: the same footprint, the batch with the 10s goes first.
    lengths = [5, 5, 5, 5, 10, 10]
    for s in range(8):
        assert sorted(sb.plan_batches(lengths, "token_budget", max_tokens=20, seed=s)[0]) == [4, 5]


def test_golden_packed_first_row() -> None:
    # Rows 10+2, 9+3, 8+4, 7+5 hold 12 tokens each, 6+1 seven: ties at 12 go to the row with the 10.
    for s in range(8):
        assert sorted(sb.plan_batches(GOLDEN_LENGTHS, "packed", capacity=12, algorithm="bfd", seed=s)[0]) == [
            5,
            9,
        ]


def test_golden_group_by_length_sorted_longest_first() -> None:
    # Sorted batches of 3: {1,2,3} {4,5,6} {7,8,9} {10}: HF's rule puts the one with the 10 first,
    # although {7,8,9} has more token slots (27 against 10).
    lengths = list(range(1, 11))
    for s in range(8):
        plan = sb.plan_batches(lengths, "group_by_length", batch_size=3, mode="sorted", seed=s)
        assert plan[0].tolist() == [9]
    # Ties on the longest go to the full batch: {1,2,10} is not possible, so use equal lengths.
    lengths = [10] * 7
    for s in range(8):
        plan = sb.plan_batches(lengths, "group_by_length", batch_size=3, mode="sorted", seed=s)
        assert len(plan[0]) == 3


# --- Streaming: the first round --------------------------------------------------------------------


def stream_measure(batches: list[list[int]], lengths: np.ndarray, name: str, options: dict):
    packs_rows = make_spec(name, **options).packs_rows
    return measure([lengths[np.asarray(b, dtype=np.int64)] for b in batches], None, packs_rows)


# A stream plans a buffer at a time (no window=) and emits its last batch (no drop_last).
STREAMED = [
    k for k, options in CONFIGS.items() if not options.get("drop_last") and options.get("window") is None
]


@pytest.mark.parametrize("key", STREAMED)
def test_stream_first_round_costliest_first(key: str, lengths: np.ndarray) -> None:
    name, options = strategy_of(key), CONFIGS[key]
    for seed in range(3):
        # A buffer larger than the stream: one round, whose costliest batch is the stream's.
        batches = list(StreamingBatcher(lengths.tolist(), name, buffer_size=2000, seed=seed, **options))
        assert sorted(i for b in batches for i in b) == list(range(lengths.shape[0]))
        assert_costliest_first(*stream_measure(batches, lengths, name, options), name)


@pytest.mark.parametrize("name, options", OPTIONAL)
def test_stream_first_round_only(name: str, options: dict, lengths: np.ndarray) -> None:
    """With a small buffer, one swap inside the first round; later rounds are as without the rule."""
    swaps = 0
    for seed in range(4):
        on = list(StreamingBatcher(lengths.tolist(), name, buffer_size=200, seed=seed, **options))
        off = list(
            StreamingBatcher(
                lengths.tolist(), name, buffer_size=200, seed=seed, costliest_first=False, **options
            )
        )
        k = off.index(on[0])
        expected = list(off)
        expected[0], expected[k] = off[k], off[0]
        assert on == expected
        foot, _ = stream_measure(off[: k + 1], lengths, name, options)
        assert foot[k] == foot.max()  # the costliest of the batches before it (the first round's)
        swaps += k > 0
    assert swaps > 0


# --- Distributed: the step holding the costliest micro-batch first ---------------------------------


@pytest.fixture(scope="module")
def heavy_tailed() -> np.ndarray:
    rng = np.random.default_rng(5)
    return np.clip(rng.lognormal(5.0, 0.7, 3001), 8, 2000).astype(np.int64)


class _NoLeadGroupByLength(GroupByLengthSpec):
    """``group_by_length`` without the rule: the same plans and limits, to compare balance with."""

    def leads_with_costliest(self) -> bool:
        return False


def without_rule(plan: sb.BatchPlan) -> sb.BatchPlan:
    """The same base plan, with a spec that does not ask for the costliest step first."""
    if isinstance(plan.spec, GroupByLengthSpec):
        spec = _NoLeadGroupByLength(**{f.name: getattr(plan.spec, f.name) for f in fields(plan.spec)})
    else:
        spec = replace(plan.spec, costliest_first=False)
    return replace(plan, spec=spec)


# Lengths of at most 2,000 tokens (the heavy-tailed fixture).
DIST_STRATEGIES = cases(2000, leads)


def step_signature(d, step: int) -> tuple:
    """A step as what each rank runs in it, micro-batch order aside."""
    return tuple(tuple(sorted(d.assignment[step, r].tolist())) for r in range(d.world_size))


@pytest.mark.parametrize("strategy, options", DIST_STRATEGIES)
@pytest.mark.parametrize("world_size, accum", [(2, 1), (2, 3), (4, 1), (4, 2), (1, 4)])
def test_distributed_step_zero_holds_the_costliest(
    heavy_tailed, strategy, options, world_size, accum
) -> None:
    plan = sb.plan_batches(heavy_tailed, strategy, seed=1, **options)
    d = distribute(plan, world_size, accum_steps=accum, seed=1)
    before = distribute(without_rule(plan), world_size, accum_steps=accum, seed=1)
    packs_rows = plan.spec.packs_rows
    slots = d.assignment.reshape(-1)
    lens = [plan.seg_lengths[d.micro_batch_segments(m)] for m in slots.tolist() if m >= 0]
    foot, longest = measure(lens, None, packs_rows)
    full = np.full(slots.shape[0], -1)
    full[slots >= 0] = foot
    full_longest = np.full(slots.shape[0], -1)
    full_longest[slots >= 0] = longest
    foot3, longest3 = full.reshape(d.assignment.shape), full_longest.reshape(d.assignment.shape)
    # Micro-batch 0 of step 0 on some rank is the costliest of the epoch.
    firsts = [(foot3[0, r, 0], longest3[0, r, 0]) for r in range(world_size)]
    if strategy == "group_by_length":
        top = max((lo, f) for f, lo in zip(full, full_longest, strict=True))
        assert max((lo, f) for f, lo in firsts) == top
    else:
        top = max(zip(full, full_longest, strict=True))
        assert max(firsts) == top
    # A permutation of whole steps: the same units, the same steps, balance exactly as before.
    for name in ("segment_order", "micro_batch_start", "micro_batch_end", "micro_batch_cost"):
        np.testing.assert_array_equal(getattr(d, name), getattr(before, name))
    assert sorted(step_signature(d, s) for s in range(d.num_steps)) == sorted(
        step_signature(before, s) for s in range(before.num_steps)
    )
    moved = [s for s in range(d.num_steps) if step_signature(d, s) != step_signature(before, s)]
    assert len(moved) in (0, 2) and (not moved or moved[0] == 0)
    assert sorted(map(tuple, d.rank_cost.tolist())) == sorted(map(tuple, before.rank_cost.tolist()))
    assert sorted(d.rank_cost.sum(axis=1).tolist()) == sorted(before.rank_cost.sum(axis=1).tolist())
    assert d.max_step_imbalance == before.max_step_imbalance
    # Deterministic: every rank computes the same plan (and a resumed run the same one again).
    np.testing.assert_array_equal(
        d.assignment, distribute(plan, world_size, accum_steps=accum, seed=1).assignment
    )


def test_distributed_rule_moves_steps(heavy_tailed) -> None:
    """The rule is not vacuous here: over a few seeds, the shuffled order had the costliest step elsewhere."""
    moved = 0
    for seed in range(4):
        plan = sb.plan_batches(heavy_tailed, "group_by_length", seed=seed, batch_size=8)
        d = distribute(plan, 2, accum_steps=2, seed=seed)
        before = distribute(without_rule(plan), 2, accum_steps=2, seed=seed)
        moved += not np.array_equal(d.assignment, before.assignment)
        # The case: the longest example is in micro-batch 0 of the first step on some rank.
        assert (
            max(int(heavy_tailed[d.micro_batch_examples(int(m))].max()) for m in d.assignment[0, :, 0])
            == heavy_tailed.max()
        )
    assert moved >= 3


def test_distributed_sampler_yields_the_costliest_first(heavy_tailed) -> None:
    from smart_batching.distributed import World
    from smart_batching.distributed.sampler import DistributedSmartBatchSampler

    first = []
    for rank in range(2):
        sampler = DistributedSmartBatchSampler(
            heavy_tailed, "group_by_length", world=World(rank, 2), accum_steps=2, seed=4, batch_size=8
        )
        it = iter(sampler)
        batches = [next(it) for _ in range(3)]
        first.append(batches[0])
        # Resuming at the cursor gives the same batches (the plan is recomputed on load).
        state = sampler.state_dict()
        rest = list(it)
        again = DistributedSmartBatchSampler(
            heavy_tailed, "group_by_length", world=World(rank, 2), accum_steps=2, seed=4, batch_size=8
        )
        again.load_state_dict(state)
        assert list(again) == rest
    assert max(int(heavy_tailed[b].max()) for b in first) == heavy_tailed.max()


@pytest.mark.parametrize("overlap", [False, True])
def test_range_sums_and_maxima_in_any_order(overlap: bool) -> None:
    """Sums and maxima of ranges in shuffled order (a distributed plan's micro-batches), empty ranges
    and overlapping ones included, equal a plain loop over them."""
    from smart_batching.plan import range_sums_and_maxima

    rng = np.random.default_rng(4)
    values = rng.integers(1, 1000, size=500)
    cuts = np.sort(rng.choice(np.arange(1, 500), size=60, replace=False))
    starts, ends = np.concatenate([[0], cuts]), np.concatenate([cuts, [500]])
    starts = np.concatenate([starts, [17, 300]])  # two empty ranges
    ends = np.concatenate([ends, [17, 290]])
    if overlap:
        starts, ends = np.concatenate([starts, [5, 250]]), np.concatenate([ends, [400, 260]])
    perm = rng.permutation(starts.shape[0])
    starts, ends = starts[perm], ends[perm]
    sums, maxima = range_sums_and_maxima(values, starts, ends)
    for i, (a, b) in enumerate(zip(starts, ends, strict=True)):
        assert sums[i] == (values[a:b].sum() if b > a else 0)
        assert maxima[i] == (values[a:b].max() if b > a else 0)
