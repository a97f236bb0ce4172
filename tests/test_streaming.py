"""StreamingBatcher / StreamingBatchDataset: exactly once, limits, bounded memory, resume, workers, ranks."""

from __future__ import annotations

import io
import json
import os
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ports import store_init
from strategy_cases import cases
from torch.utils.data import DataLoader

from smart_batching import ConfigError, DataError, OverlongError, PackedSpec, plan_batches
from smart_batching.collate import PackingCollator, PaddingCollator
from smart_batching.distributed import World
from smart_batching.planners import make_spec
from smart_batching.sampler import Segment
from smart_batching.streaming import StreamingBatchDataset, StreamingBatcher

CAP = 64
POLICIES = ("split", "drop", "truncate")


def _stream_cases() -> list:
    """Every registered strategy's example option sets that can stream, for lengths up to about 2 x CAP:
    where they set a token limit, with an overlong policy (each policy in turn)."""
    out = []
    for i, param in enumerate(cases(CAP)):
        name, options = param.values
        spec = make_spec(name, **options)
        try:
            spec.check_streamable()
        except ConfigError:
            continue
        if not spec.can_stream():
            continue
        if spec.token_limit()[0] is not None:
            options = {**options, "overlong": POLICIES[i % len(POLICIES)]}
        out.append(pytest.param(name, options, id=param.id))
    return out


STRATEGIES = _stream_cases()


def _limit(name: str, options: dict) -> int | None:
    return make_spec(name, **options).token_limit()[0]


def _source(lengths: list[int], kind: str, seed: int = 0) -> Any:
    """The same stream as a list of ints, chunks of arrays, example dicts, or an open(start) callable."""
    if kind == "ints":
        return list(lengths)
    if kind == "chunks":
        arr = np.asarray(lengths, dtype=np.int64)
        cuts = np.sort(np.random.default_rng(seed).integers(0, arr.size + 1, 3))
        return np.split(arr, cuts)
    if kind == "dicts":
        return [{"id": i, "input_ids": list(range(n))} for i, n in enumerate(lengths)]
    if kind == "opener":
        return lambda start: iter(lengths[start:])
    raise AssertionError(kind)


def _norm(batch: list[Any]) -> list[tuple[int, int, int | None]]:
    """A batch as (example, start, length) triples (length None: the whole example)."""
    out = []
    for x in batch:
        if isinstance(x, Segment):
            out.append((x.example, x.start, x.length))
        elif isinstance(x, dict):
            if "segment_start" in x:
                out.append((x["id"], x["segment_start"], x["segment_length"]))
            else:
                out.append((x["id"], 0, None))
        else:
            out.append((int(x), 0, None))
    return out


def _check_contract(
    lengths: list[int],
    batches: list[list],
    b: StreamingBatcher,
    name: str,
    options: dict,
    *,
    full_batches: bool = True,
) -> None:
    """Every example once (whole, truncated or in pieces) or counted as dropped; limits respected.

    ``full_batches``: fixed-size strategies emit only full batches before the stream ends (a token bound
    may force a short one out when a batch's worth of examples exceeds half the bound).
    """
    limit, policy = _limit(name, options), options.get("overlong", "error")
    norm = [_norm(x) for x in batches]
    got: dict[int, list[tuple[int, int]]] = {}
    for batch in norm:
        for e, s, n in batch:
            got.setdefault(e, []).append((s, lengths[e] if n is None else n))
    stats = b.stats
    dropped = [i for i in range(len(lengths)) if i not in got]
    # Empty examples are skipped (counted in num_empty), the overlong policy's drops in num_dropped.
    assert stats.num_empty == sum(1 for n in lengths if n == 0)
    assert all(lengths[i] > 0 for i in got)
    assert stats.num_dropped == len(dropped) - stats.num_empty
    assert stats.num_examples == len(lengths)
    over = [i for i, n in enumerate(lengths) if limit is not None and n > limit]
    assert stats.num_over_limit == len(over)
    tail_dropped = 0
    for i, n in enumerate(lengths):
        pieces = sorted(got.get(i, []))
        if limit is not None and n > limit and policy == "drop":
            assert pieces == []
        elif limit is not None and n > limit and policy == "truncate":
            assert pieces == [(0, limit)]
        elif limit is not None and n > limit and policy == "split":
            assert pieces == [(s, min(limit, n - s)) for s in range(0, n, limit)]
        elif not pieces and n == 0:
            continue  # skipped as empty
        elif not pieces:
            tail_dropped += 1  # drop_last at the end of the stream
        else:
            assert pieces == [(0, n)], (i, pieces)
    if not options.get("drop_last"):
        assert tail_dropped == 0
    else:
        assert tail_dropped < options["batch_size"]
    seg_len = [[lengths[e] if n is None else n for e, _, n in batch] for batch in norm]
    assert all(seg_len), "no empty batches"
    # The strategy's own limits, and those the options name, whatever the strategy.
    limits = b.spec.micro_batch_limits()
    assert all(limits.fits(np.asarray(x), planned=True) for x in seg_len)
    if "capacity" in options:
        assert all(sum(x) <= options["capacity"] * options.get("rows_per_batch", 1) for x in seg_len)
    if "max_tokens" in options:
        assert all(len(x) * max(x) <= options["max_tokens"] for x in seg_len)
    for key in ("max_batch_size", "batch_size"):
        if key in options:
            assert all(len(x) <= options[key] for x in seg_len)
    bs = options.get("batch_size")
    if bs is not None and full_batches:
        assert sum(len(x) < bs for x in seg_len) <= 1  # only the stream's last batch may be short
    if policy != "split" and b.buffer_size is not None:
        assert stats.max_buffered <= b.buffer_size
    if b.buffer_tokens is not None and (limit is None or limit <= b.buffer_tokens):
        assert stats.max_buffered_tokens <= b.buffer_tokens
    assert stats.num_segments == sum(len(x) for x in norm)
    assert stats.num_batches == len(norm)


