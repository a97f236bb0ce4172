"""SmartBatchSampler: coverage, epochs, exact length, the resume contract, DataLoader and StatefulDataLoader."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategy_cases import cases
from torch.utils.data import DataLoader, Dataset

from smart_batching import ConfigError, make_spec, plan_batches
from smart_batching.collate import PaddingCollator
from smart_batching.sampler import Segment, SegmentDataset, SmartBatchSampler

# Every registered strategy with the first option set its spec gives for lengths below 100 tokens.
STRATEGIES = {param.values[0]: param.values[1] for param in cases(100, first_only=True)}


@pytest.fixture(scope="module")
def lengths() -> np.ndarray:
    return np.random.default_rng(7).integers(1, 100, size=61)


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def stream(sampler: SmartBatchSampler, num_batches: int) -> list[list]:
    """The next ``num_batches`` batches, crossing epochs the way a training loop does (a new iter per epoch)."""
    out: list[list] = []
    empty_passes = 0
    while len(out) < num_batches:
        before = len(out)
        for batch in sampler:
            out.append(batch)
            if len(out) == num_batches:
                break
        empty_passes = empty_passes + 1 if len(out) == before else 0
        assert empty_passes < 3, "sampler yields nothing"
    return out


def check_resume_contract(make_sampler, *, num_epochs: int = 2) -> None:
    """Stop at every step of ``num_epochs`` epochs, save, reload into a fresh sampler, compare the rest.

    The reference is one uninterrupted run; the state goes through JSON like a checkpoint would.
    """
    ref_sampler = make_sampler()
    total = sum(len(ref_sampler.plan_for_epoch(e)) for e in range(num_epochs))
    reference = stream(ref_sampler, total)
    for k in range(total + 1):
        first = make_sampler()
        head = stream(first, k) if k else []
        state = json.loads(json.dumps(first.state_dict()))
        assert set(state) >= {"version", "fingerprint", "epoch", "batches_yielded"}
        second = make_sampler()
        second.load_state_dict(state)
        tail = stream(second, total - k) if total > k else []
        assert head + tail == reference, f"resume after {k} batches diverged"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_every_index_exactly_once_per_epoch(lengths, strategy):
    sampler = SmartBatchSampler(lengths, strategy, seed=3, **STRATEGIES[strategy])
    epochs = []
    for epoch in range(3):
        assert sampler.epoch == epoch  # advanced by itself after each full pass
        batches = list(sampler)
        assert len(batches) == len(sampler.plan_for_epoch(epoch))
        assert sorted(flat(batches)) == list(range(len(lengths)))
        assert (
            batches == plan_batches(lengths, strategy, seed=3, epoch=epoch, **STRATEGIES[strategy]).to_lists()
        )
        epochs.append(batches)
    assert epochs[0] != epochs[1] != epochs[2]  # every strategy draws each epoch afresh


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_len_is_exact_for_the_current_epoch(lengths, strategy):
    sampler = SmartBatchSampler(lengths, strategy, seed=1, **STRATEGIES[strategy])
    for _ in range(3):
        n = len(sampler)
        assert n == len(list(sampler))


def test_set_epoch_jumps_and_keeps_a_cursor_of_the_same_epoch(lengths):
    make = lambda: SmartBatchSampler(lengths, "token_budget", seed=5, max_tokens=160)  # noqa: E731
    sampler = make()
    sampler.set_epoch(4)
    assert sampler.epoch == 4
    assert list(sampler) == plan_batches(lengths, "token_budget", seed=5, epoch=4, max_tokens=160).to_lists()
    assert sampler.epoch == 5

    sampler = make()
    it = iter(sampler)
    first_two = [next(it), next(it)]
    sampler.set_epoch(0)  # same epoch: keep the cursor (HF Trainer calls this at every epoch start)
    assert sampler.batches_yielded == 2
    rest = list(sampler)
    assert (
        first_two + rest == plan_batches(lengths, "token_budget", seed=5, epoch=0, max_tokens=160).to_lists()
    )
    sampler.set_epoch(0)  # back to the start of epoch 0 from epoch 1
    assert sampler.epoch == 0 and sampler.batches_yielded == 0


def test_a_new_iterator_continues_from_the_cursor_and_stale_ones_do_not_move_it(lengths):
    sampler = SmartBatchSampler(lengths, "random", seed=0, batch_size=4)
    ref = sampler.plan.to_lists()
    old = iter(sampler)
    assert next(old) == ref[0]
    new = iter(sampler)  # continues after batch 0
    assert next(new) == ref[1]
    next(old)  # a stale iterator does not move the cursor
    assert sampler.batches_yielded == 2
    assert list(new) == ref[2:]
    assert sampler.epoch == 1


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_resume_contract(lengths, strategy):
    check_resume_contract(lambda: SmartBatchSampler(lengths[:29], strategy, seed=11, **STRATEGIES[strategy]))


def test_resume_contract_with_split_segments():
    lengths = np.array([5, 70, 3, 33, 100, 1, 64, 65, 12])
    check_resume_contract(
        lambda: SmartBatchSampler(
            lengths, "token_budget", seed=2, max_tokens=96, max_length=32, overlong="split"
        )
    )


def test_state_is_a_small_json_cursor(lengths):
    sampler = SmartBatchSampler(lengths, "packed", seed=9, capacity=128)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    assert state["fingerprint"] == sampler.plan.fingerprint
    assert (state["epoch"], state["batches_yielded"], state["seed"], state["strategy"]) == (0, 1, 9, "packed")
    assert len(json.dumps(state)) < 400


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lengths": "drop_one"}, "dataset changed"),
        ({"lengths": "edit_one"}, "dataset changed"),
        ({"strategy": "random", "options": {"batch_size": 4}}, "strategy changed"),
        ({"options": {"max_tokens": 200}}, "strategy options changed"),
        ({"seed": 4}, "seed changed"),
    ],
)
def test_load_refuses_a_changed_dataset_strategy_or_seed(lengths, change, message):
    saved = SmartBatchSampler(lengths, "token_budget", seed=3, max_tokens=160)
    next(iter(saved))
    state = saved.state_dict()
    new_lengths = lengths
    if change.get("lengths") == "drop_one":
        new_lengths = lengths[:-1]
    elif change.get("lengths") == "edit_one":
        new_lengths = lengths.copy()
        new_lengths[5] += 1
    other = SmartBatchSampler(
        new_lengths,
        change.get("strategy", "token_budget"),
        seed=change.get("seed", 3),
        **change.get("options", {"max_tokens": 160}),
    )
    with pytest.raises(ConfigError, match=message):
        other.load_state_dict(state)


def test_load_refuses_a_cursor_past_the_epoch(lengths):
    sampler = SmartBatchSampler(lengths, "random", batch_size=4)
    state = sampler.state_dict() | {"batches_yielded": len(sampler) + 1}
    with pytest.raises(ConfigError, match="batches of epoch 0 were yielded"):
        sampler.load_state_dict(state)
    with pytest.raises(ConfigError, match="version"):
        sampler.load_state_dict(sampler.state_dict() | {"version": 99})


def test_no_batch_size_attribute_for_accelerate():
    # accelerate's BatchSamplerShard drops rounds with a smaller batch when the sampler has a batch_size.
    assert not hasattr(SmartBatchSampler([3, 4, 5], "random", batch_size=2), "batch_size")


# -- segments -------------------------------------------------------------------------------------------


def test_split_plans_yield_segments_that_tile_every_example():
    lengths = np.array([5, 70, 3, 33, 100, 1, 64, 65])
    sampler = SmartBatchSampler(
        lengths, "token_budget", seed=0, max_tokens=96, max_length=32, overlong="split"
    )
    assert sampler.yields_segments
    keys = flat(list(sampler))
    assert all(isinstance(k, Segment) for k in keys)
    for example, n in enumerate(lengths):
        pieces = sorted((k.start, k.length) for k in keys if k.example == example)
        covered = [t for s, m in pieces for t in range(s, s + m)]
        assert covered == list(range(n))
        assert all(m <= 32 for _, m in pieces)


def test_whole_example_plans_yield_plain_indices(lengths):
    assert lengths.max() <= 120
    sampler = SmartBatchSampler(lengths, "token_budget", max_tokens=160, max_length=120, overlong="split")
    assert not sampler.yields_segments
    assert all(isinstance(i, int) for i in flat(list(sampler)))


def test_segment_dataset_feeds_the_planned_window_to_the_collator():
    rows = [{"input_ids": list(range(100, 100 + n))} for n in (40, 7)]
    ds = SegmentDataset(rows)
    got = ds.__getitems__([Segment(0, 32, 8), 1, Segment(0, 0, 32)])
    assert got[0]["segment_start"] == 32 and got[0]["segment_length"] == 8
    assert "segment_start" not in got[1]
    batch = PaddingCollator(0)(got)
    assert batch["input_ids"][0, :8].tolist() == list(range(132, 140))
    assert batch["attention_mask"].sum(1).tolist() == [8, 7, 32]
    assert ds[Segment(1, 2, 3)]["segment_start"] == 2 and len(ds) == 2


def test_truncating_plans_carry_the_truncation_to_the_collator():
    lengths = np.array([10, 50, 20])
    rows = [{"input_ids": list(range(n))} for n in lengths]
    sampler = SmartBatchSampler(lengths, "random", batch_size=3, max_length=16, overlong="truncate")
    assert sampler.yields_segments
    loader = DataLoader(SegmentDataset(rows), batch_sampler=sampler, collate_fn=PaddingCollator(0))
    (batch,) = list(loader)
    assert sorted(batch["attention_mask"].sum(1).tolist()) == [10, 16, 16]


# -- DataLoader and StatefulDataLoader ---------------------------------------------------------------------


class IndexDataset(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def collate_indices(batch: list[int]) -> list[int]:
    return list(batch)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_yields_the_plan_epoch_after_epoch(lengths, num_workers):
    sampler = SmartBatchSampler(lengths, "token_budget", seed=1, max_tokens=160)
    loader = DataLoader(
        IndexDataset(len(lengths)), batch_sampler=sampler, collate_fn=collate_indices, num_workers=num_workers
    )
    for epoch in range(2):
        assert len(loader) == len(sampler.plan_for_epoch(epoch))
        assert list(loader) == sampler.plan_for_epoch(epoch).to_lists()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_saves_and_restores_the_cursor_mid_epoch(lengths, num_workers):
    sdl = pytest.importorskip("torchdata.stateful_dataloader")

    def make_loader():
        sampler = SmartBatchSampler(lengths, "packed", seed=4, capacity=128)
        return sdl.StatefulDataLoader(
            IndexDataset(len(lengths)),
            batch_sampler=sampler,
            collate_fn=collate_indices,
            num_workers=num_workers,
        )

    ref_loader = make_loader()
    epoch0, epoch1 = list(ref_loader), list(ref_loader)
    assert epoch0 != epoch1
    for k in (1, len(epoch0) // 2, len(epoch0) - 1):
        loader = make_loader()
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = loader.state_dict()
        assert _find_cursor(state) == (0, k), (
            "the loader state holds the sampler cursor of the last batch returned"
        )
        del it, loader

        resumed = make_loader()
        resumed.load_state_dict(state)
        assert head + list(resumed) == epoch0
        assert list(resumed) == epoch1


def _find_cursor(state):
    if isinstance(state, dict):
        if "fingerprint" in state and "batches_yielded" in state:
            return state["epoch"], state["batches_yielded"]
        for value in state.values():
            found = _find_cursor(value)
            if found is not None:
                return found
    return None


# -- properties --------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.one_of(
        st.lists(st.integers(1, 300), min_size=0, max_size=40),
        st.integers(1, 30).map(lambda n: [17] * n),
    ),
    strategy=st.sampled_from(list(STRATEGIES)),
    seed=st.integers(0, 3),
    stop=st.integers(0, 50),
)
def test_property_cover_and_resume(lengths, strategy, seed, stop):
    options = dict(STRATEGIES[strategy])
    spec = make_spec(strategy, **options)
    if spec.token_limit()[0] is not None and "overlong" in type(spec).__dataclass_fields__:
        options["overlong"] = "split"  # lengths up to 300 go over the limit: in pieces
    make = lambda: SmartBatchSampler(lengths, strategy, seed=seed, **options)  # noqa: E731
    sampler = make()
    batches = list(sampler)
    examples = [k.example if isinstance(k, Segment) else k for k in flat(batches)]
    assert sorted(set(examples)) == list(range(len(lengths)))
    if not sampler.yields_segments:
        assert sorted(examples) == list(range(len(lengths)))
    k = min(stop, len(batches))
    first = make()
    it = iter(first)
    head = [next(it) for _ in range(k)]
    second = make()
    second.load_state_dict(first.state_dict())
    assert head + list(second) == batches
