"""``mix_steps``: an optimizer step's micro-batches drawn from as many length strata (issue 34's fix for
steps that are one length stratum), in ``distribute``, the samplers, the real Trainer and the bench's
rows; and the token weights it is for."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from smart_batching import ConfigError
from smart_batching.analysis.weights import token_weights
from smart_batching.distributed import World, distribute
from smart_batching.distributed.sampler import DistributedSmartBatchSampler
from smart_batching.planners import plan_batches


def _lengths(n: int = 240, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 500, size=n)


def _round_costs(d) -> np.ndarray:
    """``(num_steps, world_size, accum_steps)`` cost of every slot (0 for an empty one)."""
    a = d.assignment
    return np.where(a >= 0, d.micro_batch_cost[np.maximum(a, 0)], 0)


@pytest.mark.parametrize("accum_steps", [2, 3])
def test_each_round_of_a_step_is_one_cost_stratum(accum_steps):
    plan = plan_batches(_lengths(), "group_by_length", batch_size=2, seed=3, epoch=1)
    d = distribute(plan, 1, accum_steps=accum_steps, mix_steps=True, seed=3)
    costs = _round_costs(d)[:, 0, :]  # (num_steps, accum_steps)
    # Round j of every step comes from stratum j: every cost of round j is at least every cost of round j+1.
    for j in range(accum_steps - 1):
        assert costs[:, j].min() >= costs[:, j + 1].max()
    # Every segment is trained exactly once, in one step.
    steps = d.segment_steps()
    assert steps.shape == (plan.num_segments,) and steps.min() >= 0


def _slots(plan, d) -> int:
    """Token slots of the distributed plan's micro-batches, each padded to its longest segment."""
    used = np.unique(d.assignment[d.assignment >= 0])
    return int(
        sum(
            plan.seg_lengths[d.micro_batch_segments(int(m))].max()
            * (d.micro_batch_end[m] - d.micro_batch_start[m])
            for m in used
        )
    )


@pytest.mark.parametrize("world_size", [2, 4])
def test_on_several_ranks_steps_mix_and_ranks_stay_even(world_size):
    lengths = _lengths(960)
    plan = plan_batches(lengths, "group_by_length", batch_size=2, seed=3, epoch=1)
    plain = distribute(plan, world_size, accum_steps=2, seed=3)
    mixed = distribute(plan, world_size, accum_steps=2, mix_steps=True, seed=3)

    def step_cv(d):
        tokens = np.bincount(d.segment_steps(), weights=plan.seg_lengths)
        return np.std(tokens) / np.mean(tokens)

    assert step_cv(mixed) < step_cv(plain) / 2
    assert mixed.max_step_imbalance < 1.02  # every rank one micro-batch of each stratum: even
    efficiency = lengths.sum() / np.array([_slots(plan, d) for d in (plain, mixed)])
    # The balancer evens out steps whose ranks' strata differ by moving segments: within the issue's 1 point.
    assert efficiency[1] > efficiency[0] - 0.01
    assert np.bincount(mixed.segment_steps()).sum() == plan.num_segments


def test_mixed_steps_hold_near_equal_tokens_and_even_token_weights():
    lengths = _lengths()
    plan = plan_batches(lengths, "group_by_length", batch_size=2, seed=0, epoch=0)
    targets = lengths * 0.7
    plain = distribute(plan, 1, accum_steps=4, seed=0)
    mixed = distribute(plan, 1, accum_steps=4, mix_steps=True, seed=0)

    def step_tokens(d):
        return np.bincount(d.segment_steps(), weights=plan.seg_lengths)

    cv = [np.std(step_tokens(d)) / np.mean(step_tokens(d)) for d in (plain, mixed)]
    assert cv[1] < cv[0] / 3  # strata together: steps of near-equal tokens
    w_plain = np.array(token_weights(plan, targets, plain.segment_steps()))
    w_mixed = np.array(token_weights(plan, targets, mixed.segment_steps()))
    assert w_plain[0] > 2.0  # similar micro-batches together: short examples weigh far over their share
    assert np.abs(w_mixed - 1).max() < 0.15
    # The micro-batches are the plan's own: mixing moves whole micro-batches, so the padding is the plan's.
    assert sorted(map(tuple, (mixed.micro_batch_segments(m) for m in range(len(plan))))) == sorted(
        map(tuple, (np.arange(*plan.segment_range(b)) for b in range(len(plan))))
    )