# --- Contract: exactly once, limits, bounds ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "options"), STRATEGIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.one_of(
        st.just([]),
        st.lists(st.integers(0, 2 * CAP + 10), max_size=250),
        st.lists(st.integers(1, 12), min_size=1, max_size=250),  # many short: deep packs
        st.lists(st.just(CAP), max_size=40),  # all equal, exactly the capacity
    ),
    buffer_size=st.integers(6, 60),
    kind=st.sampled_from(["ints", "chunks", "dicts"]),
    seed=st.integers(0, 3),
)
def test_exactly_once_and_limits(name, options, lengths, buffer_size, kind, seed) -> None:
    buffer_size = max(buffer_size, options.get("batch_size", 1))  # a buffer holds at least one batch
    b = StreamingBatcher(_source(lengths, kind, seed), name, buffer_size=buffer_size, seed=seed, **options)
    _check_contract(lengths, list(b), b, name, options)


@pytest.mark.parametrize(("name", "options"), STRATEGIES)
def test_token_bound(name, options) -> None:
    lengths = np.random.default_rng(1).integers(1, CAP, 400).tolist()
    b = StreamingBatcher(lengths, name, buffer_size=None, buffer_tokens=600, **options)
    batches = list(b)
    _check_contract(lengths, batches, b, name, options, full_batches=False)
    assert b.stats.max_buffered_tokens <= 600


def test_overlong_error_names_the_stream_position() -> None:
    with pytest.raises(OverlongError, match=r"stream position 3 has 100 tokens.*capacity=64"):
        list(StreamingBatcher([5, 6, 7, 100, 8], "packed", capacity=64, buffer_size=2))


def test_single_example_bigger_than_the_token_bound_enters_alone() -> None:
    b = StreamingBatcher([5, 500, 5, 5], "token_budget", max_tokens=1000, buffer_size=None, buffer_tokens=100)
    assert sorted(i for x in b for i in x) == [0, 1, 2, 3]
    assert b.stats.max_buffered_tokens == 500


# --- Quality: close to the global plan -------------------------------------------------------------------


def test_packed_fill_close_to_the_global_plan() -> None:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(180), 0.5, 30_000), 8, 1500).astype(np.int64)
    global_eff = plan_batches(lengths, "packed", capacity=2048).stats().efficiency
    b = StreamingBatcher([lengths], "packed", capacity=2048, buffer_size=5000)
    for _ in b:
        pass
    assert b.stats.efficiency > global_eff - 0.002
    assert b.stats.num_rounds > 3


def test_group_by_length_pads_less_than_random() -> None:
    lengths = np.random.default_rng(0).integers(1, 500, 5000)
    eff = {}
    for name in ("random", "group_by_length"):
        b = StreamingBatcher([lengths], name, batch_size=8, buffer_size=1000)
        for _ in b:
            pass
        eff[name] = b.stats.efficiency
    assert eff["group_by_length"] > eff["random"] + 0.2


