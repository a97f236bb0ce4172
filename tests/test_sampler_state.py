"""A garbled sampler state (a checkpoint edited by hand, written by another tool, cut short) is refused
with a ConfigError that names the field, not the ValueError, TypeError or KeyError of reading it.
Both samplers: the single-process cursor and the distributed one (hand-built worlds, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from smart_batching.distributed import World
from smart_batching.distributed.sampler import DistributedSmartBatchSampler
from smart_batching.errors import ConfigError
from smart_batching.sampler import SmartBatchSampler

LENGTHS = np.random.default_rng(0).integers(5, 120, 300)

# (field, garbled value or MISSING, what the message must name)
MISSING = object()
BASE_CASES = [
    ("seed", "abc", "seed="),
    ("seed", -1, "seed="),
    ("seed", 1.5, "seed="),
    ("epoch", -1, "epoch="),
    ("epoch", "0", "epoch="),
    ("batches_yielded", "x", "batches_yielded="),
    ("batches_yielded", None, "batches_yielded="),
    ("batches_yielded", True, "batches_yielded="),
    ("version", "1", "version="),
    ("fingerprint", 123, "fingerprint="),
    ("num_examples", "300", "num_examples="),
    ("strategy", ["packed"], "strategy="),
    ("epoch", MISSING, "'epoch'"),
    ("batches_yielded", MISSING, "'batches_yielded'"),
    ("fingerprint", MISSING, "'fingerprint'"),
    ("version", MISSING, "'version'"),
]
DISTRIBUTED_CASES = [
    ("world_size", "two", "world_size="),
    ("world_size", 0, "world_size="),
    ("accum_steps", None, "accum_steps="),
    ("cost", 3, "cost="),
    ("cost", "attention", "cost="),  # well formed, but not the cost these plans balance
    ("max_extra_steps", "x", "max_extra_steps="),
    ("replanned_examples", "many", "replanned_examples="),
]


def garble(state: dict, field: str, value: object) -> dict:
    state = dict(state)
    if value is MISSING:
        del state[field]
    else:
        state[field] = value
    return state


def single() -> SmartBatchSampler:
    return SmartBatchSampler(LENGTHS, "packed", capacity=256, seed=3)


def distributed(world_size: int = 2) -> DistributedSmartBatchSampler:
    return DistributedSmartBatchSampler(
        LENGTHS, "packed", world=World(0, world_size), accum_steps=2, capacity=256, seed=3
    )


def advanced(sampler):
    batches = iter(sampler)
    for _ in range(3):
        next(batches)
    return sampler.state_dict()


@pytest.mark.parametrize(("field", "value", "named"), BASE_CASES)
def test_single_process_state(field, value, named) -> None:
    state = garble(advanced(single()), field, value)
    fresh = single()
    with pytest.raises(ConfigError, match=named):
        fresh.load_state_dict(state)
    with pytest.raises(ConfigError, match=named):
        fresh.check_state_dict(state)  # what the Trainer integration calls on resume


@pytest.mark.parametrize(("field", "value", "named"), BASE_CASES + DISTRIBUTED_CASES)
def test_distributed_state(field, value, named) -> None:
    state = garble(advanced(distributed()), field, value)
    with pytest.raises(ConfigError, match=named):
        distributed().load_state_dict(state)
    # Also on the replanning path (another world size), which reads the cursor itself.
    with pytest.raises(ConfigError, match=named):
        distributed(4).load_state_dict(state, replan=True)


def test_not_a_mapping_and_a_cursor_past_the_end() -> None:
    with pytest.raises(ConfigError, match="not a SmartBatchSampler state"):
        single().load_state_dict([("epoch", 0)])
    state = advanced(distributed())
    state["batches_yielded"] = 10**6
    with pytest.raises(ConfigError, match="were yielded"):
        distributed(4).load_state_dict(state, replan=True)


def test_intact_states_still_resume() -> None:
    # The checks refuse only garbled fields: a state from state_dict() (ints, strings, None) loads.
    for make in (single, distributed):
        first = make()
        state = advanced(first)
        resumed = make()
        resumed.load_state_dict(state)
        assert next(iter(resumed)) == next(iter(first))
    state = advanced(distributed()) | {"max_extra_steps": 0, "seed": np.int64(3)}
    distributed().load_state_dict(state)
