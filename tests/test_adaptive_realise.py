"""A batch schedule realised on the plan of every registered strategy, on one process and on several
ranks: steps follow the schedule within one example, every example once, micro-batches within the
strategy's limits, every step balanced, and the step sampler's resume contract."""

from __future__ import annotations

import numpy as np
import pytest
from strategy_cases import cases
from test_planners import CONFIGS

import smart_batching as sb
from smart_batching.adaptive.realise import _rank_streams, realise, segment_weights
from smart_batching.adaptive.schedule import BatchSchedule, schedule_unit

pytest.importorskip("torch")

from smart_batching.adaptive.sampler import StepBatchSampler  # noqa: E402
from smart_batching.distributed import World  # noqa: E402
from smart_batching.sampler import SmartBatchSampler  # noqa: E402

LENGTHS = np.random.default_rng(3).integers(5, 200, size=1500)
TEXT = {"tokens": "linear:600->6000@40%", "examples": "linear:4->40@40%"}


def schedule_for(spec) -> BatchSchedule:
    unit = schedule_unit(spec)
    return BatchSchedule.parse(TEXT[unit], unit=unit)


def base_plan(name: str, epoch: int = 0):
    return sb.plan_batches(LENGTHS, name, seed=0, epoch=epoch, **CONFIGS[name])


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize(("name", "options"), cases(int(LENGTHS.max())))
def test_every_strategy_follows_the_schedule(name, options, world_size):
    """Every registered strategy with each of the option sets its spec gives for tests."""
    plan = sb.plan_batches(LENGTHS, name, seed=0, epoch=0, **options)
    schedule = schedule_for(plan.spec)
    sp = realise(plan, schedule, world_size=world_size)
    weights = segment_weights(plan, schedule.unit)
    longest = int(weights.max())
    # Every segment exactly once, over all ranks.
    np.testing.assert_array_equal(np.sort(np.concatenate(sp.rank_order)), np.arange(plan.num_segments))
    # Each rank runs as many micro-batches at every step; each micro-batch is a piece of one of the
    # plan's micro-batches (on several ranks: of one the balancer dealt, within the strategy's limits).
    if world_size == 1:
        sources = [np.asarray(plan.batch_bounds)]
    else:
        sources = _rank_streams(plan, world_size, 0, "tokens")[1]
    for r in range(world_size):
        micro = sp.rank_micro[r]
        assert micro.shape[0] - 1 == sp.step_offsets[-1]
        first = np.searchsorted(sources[r], micro[:-1], side="right")
        last = np.searchsorted(sources[r], micro[1:], side="left")
        assert np.all(first >= last), "a micro-batch spans two of the plan's"
    # Realised sizes follow the schedule within one example per rank (the last step takes what is
    # left); counted in tokens, each rank's share is within one example of its share of the target.
    got, targets = sp.step_weight[:-1], sp.step_targets[:-1]
    assert np.all(np.abs(got - targets) <= world_size * longest), name
    if schedule.unit == "tokens":
        shares = sp.rank_step_weight[:-1]
        assert np.all(np.abs(shares - targets[:, None] / world_size) <= longest), name
    got = sp.step_weight
    assert got[0] < got[-2] and sp.step_targets[0] == schedule.initial_size
    assert sp.step_targets[-2] == schedule.final_size
    # Balanced at every step: no rank's tokens further from another's than one example's (plus the
    # balancer's own unevenness of the rounds, 1 %, where a step spans many of them).
    tokens = sp.rank_step_tokens
    spread = tokens.max(axis=1) - tokens.min(axis=1)
    assert np.all(spread <= 2 * LENGTHS.max() + 0.01 * tokens.mean(axis=1)), name
    # A pure function: every rank computes the same.
    again = realise(plan, schedule, world_size=world_size)
    for a, b in zip(sp.rank_order, again.rank_order, strict=True):
        np.testing.assert_array_equal(a, b)