# --- Determinism and epochs -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "options"), STRATEGIES)
def test_deterministic_in_seed_and_epoch(name, options) -> None:
    lengths = np.random.default_rng(2).integers(1, 2 * CAP, 300).tolist()

    def run(seed: int) -> list:
        return [_norm(x) for x in StreamingBatcher(lengths, name, buffer_size=40, seed=seed, **options)]

    assert run(0) == run(0)
    assert run(0) != run(1)
    b = StreamingBatcher(lengths, name, buffer_size=40, **options)
    first, second = [_norm(x) for x in b], [_norm(x) for x in b]  # a finished pass rolls to the next epoch
    assert b.epoch == 1 and first != second
    b.set_epoch(0)
    assert [_norm(x) for x in b] == first


# --- Bounded memory over a long stream ------------------------------------------------------------------


def test_one_million_examples_in_bounded_memory() -> None:
    n, buffer_size = 1_000_000, 10_000

    def lengths():  # a generator: nothing about the stream exists up front
        rng = np.random.default_rng(0)
        for _ in range(n // 10_000):
            yield from rng.integers(1, 600, 10_000).tolist()

    for _ in StreamingBatcher([np.arange(1, 300)], "packed", capacity=2048, buffer_size=100):
        pass  # load the compiled kernels before tracing: their one-off loading is no part of the bound
    b = StreamingBatcher(lengths(), "packed", capacity=2048, buffer_size=buffer_size)
    tracemalloc.start()
    try:
        num_segments = 0
        checksum = 0
        for batch in b:
            num_segments += len(batch)
            checksum += sum(batch)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert num_segments == n and checksum == n * (n - 1) // 2  # every position exactly once
    assert b.stats.num_examples == n
    assert b.stats.max_buffered <= buffer_size
    # A map-style plan needs the lengths (8 MB) and its flat arrays (5 x 8 MB); the stream ~3.5 MB here,
    # for its 10,000-example buffer and one round's temporaries.
    full_dataset = 6 * 8 * n
    assert peak < full_dataset / 10, peak
    assert b.stats.efficiency > 0.999


# --- Resume: stop at every step, reload, compare -----------------------------------------------------------


def _resume_everywhere(make, roundtrip=lambda s: json.loads(json.dumps(s))) -> None:
    b = make()
    states, batches = [roundtrip(b.state_dict())], []
    for batch in b:
        batches.append(_norm(batch))
        states.append(roundtrip(b.state_dict()))
    final = b.stats.to_dict()
    assert len(batches) > 5
    for k, state in enumerate(states):
        r = make()
        r.load_state_dict(state)
        assert batches[:k] + [_norm(x) for x in r] == batches, k
        assert r.stats.to_dict() == final


@pytest.mark.parametrize(("name", "options"), STRATEGIES)
@pytest.mark.parametrize("kind", ["ints", "dicts", "opener"])
def test_resume_at_every_step(name, options, kind) -> None:
    lengths = np.random.default_rng(3).integers(1, 2 * CAP, 150).tolist()
    _resume_everywhere(
        lambda: StreamingBatcher(_source(lengths, kind), name, buffer_size=24, seed=5, **options)
    )


def test_resume_chunks_and_token_bound_and_torch_save() -> None:
    lengths = np.random.default_rng(4).integers(1, 3 * CAP, 100)
    chunks = np.array_split(lengths, 7)

    def roundtrip(state):
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    _resume_everywhere(
        lambda: StreamingBatcher(
            chunks, "packed", capacity=CAP, overlong="split", buffer_size=None, buffer_tokens=900
        ),
        roundtrip,
    )


def test_resume_mid_iteration_keeps_the_iterator_consistent() -> None:
    lengths = np.random.default_rng(5).integers(1, CAP, 200).tolist()
    full = [_norm(x) for x in StreamingBatcher(lengths, "packed", capacity=CAP, buffer_size=30)]
    b = StreamingBatcher(lengths, "packed", capacity=CAP, buffer_size=30)
    it = iter(b)
    head = [_norm(next(it)) for _ in range(7)]
    rest = [_norm(x) for x in b]  # a new iterator continues from the cursor; the old one stops
    assert head + rest == full
    assert list(it) == []


def test_resume_refuses_other_settings_and_a_changed_source() -> None:
    lengths = list(range(1, 60))
    b = StreamingBatcher(lengths, "packed", capacity=CAP, buffer_size=20, seed=1)
    it = iter(b)
    for _ in range(3):
        next(it)
    state = b.state_dict()
    assert state["buffer"]["ids"], "the test needs a non-empty buffer"
    with pytest.raises(ConfigError, match="seed=1"):
        StreamingBatcher(lengths, "packed", capacity=CAP, buffer_size=20, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="buffer_size=20"):
        StreamingBatcher(lengths, "packed", capacity=CAP, buffer_size=21, seed=1).load_state_dict(state)
    changed = StreamingBatcher([n + 1 for n in lengths], "packed", capacity=CAP, buffer_size=20, seed=1)
    changed.load_state_dict(state)
    with pytest.raises(DataError, match="source changed"):
        list(changed)
    used_up = iter(lengths)
    for _ in used_up:  # a one-shot iterator, already read once
        pass
    one_shot = StreamingBatcher(used_up, "packed", capacity=CAP, buffer_size=20, seed=1)
    one_shot.load_state_dict(state)
    with pytest.raises(DataError, match="cannot be re-read"):
        list(one_shot)


# --- HF datasets sources ------------------------------------------------------------------------------------


def _hf_stream(lengths: list[int], num_shards: int = 4):
    from datasets import Dataset

    data = {"id": list(range(len(lengths))), "input_ids": [[1] * n for n in lengths]}
    return Dataset.from_dict(data).to_iterable_dataset(num_shards=num_shards)


def test_hf_iterable_dataset_source_exactly_once_and_resume() -> None:
    lengths = np.random.default_rng(6).integers(1, 2 * CAP, 120).tolist()
    ds = _hf_stream(lengths)
    options = {"capacity": CAP, "overlong": "truncate"}
    b = StreamingBatcher(ds, "packed", buffer_size=25, **options)
    _check_contract(lengths, list(b), b, "packed", options)
    _resume_everywhere(lambda: StreamingBatcher(ds, "packed", buffer_size=25, seed=1, **options))


# --- Collators --------------------------------------------------------------------------------------------


def _token_examples(lengths: list[int]) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"id": i, "input_ids": rng.integers(1, 1000, n).tolist()} for i, n in enumerate(lengths)]