def test_mixing_is_seeded_and_differs_by_epoch():
    lengths = _lengths()
    plans = [plan_batches(lengths, "group_by_length", batch_size=2, seed=1, epoch=e) for e in (0, 1)]
    a = distribute(plans[0], 2, accum_steps=2, mix_steps=True, seed=1).assignment
    b = distribute(plans[0], 2, accum_steps=2, mix_steps=True, seed=1).assignment
    c = distribute(plans[1], 2, accum_steps=2, mix_steps=True, seed=1).assignment
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_one_micro_batch_per_step_is_left_as_it_is():
    plan = plan_batches(_lengths(), "group_by_length", batch_size=2, seed=0)
    plain = distribute(plan, 2, accum_steps=1, seed=0).assignment
    np.testing.assert_array_equal(
        plain, distribute(plan, 2, accum_steps=1, mix_steps=True, seed=0).assignment
    )


def test_segment_steps_agrees_with_a_loop_over_the_assignment():
    plan = plan_batches(_lengths(97), "token_budget", max_tokens=1200, seed=0)
    d = distribute(plan, 3, accum_steps=2, mix_steps=True, seed=0)
    expected = np.full(plan.num_segments, -1)
    for s in range(d.num_steps):
        for m in d.assignment[s].ravel():
            if m >= 0:
                expected[d.micro_batch_segments(int(m))] = s
    np.testing.assert_array_equal(d.segment_steps(), expected)


def test_token_weights_with_steps_agree_with_a_loop_and_default_to_batches():
    lengths = _lengths(64, seed=2)
    targets = np.random.default_rng(2).integers(1, 50, size=64).astype(float)
    plan = plan_batches(lengths, "group_by_length", batch_size=4, seed=0)
    batch_steps = np.repeat(np.arange(len(plan)), plan.segments_per_batch)
    assert token_weights(plan, targets) == token_weights(plan, targets, batch_steps)
    steps = batch_steps // 2  # two batches a step
    ids = plan.example_ids
    per_step = {s: targets[ids[steps == s]].sum() for s in np.unique(steps)}
    rank = np.argsort(np.argsort(lengths, kind="stable"), kind="stable")
    mass, share = np.zeros(4), np.zeros(4)
    for i, s in zip(ids, steps, strict=True):
        q = 4 * rank[i] // 64
        mass[q] += targets[i] / per_step[s]
        share[q] += targets[i]
    np.testing.assert_allclose(
        token_weights(plan, targets, steps), (mass / mass.sum()) / (share / share.sum())
    )
    with pytest.raises(ValueError, match="steps"):
        token_weights(plan, targets, steps[:-1])


def test_sampler_ranks_cover_the_epoch_and_resume_refuses_another_setting():
    lengths = _lengths(120)
    samplers = [
        DistributedSmartBatchSampler(
            lengths, "group_by_length", world=World(r, 2), accum_steps=2, mix_steps=True, batch_size=2, seed=0
        )
        for r in range(2)
    ]
    seen = [i for s in samplers for batch in s for i in batch]
    assert sorted(seen) == list(range(120))
    state = samplers[0].state_dict()
    assert state["mix_steps"] == 1
    plain = DistributedSmartBatchSampler(
        lengths, "group_by_length", world=World(0, 2), accum_steps=2, batch_size=2, seed=0
    )
    with pytest.raises(ConfigError, match="mix_steps"):
        plain.load_state_dict(state)
    again = DistributedSmartBatchSampler(
        lengths, "group_by_length", world=World(0, 2), accum_steps=2, mix_steps=True, batch_size=2, seed=0
    )
    again.load_state_dict(state)


