"""Every registered strategy through every contract: single process, stream, distributed and resume.

The cases come from the registry (``strategy_cases.cases``: each strategy with the option sets its
spec gives, ``example_options``). This file also registers a toy strategy (``toy_strategy.py``) while
its tests are collected and run: it goes through every contract below with no list edited, as a new
strategy does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from strategy_cases import cases, registered
from test_planners import check_plan
from test_sampler import check_resume_contract
from test_streaming import _check_contract, _resume_everywhere
from toy_strategy import LongestFirstSpec, plan_longest_first

import smart_batching as sb
from smart_batching.distributed import World, distribute
from smart_batching.distributed.sampler import DistributedSmartBatchSampler
from smart_batching.errors import ConfigError
from smart_batching.planners import make_spec, register, unregister
from smart_batching.sampler import SmartBatchSampler
from smart_batching.streaming import StreamingBatcher

LONGEST = 64
with registered(LongestFirstSpec, plan_longest_first):
    CASES = cases(LONGEST)


@pytest.fixture(scope="module", autouse=True)
def _toy_registered():
    register(LongestFirstSpec, plan_longest_first)
    yield
    unregister(LongestFirstSpec.name)


def _lengths(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, LONGEST + 1, size=n)


def _streamable(name: str, options: dict) -> bool:
    spec = make_spec(name, **options)
    if not spec.can_stream():
        return False
    try:
        spec.check_streamable()
    except ConfigError:
        return False
    return True


def test_the_toy_is_among_the_cases() -> None:
    ids = [p.id for p in CASES]
    assert LongestFirstSpec.name in ids and "packed" in ids
    assert len({p.values[0] for p in CASES}) >= 6  # the five built-in strategies and the toy


@pytest.mark.parametrize(("name", "options"), CASES)
def test_single_process(name: str, options: dict) -> None:
    """Every example once (or counted as dropped), limits respected, deterministic in the seed,
    different across epochs and seeds; the same with each overlong policy over the limit."""
    lengths = _lengths(301, 0)
    plan = sb.plan_batches(lengths, name, seed=7, **options)
    check_plan(plan, lengths, options)
    limits = plan.spec.micro_batch_limits()
    for b in range(len(plan)):
        assert limits.fits(plan.seg_lengths[slice(*plan.segment_range(b))], planned=True)
    again = sb.plan_batches(lengths, name, seed=7, **options)
    assert again.to_lists() == plan.to_lists() and again.fingerprint == plan.fingerprint
    assert sb.plan_batches(lengths, name, seed=7, epoch=1, **options).to_lists() != plan.to_lists()
    assert sb.plan_batches(lengths, name, seed=8, **options).to_lists() != plan.to_lists()
    limit, setting = plan.spec.token_limit()
    if limit is not None and "overlong" in type(plan.spec).__dataclass_fields__:
        longer = np.append(lengths, [limit + 1, 3 * limit])
        for policy in ("truncate", "split", "drop"):
            cut = sb.plan_batches(longer, name, seed=1, **{**options, "overlong": policy})
            check_plan(cut, longer, {**options, "overlong": policy})
            assert cut.overlong.num_over_limit == 2, setting


@pytest.mark.parametrize(("name", "options"), CASES)
def test_stream(name: str, options: dict) -> None:
    """Exactly once and within limits over a bounded buffer; settings that cannot stream are refused."""
    lengths = [int(x) for x in _lengths(150, 1)]
    if not _streamable(name, options):
        with pytest.raises(ConfigError):
            StreamingBatcher(lengths, name, buffer_size=24, **options)
        return
    b = StreamingBatcher(lengths, name, buffer_size=24, seed=2, **options)
    _check_contract(lengths, list(b), b, name, options)
    assert b.stats.num_rounds > 2


@pytest.mark.parametrize(("name", "options"), CASES)
@pytest.mark.parametrize(("world_size", "accum"), [(2, 1), (3, 2)])
def test_distributed(name: str, options: dict, world_size: int, accum: int) -> None:
    """Every example of the plan once across ranks, the same number of micro-batches on every rank,
    each within the strategy's limits after balancing."""
    lengths = _lengths(301, 2)
    plan = sb.plan_batches(lengths, name, seed=3, **options)
    d = distribute(plan, world_size, accum_steps=accum, seed=3)
    assert d.assignment.shape == (d.num_steps, world_size, accum)
    seen = [d.micro_batch_examples(int(m)) for m in d.assignment.reshape(-1) if m >= 0]
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.sort(plan.example_ids))
    limits = plan.spec.micro_batch_limits()
    for m in np.unique(d.assignment[d.assignment >= 0]):
        assert limits.fits(plan.seg_lengths[d.micro_batch_segments(int(m))])
    # The micro-batches as one batch value hold the same segments.
    mbs = d.micro_batches
    bounds = mbs.bounds
    for m in range(mbs.num_batches):
        np.testing.assert_array_equal(mbs.order[bounds[m] : bounds[m + 1]], d.micro_batch_segments(m))


@pytest.mark.parametrize(("name", "options"), CASES)
def test_resume(name: str, options: dict) -> None:
    """Stop at every step, reload the state (through JSON), compare the rest: the sampler over two
    epochs, every rank of the distributed sampler, and the stream."""
    lengths = _lengths(41, 3)
    check_resume_contract(lambda: SmartBatchSampler(lengths, name, seed=11, **options))
    for rank in range(2):

        def make(rank=rank):
            return DistributedSmartBatchSampler(
                lengths, name, world=World(rank, 2), accum_steps=2, seed=11, **options
            )

        first = list(make())
        for k in range(len(first) + 1):
            s = make()
            it = iter(s)
            for _ in range(k):
                next(it)
            resumed = make()
            resumed.load_state_dict(json.loads(json.dumps(s.state_dict())))
            assert list(resumed) == first[k:], (rank, k)
    if _streamable(name, options):
        stream = [int(x) for x in _lengths(90, 4)]
        _resume_everywhere(lambda: StreamingBatcher(stream, name, buffer_size=20, seed=5, **options))


def test_cases_follow_the_registry() -> None:
    """A strategy registered later is in a fresh parametrisation; one unregistered is not."""
    names = {p.values[0] for p in cases(LONGEST)}
    assert LongestFirstSpec.name in names  # registered by this module's fixture
    unregister(LongestFirstSpec.name)
    try:
        assert LongestFirstSpec.name not in {p.values[0] for p in cases(LONGEST)}
    finally:
        register(LongestFirstSpec, plan_longest_first)