def test_batches_feed_the_collators() -> None:
    lengths = np.random.default_rng(7).integers(1, 2 * CAP, 200).tolist()
    examples = _token_examples(lengths)
    packed = StreamingBatchDataset(
        examples, PackedSpec(capacity=CAP, overlong="split"), buffer_size=40, collate_fn=PackingCollator()
    )
    total = 0
    for batch in DataLoader(packed, batch_size=None):
        n = batch["input_ids"].shape[1]
        assert n <= CAP and int(batch["cu_seq_lens_q"][-1]) == n
        total += n
    assert total == sum(lengths)  # split: every token once
    padded = StreamingBatchDataset(
        examples,
        "token_budget",
        max_tokens=4 * CAP,
        max_length=CAP,
        overlong="truncate",
        buffer_size=40,
        collate_fn=PaddingCollator(pad_token_id=0),
    )
    real = 0
    for batch in DataLoader(padded, batch_size=None):
        assert batch["input_ids"].numel() <= 4 * CAP
        real += int(batch["attention_mask"].sum())
    assert real == sum(min(n, CAP) for n in lengths)


# --- DataLoader workers and ranks -------------------------------------------------------------------------


def _ids(batch: list[Any]) -> list[int]:
    return [x["id"] if isinstance(x, dict) else int(x) for x in batch]


LENGTHS = np.random.default_rng(8).integers(1, 2 * CAP, 301).tolist()


def test_dataloader_two_workers_exactly_once() -> None:
    cases = [
        (_token_examples(LENGTHS), "packed", {"capacity": CAP, "overlong": "drop"}),
        (LENGTHS, "token_budget", {"max_tokens": 2 * CAP}),  # lengths: stream positions come back global
        (np.array_split(np.asarray(LENGTHS), 5), "group_by_length", {"batch_size": 4}),
        (_hf_stream(LENGTHS), "packed", {"capacity": CAP, "overlong": "drop"}),
    ]
    for source, name, options in cases:
        ds = StreamingBatchDataset(source, name, buffer_size=30, collate_fn=_ids, **options)
        loader = DataLoader(ds, batch_size=None, num_workers=2)
        seen = sorted(i for batch in loader for i in batch)
        expected = [i for i, n in enumerate(LENGTHS) if options.get("overlong") != "drop" or n <= CAP]
        assert seen == expected, name


def test_dataset_state_dict_resumes_a_worker() -> None:
    ds = StreamingBatchDataset(LENGTHS, "packed", capacity=2 * CAP, buffer_size=30, rank=1, world_size=2)
    it = iter(ds)
    head = [next(it) for _ in range(4)]
    state = json.loads(json.dumps(ds.state_dict()))
    rest = list(it)
    resumed = StreamingBatchDataset(LENGTHS, "packed", capacity=2 * CAP, buffer_size=30, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    other = StreamingBatchDataset(LENGTHS, "packed", capacity=2 * CAP, buffer_size=30, rank=0, world_size=2)
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match="same number of ranks"):
        list(other)
    assert sorted(i for b in head + rest for i in b) == list(range(1, len(LENGTHS), 2))