def test_budget_per_micro_batch_grows_before_micro_batches_are_added():
    plan = base_plan("token_budget")
    sp = realise(plan, BatchSchedule.parse("linear:100->2500@50%", unit="tokens"))
    per_step = sp.micro_per_step
    sizes = np.array([sum(int(plan.seg_lengths[s].sum()) for s in sp.step_segments(i)) / per_step[i]
                      for i in range(sp.num_steps)])  # fmt: skip
    planned = plan.tokens_per_batch.mean()  # real tokens of the plan's micro-batches (256 slots)
    assert per_step[0] == 1 and sizes[0] < 0.8 * planned  # small steps: one micro-batch under the budget
    assert per_step[-2] >= 0.8 * 2500 / planned  # 2,500 tokens in micro-batches of the plan
    assert sizes[-2] > 0.8 * planned


def test_later_epochs_continue_the_schedule():
    plan0, plan1 = base_plan("packed"), base_plan("packed", epoch=1)
    schedule = BatchSchedule.parse("linear:500->5000@150%", unit="tokens").resolve(
        int(plan0.seg_lengths.sum())
    )
    first = realise(plan0, schedule)
    second = realise(plan1, schedule, seen_before=int(plan0.seg_lengths.sum()))
    assert second.step_targets[0] > first.step_targets[-2]  # the ramp goes on where epoch 0 left it
    assert second.num_steps < first.num_steps


def test_step_sampler_resumes_at_every_step():
    """The resume contract: stop after any step, load the cursor into a fresh sampler, and the rest of
    the epoch (and the next) is the same."""
    for world in (World(0, 1), World(1, 2)):

        def make(world=world):
            inner = SmartBatchSampler(LENGTHS, "token_budget", max_tokens=256, seed=0)
            return StepBatchSampler(inner, "linear:600->6000@40%", world=world)

        reference = make()
        epoch0 = list(reference)
        epoch1 = list(reference)
        assert reference.epoch == 2 and len(epoch0) > len(epoch1)
        for stop in range(0, len(epoch0) + 1, 7):
            sampler = make()
            it = iter(sampler)
            for _ in range(stop):
                next(it)
            state = sampler.state_dict()
            resumed = make()
            resumed.load_state_dict(state)
            assert list(resumed) == epoch0[stop:]
            assert list(resumed) == epoch1


def test_step_sampler_refuses_another_schedule_or_world():
    inner = SmartBatchSampler(LENGTHS, "token_budget", max_tokens=256, seed=0)
    state = StepBatchSampler(inner, "0:600 10000:1200").state_dict()
    with pytest.raises(sb.ConfigError, match="batch_schedule"):
        StepBatchSampler(inner, "0:600 10000:2400").load_state_dict(state)
    with pytest.raises(sb.ConfigError, match="ranks"):
        StepBatchSampler(inner, "0:600 10000:1200", world=World(0, 2)).load_state_dict(state)


def test_analyze_reports_and_draws_the_realised_schedule(tmp_path, capsys):
    """``analyze --batch-schedule``: every row's realised schedule in the JSON records and a line of the
    report; ``--plot`` also draws the steps."""
    pytest.importorskip("matplotlib")
    from smart_batching.cli import main

    np.save(tmp_path / "lengths.npy", LENGTHS)
    args = ["analyze", str(tmp_path / "lengths.npy"), "--strategies", "random,token_budget,packed",
            "--batch-schedule", "linear:600->6000@40%", "--world-size", "2"]  # fmt: skip
    assert main([*args, "--plot", str(tmp_path / "a.png")]) == 0
    out = capsys.readouterr().out
    assert "batch schedule linear:600->6000@40% (tokens per optimizer step, 2 rank(s))" in out
    assert (tmp_path / "a_schedule.png").read_bytes()[:4] == b"\x89PNG"
    assert main([*args, "--json"]) == 0
    import json

    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for r in records:
        steps = r["schedule_steps"]
        assert r["schedule"]["num_steps"] == len(steps["size"]) == len(steps["target"])
        assert steps["target"][0] == 600 and steps["target"][-2] == 6000
        assert r["schedule"]["max_abs_step_error"] <= int(LENGTHS.max())  # one example per rank at most