def test_bench_rows_split_a_step_into_mixed_micro_batches():
    from smart_batching.bench.runner import matched_budgets
    from smart_batching.bench.training import row_accum_steps, strategy_options, trainer_row_options

    base, options = strategy_options(
        "group_by_length[mix_steps=2]", batch_size=4, max_tokens=512, capacity=512
    )
    assert base == "group_by_length" and options["batch_size"] == 2 and "mix_steps" not in options
    assert trainer_row_options("group_by_length[mix_steps=2]") == {"mix_steps": True}
    assert row_accum_steps("group_by_length[mix_steps=2]") == 2 and row_accum_steps("random") == 1
    with pytest.raises(ConfigError, match="divisible"):
        strategy_options("group_by_length[mix_steps=3]", batch_size=4, max_tokens=512, capacity=512)
    with pytest.raises(ConfigError, match="whole number"):
        row_accum_steps("group_by_length[mix_steps=0]")
    # A token budget matched to the fixed rows' step count: twice the batches, each about half the tokens.
    lengths = _lengths(200)
    budgets = matched_budgets(lengths, ["token_budget", "token_budget[mix_steps=2]"], 4, 4096, 4096, range(3))
    plain, mixed = budgets["token_budget"]["max_tokens"], budgets["token_budget[mix_steps=2]"]["max_tokens"]
    assert 0.4 * plain <= mixed <= 0.6 * plain
    assert len(plan_batches(lengths, "token_budget", max_tokens=mixed, seed=0)) <= 2 * 50


datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from test_trainer import counting_dataset, max_diff, tiny_llama, training_args, weights  # noqa: E402

from smart_batching.hf import SmartBatchingTrainer  # noqa: E402
from smart_batching.hf.resume import SAMPLER_STATE_NAME  # noqa: E402