def test_stateful_dataloader_two_workers_resume() -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make():
        ds = StreamingBatchDataset(LENGTHS, "packed", capacity=2 * CAP, buffer_size=30, collate_fn=_ids)
        return stateful.StatefulDataLoader(ds, batch_size=None, num_workers=2, snapshot_every_n_steps=1)

    full = list(make())
    assert sorted(i for b in full for i in b) == list(range(len(LENGTHS)))
    for k in (0, 7, len(full) // 2, len(full) - 1, len(full)):  # the last two: a worker has finished
        loader = make()
        it = iter(loader)
        head = [next(it) for _ in range(k)]
        state = loader.state_dict()
        resumed = make()
        resumed.load_state_dict(state)
        assert head + list(resumed) == full, k


def test_world_is_explicit_or_detected() -> None:
    assert StreamingBatchDataset(LENGTHS, "random", batch_size=2).world == World(0, 1)
    assert StreamingBatchDataset(LENGTHS, "random", batch_size=2, rank=2, world_size=3).world == World(2, 3)
    with pytest.raises(ConfigError, match="rank= and world_size="):
        StreamingBatchDataset(LENGTHS, "random", batch_size=2, rank=1)


def _rank_main(rank: int, world_size: int, init: str, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        report = {}
        sources = {
            "examples": (_token_examples(LENGTHS), "packed", {"capacity": CAP, "overlong": "truncate"}, 0),
            "examples_2_workers": (_token_examples(LENGTHS), "token_budget", {"max_tokens": 2 * CAP}, 2),
            "hf": (_hf_stream(LENGTHS), "group_by_length", {"batch_size": 4}, 0),
            "hf_odd_shards": (_hf_stream(LENGTHS, num_shards=3), "packed", {"capacity": 2 * CAP}, 0),
        }
        for key, (source, name, options, workers) in sources.items():
            ds = StreamingBatchDataset(source, name, buffer_size=30, collate_fn=_ids, **options)
            assert ds.world == World(rank, world_size)  # read from torch.distributed
            # Fork the workers: a spawned rank would spawn them too, re-importing torch in each (slow).
            loader = DataLoader(
                ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None
            )
            report[key] = [i for b in loader for i in b]
        Path(out, f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_gloo_exactly_once(tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(2, store_init(tmp_path), str(tmp_path)), nprocs=2, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for key in reports[0]:
        per_rank = [r[key] for r in reports]
        assert all(per_rank), key  # both ranks got work
        seen = sorted(i for ids in per_rank for i in ids)
        assert seen == list(range(len(LENGTHS))), key  # the union is everything, with no duplicates


# --- Settings, stats, progress ------------------------------------------------------------------------------


def test_invalid_settings_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="buffer_size= .* or buffer_tokens="):
        StreamingBatcher([], "packed", buffer_size=None)
    with pytest.raises(ConfigError, match="buffer_size=2 is smaller than batch_size=4"):
        StreamingBatcher([], "group_by_length", batch_size=4, buffer_size=2)
    with pytest.raises(ConfigError, match="min_row_fill= applies to packed only"):
        StreamingBatcher([], "token_budget", min_row_fill=0.9)
    with pytest.raises(ConfigError, match="reserve="):
        StreamingBatcher([], "packed", reserve=0.9)
    with pytest.raises(ConfigError, match="needs max_length="):
        StreamingBatcher([], "max_length", batch_size=2)
    with pytest.raises(DataError, match="length_fn="):
        list(StreamingBatcher([{"text": "no ids"}], "packed"))
    with pytest.raises(DataError, match="type str"):
        list(StreamingBatcher(["a"], "packed"))


def test_length_fn_stats_and_progress(capsys) -> None:
    items = [("x" * n, n) for n in LENGTHS]
    b = StreamingBatcher(
        items, "packed", capacity=2 * CAP, buffer_size=50, length_fn=lambda t: t[1], progress=True
    )
    batches = list(b)
    assert sorted(id(x) for batch in batches for x in batch) == sorted(id(x) for x in items)
    stats = b.stats
    assert stats.real_tokens == sum(LENGTHS) and stats.token_slots == stats.num_rows * 2 * CAP
    assert 0.9 < stats.efficiency <= 1.0 and stats.num_buffered == 0
    assert "efficiency=" in capsys.readouterr().err