class _Recorder:
    """Wraps the Trainer's collator: the real tokens of every micro-batch, in order."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.tokens: list[int] = []

    def __call__(self, features):
        self.tokens.append(sum(len(f["input_ids"]) for f in features))
        return self.inner(features)


_DEFAULT = object()


def _trainer(tmp_path, *, accum: int, mix=_DEFAULT, strategy="group_by_length", args=None, **extra):
    options = {"max_tokens": 120} if strategy == "token_budget" else {"batch_size": 2}
    if mix is not _DEFAULT:
        extra["mix_steps"] = mix
    return SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(
            tmp_path,
            **{"max_steps": -1, "num_train_epochs": 1, "gradient_accumulation_steps": accum, **(args or {})},
        ),
        train_dataset=counting_dataset(48, max_len=60),
        strategy=strategy,
        strategy_options=options,
        **extra,
    )


@pytest.mark.usefixtures("one_thread")
def test_trainer_steps_take_one_micro_batch_of_each_stratum(tmp_path):
    tokens = {}
    for mix in (False, True):
        trainer = _trainer(tmp_path / str(mix), accum=2, mix=mix)
        recorder = _Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.train()
        assert trainer.state.global_step == 12  # 48 examples, 2 a micro-batch, 2 micro-batches a step
        tokens[mix] = np.array(recorder.tokens).reshape(12, 2)
    assert isinstance(trainer.smart_batching.sampler, DistributedSmartBatchSampler)
    mixed = tokens[True]
    assert (
        mixed[:, 0].min() >= mixed[:, 1].max()
    )  # round 0 the longer half of the micro-batches, round 1 the shorter
    assert sorted(mixed.ravel()) == sorted(tokens[False].ravel())  # the same micro-batches
    step = {k: v.sum(axis=1) for k, v in tokens.items()}
    assert np.std(step[True]) < np.std(step[False]) / 1.5


def test_trainer_refuses_mix_steps_where_a_step_has_nothing_to_mix(tmp_path):
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        _trainer(tmp_path, accum=1, mix=True)
    with pytest.raises(ConfigError, match="batch_schedule"):
        _trainer(tmp_path, accum=2, mix=True, batch_schedule="0:8 100:16")
    with pytest.raises(ConfigError, match="'auto', True or False"):
        _trainer(tmp_path, accum=2, mix="yes")


def test_auto_mixes_group_by_length_with_accumulation_and_nothing_else(tmp_path, caplog):
    """The default, ``mix_steps="auto"``: on for group_by_length with several micro-batches a step (said
    once in the log), off where a step has one (also under a batch schedule) and for token_budget."""
    with caplog.at_level(logging.INFO, logger="smart_batching.hf"):
        trainer = _trainer(tmp_path, accum=2)
    sb = trainer.smart_batching
    assert sb.mix_steps and sb.mix_steps_auto
    assert sum("mix_steps='auto' is on" in r.getMessage() for r in caplog.records) == 1
    assert isinstance(trainer.make_train_sampler(), DistributedSmartBatchSampler)
    assert trainer.make_train_sampler().mix_steps
    off = [
        _trainer(tmp_path, accum=1),
        _trainer(tmp_path, accum=2, strategy="token_budget"),
        _trainer(tmp_path, accum=1, batch_schedule="0:8 100:16"),  # a schedule runs with accumulation 1
        _trainer(tmp_path, accum=2, mix=False),
    ]
    for t in off:
        assert not t.smart_batching.mix_steps and not t.smart_batching.mix_steps_auto
    assert not isinstance(off[0].make_train_sampler(), DistributedSmartBatchSampler)
    assert _trainer(tmp_path, accum=2, strategy="token_budget", mix=True).smart_batching.mix_steps


@pytest.mark.usefixtures("one_thread")
def test_auto_trains_the_steps_of_mix_steps_true(tmp_path):
    runs = {}
    for mix in (True, _DEFAULT):
        trainer = _trainer(tmp_path / str(mix is True), accum=2, mix=mix, args={"max_steps": 3})
        recorder = _Recorder(trainer.data_collator)
        trainer.data_collator = recorder
        trainer.train()
        runs[mix is True] = (recorder.tokens, weights(trainer.model))
    assert runs[True][0] == runs[False][0] and len(runs[True][0]) >= 6  # 3 steps of 2 (and a prefetch)
    assert max_diff(runs[True][1], runs[False][1]) == 0.0


@pytest.mark.usefixtures("one_thread")
def test_resume_keeps_the_mix_it_was_saved_with(tmp_path):
    """A mixed run resumes to the same weights; a checkpoint resumes only under the ``mix_steps`` it was
    saved with (the same micro-batches fall into other steps otherwise), and the refusal says which and
    why: a run saved with ``mix_steps=False`` meets the ``"auto"`` default."""
    save = {"max_steps": 5, "save_strategy": "steps", "save_steps": 3}
    full = _trainer(tmp_path / "mixed", accum=2, args=save)
    full.train()
    mixed_checkpoint = tmp_path / "mixed" / "out" / "checkpoint-3"
    assert json.loads((mixed_checkpoint / SAMPLER_STATE_NAME).read_text())["mix_steps"] == 1
    resumed = _trainer(tmp_path / "mixed", accum=2, args=save)
    resumed.train(resume_from_checkpoint=str(mixed_checkpoint))
    assert max_diff(weights(resumed.model), weights(full.model)) <= 1e-6
    with pytest.raises(ConfigError, match=r"formed with mix_steps=True.*Resume with mix_steps=True"):
        _trainer(tmp_path / "mixed", accum=2, mix=False, args=save).train(
            resume_from_checkpoint=str(mixed_checkpoint)
        )

    _trainer(tmp_path / "plain", accum=2, mix=False, args=save).train()
    plain_checkpoint = str(tmp_path / "plain" / "out" / "checkpoint-3")
    with pytest.raises(
        ConfigError, match=r"mix_steps=False and this run has mix_steps=True \(mix_steps='auto'"
    ):
        _trainer(tmp_path / "plain", accum=2, args=save).train(resume_from_checkpoint=plain_checkpoint)
    again = _trainer(tmp_path / "plain", accum=2, mix=False, args=save)
    again.train(resume_from_checkpoint=plain_checkpoint)
    assert again.state.global_step == 5
    restart = _trainer(tmp_path / "plain", accum=2, args={**save, "ignore_data_skip": True})
    restart.train(resume_from_checkpoint=plain_checkpoint)  # the data order restarts: nothing to refuse
    assert restart.state.global_step == 5


def test_sampler_resumes_a_state_saved_before_mix_steps_as_unmixed():
    lengths = _lengths(40)
    plain = DistributedSmartBatchSampler(
        lengths, "group_by_length", world=World(0, 1), accum_steps=2, batch_size=2
    )
    state = plain.state_dict()
    del state["mix_steps"]  # as saved before the option existed
    again = DistributedSmartBatchSampler(
        lengths, "group_by_length", world=World(0, 1), accum_steps=2, batch_size=2
    )
    again.load_state_dict(state)
    mixed = DistributedSmartBatchSampler(
        lengths, "group_by_length", world=World(0, 1), accum_steps=2, mix_steps=True, batch_size=2
    )
    with pytest.raises(ConfigError, match="saved with mix_steps=False, now True"):
        mixed.load_state_dict(state)


def _example(name: str):
    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"mix_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("one_thread")
def test_auto_mixes_an_sft_trainer_and_leaves_dpo_steps_alone(tmp_path):
    """The ``"auto"`` default reaches TRL's ``SFTTrainer`` through ``apply_smart_batching`` (the
    Trainer's kind: its steps mix and train); a ``DPOTrainer``'s kind has no ``mix_steps`` and keeps
    its steps."""
    trl = pytest.importorskip("trl")
    from smart_batching.hf import apply_smart_batching

    sft = _example("trl_sft")
    tokenizer = sft.word_tokenizer()
    config = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=2, gradient_accumulation_steps=2, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, max_length=None, dataset_num_proc=None, bf16=False,
    )  # fmt: skip
    trainer = trl.SFTTrainer(
        model=sft.tiny_llama(len(tokenizer)), args=config, train_dataset=sft.copy_task(32),
        processing_class=tokenizer,
    )  # fmt: skip
    apply_smart_batching(trainer, "group_by_length", batch_size=4)
    assert trainer.smart_batching.mix_steps and trainer.smart_batching.mix_steps_auto
    trainer.train()
    assert trainer.state.global_step == 2
    assert isinstance(trainer.sb_sampler, DistributedSmartBatchSampler) and trainer.sb_sampler.mix_steps

    dpo = _example("trl_dpo")
    pairs = dpo.preference_task(16, seed=5)
    trainer = dpo.dpo_trainer(pairs, output_dir=str(tmp_path / "dpo"), gradient_accumulation_steps=2)
    apply_smart_batching(trainer, "group_by_length", batch_size=2)
    assert not trainer.smart_batching.mix_steps
    with pytest.raises(ConfigError, match="mix_steps"):
        apply_smart_batching(trainer, "group_by_length", batch_size=2, mix_steps=True)


def test_auto_steps_aside_where_the_examples_cannot_fill_a_step(tmp_path, caplog):
    """Three examples and 4 micro-batches a step: mixing would leave a micro-batch empty, so ``"auto"``
    turns off (one log line) and the run trains as before; ``mix_steps=True`` is refused, naming the way
    out."""

    def make(mix=_DEFAULT):
        extra = {} if mix is _DEFAULT else {"mix_steps": mix}
        return SmartBatchingTrainer(
            model=tiny_llama(),
            args=training_args(tmp_path, max_steps=1, gradient_accumulation_steps=4),
            train_dataset=counting_dataset(3, max_len=20),
            strategy="group_by_length",
            strategy_options={"batch_size": 1},
            **extra,
        )

    trainer = make()
    assert trainer.smart_batching.mix_steps
    with caplog.at_level(logging.INFO, logger="smart_batching.hf"):
        trainer.train()
    assert not trainer.smart_batching.mix_steps and not trainer.smart_batching.mix_steps_auto
    assert not isinstance(trainer.sb_sampler, DistributedSmartBatchSampler)
    assert any("mix_steps='auto' is off" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="mix_steps=False"):
        make(True).train()
