"""Out-of-memory back-off that keeps the optimizer step: splitting collated micro-batches, the injected
fault, and the Trainer going on with the same loss, steps and examples (one process here; two gloo
ranks in tests/test_adaptive_distributed.py)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

from test_trainer import counting_dataset, max_diff, tiny_llama, training_args, weights  # noqa: E402

from smart_batching import ConfigError  # noqa: E402
from smart_batching.adaptive.backoff import (  # noqa: E402
    ENV_FAIL_OVER_TOKENS,
    ENV_FAIL_RANKS,
    ENV_FAIL_STAGE,
    BackoffState,
    OomBackoff,
    injected_error,
    injected_fault,
    is_out_of_memory,
    null_piece,
    split_inputs,
    token_slots,
)
from smart_batching.collate import PackingCollator, PaddingCollator  # noqa: E402
from smart_batching.fallbacks import FallbackWarning, recorded_fallbacks  # noqa: E402
from smart_batching.hf import SAMPLER_STATE_NAME, SmartBatchingTrainer  # noqa: E402
from smart_batching.hf.adaptive import BackoffExhaustedError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# `packed` pinned to the tightest packing (`auto`): these tests compare weights after a split with the
# unsplit run at 5e-5, and the default `spread_fit` rows of mixed lengths split into micro-batches whose
# summation order differs more; Adam divides by the root of near-zero second moments on a few embedding
# entries and amplifies that float noise (measured with `spread_fit`: 1.6e-4; with `spread`, 8e-4 on one
# entry while the losses agreed).
STRATEGIES = {"token_budget": {"max_tokens": 192}, "packed": {"capacity": 160, "algorithm": "auto"}}


def features(n: int = 7, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(1, 500, size=int(k)).tolist()} for k in rng.integers(3, 30, size=n)]


def summed_loss(model, batch) -> torch.Tensor:
    """Summed token cross-entropy of a collated batch (labels shifted as a causal LM does)."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
    )


# -- pieces -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("collator", [PaddingCollator(0), PackingCollator()], ids=["padded", "packed"])
def test_pieces_cover_the_same_tokens_and_loss(collator):
    batch = collator(features())
    model = tiny_llama().eval()
    if isinstance(collator, PackingCollator):
        from smart_batching.attention import enable_packed_attention

        enable_packed_attention(model)
    budget = token_slots(batch) // 3
    pieces = split_inputs(batch, budget)
    assert len(pieces) >= 3
    assert all(token_slots(p) <= budget for p in pieces)
    # The same target tokens, in order, and the same summed loss.
    got = torch.cat([p["labels"][p["labels"] != -100] for p in pieces])
    torch.testing.assert_close(got, batch["labels"][batch["labels"] != -100])
    with torch.no_grad():
        whole = summed_loss(model, batch)
        parts = sum(summed_loss(model, p) for p in pieces)
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-4)


def test_packed_pieces_recompute_their_flash_kwargs():
    batch = PackingCollator()([{"input_ids": list(range(1, n + 1))} for n in (5, 3, 4, 6)])
    pieces = split_inputs(batch, 9)
    assert [p["cu_seq_lens_q"].tolist() for p in pieces] == [[0, 5, 8], [0, 4], [0, 6]]
    assert [p["max_length_q"] for p in pieces] == [5, 4, 6]
    assert [p["seq_idx"].tolist() for p in pieces] == [[[0] * 5 + [1] * 3], [[0] * 4], [[0] * 6]]
    assert pieces[2]["position_ids"].tolist() == [list(range(6))]


def test_what_cannot_shrink_comes_back_whole():
    one_row = PaddingCollator(0)([{"input_ids": list(range(1, 40))}])
    assert len(split_inputs(one_row, 10)) == 1
    one_doc = PackingCollator()([{"input_ids": list(range(1, 40))}])
    assert len(split_inputs(one_doc, 10)) == 1
    fits = PaddingCollator(0)(features())
    assert split_inputs(fits, token_slots(fits))[0]["input_ids"] is fits["input_ids"]


@pytest.mark.parametrize("collator", [PaddingCollator(0), PackingCollator()], ids=["padded", "packed"])
def test_null_piece_is_two_tokens_with_one_target(collator):
    piece = null_piece(collator(features()))
    assert token_slots(piece) == 2
    assert int((piece["labels"] != -100).sum()) == 1
    out = tiny_llama()(**piece)
    assert torch.isfinite(out.loss)


# -- what counts as out of memory, and the settings ---------------------------------------------------------


def test_out_of_memory_is_recognised():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"
        )
    )
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert is_out_of_memory(MemoryError())
    err = injected_error(100, 50, "forward")
    assert isinstance(err, torch.OutOfMemoryError) and is_out_of_memory(err)
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))
    assert not is_out_of_memory(ValueError("out of memory"))


def test_settings_and_environment(monkeypatch):
    assert OomBackoff.coerce(False) is None and OomBackoff.coerce(None) is None
    assert OomBackoff.coerce(True) == OomBackoff()
    assert OomBackoff.coerce({"factor": 0.25}).factor == 0.25
    with pytest.raises(ConfigError, match="unknown option"):
        OomBackoff.coerce({"halve": True})
    with pytest.raises(ConfigError, match="factor"):
        OomBackoff(factor=1.0)
    with pytest.raises(ConfigError, match="fail_stage"):
        OomBackoff(fail_stage="optimizer")
    monkeypatch.setenv(ENV_FAIL_OVER_TOKENS, "300")
    monkeypatch.setenv(ENV_FAIL_STAGE, "backward")
    monkeypatch.setenv(ENV_FAIL_RANKS, "1,3")
    config = OomBackoff.coerce(None)  # the environment turns it on
    assert (config.fail_over_tokens, config.fail_stage, config.fail_ranks) == (300, "backward", (1, 3))
    assert config.fails(301, 1) and not config.fails(301, 0) and not config.fails(300, 1)
    assert OomBackoff.coerce(False) is None  # an explicit False wins
    monkeypatch.setenv(ENV_FAIL_OVER_TOKENS, "lots")
    with pytest.raises(ConfigError, match=ENV_FAIL_OVER_TOKENS):
        OomBackoff.coerce(True)


def test_state_lowers_by_the_factor_and_round_trips():
    state = BackoffState()
    assert state.lower(1000, 0.5) == 500
    state.budget = 300
    assert state.lower(1000, 0.5) == 300  # never above the budget in force
    state.events.append({"step": 3})
    copy = BackoffState()
    copy.load_state_dict(json.loads(json.dumps(state.state_dict())))
    assert copy == state


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_injected_fault_strikes_half_way(stage):
    """The fault fires inside the model: in backward, after the later layers' gradients were added
    (what a real failure in backward leaves behind, which the Trainer must undo)."""
    model = tiny_llama()
    batch = PaddingCollator(0)(features())
    config = OomBackoff(fail_over_tokens=token_slots(batch) - 1, fail_stage=stage)
    with pytest.raises(torch.OutOfMemoryError, match=f"injected out-of-memory in {stage}"):  # noqa: SIM117
        with injected_fault(model, config, token_slots(batch), rank=0):
            model(**batch).loss.backward()
    grads = [p.grad is not None for p in model.parameters()]
    if stage == "forward":
        assert not any(grads)
    else:
        assert any(grads) and not all(grads)
    with injected_fault(model, config, token_slots(batch) - 1, rank=0):  # within the limit: no fault
        model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters())


# -- the Trainer ---------------------------------------------------------------------------------------------


def train(tmp_path, name, strategy, oom_backoff, *, options=None, **args):
    dataset = counting_dataset(40)
    trainer = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(tmp_path / name, **{"gradient_accumulation_steps": 2, **args}),
        train_dataset=dataset,
        strategy=strategy,
        strategy_options={**STRATEGIES[strategy], **(options or {})},
        oom_backoff=oom_backoff,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    trainer.caught = [w for w in caught if issubclass(w.category, FallbackWarning)]
    return trainer


def mid_step_limit(tmp_path, strategy, options) -> int:
    """A token-slot limit under which the plan's first failing micro-batch is the second of its step."""
    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=training_args(tmp_path / "probe"), train_dataset=counting_dataset(40),
        strategy=strategy, strategy_options={**STRATEGIES[strategy], **options},
    )  # fmt: skip
    plan = trainer.make_train_sampler().plan
    slots = plan.tokens_per_batch if plan.spec.packs_rows else plan.slots_per_batch  # as collated
    for j in range(1, 8, 2):  # second micro-batch of steps 0..3 (2 micro-batches per step)
        if slots[j] > slots[:j].max():
            return int(slots[:j].max())
    raise AssertionError(f"no micro-batch opens a failure mid-step: {slots[:8]}")


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_backoff_keeps_the_step_and_the_weights(tmp_path, strategy, stage):
    """Micro-batches over a limit fail; the run ends with the weights of the run planned with
    the same splits from the start (and of the run with no failure), after the same steps. The largest
    micro-batch is not first (costliest_first=False), so a failure in backward strikes mid-step and
    the step's earlier micro-batch is run again."""
    opts = {"costliest_first": False}
    limit = mid_step_limit(tmp_path, strategy, opts)
    failing = train(
        tmp_path, "fail", strategy, {"fail_over_tokens": limit, "fail_stage": stage}, options=opts
    )
    state = failing.smart_batching.backoff_state
    assert state.num_backoffs == 1 and state.num_failures == 1 and state.num_split >= 2
    assert state.events[0]["stage"] == stage and state.events[0]["slots"] > limit
    assert state.budget == state.events[0]["slots"] // 2
    assert state.events[0]["micro_batch"] == 1  # after the step's first: in backward it runs again
    planned = train(tmp_path, "planned", strategy, {"max_tokens": state.budget}, options=opts)
    assert planned.smart_batching.backoff_state.num_backoffs == 0
    plain = train(tmp_path, "plain", strategy, False, options=opts)
    assert failing.state.global_step == planned.state.global_step == plain.state.global_step == 4
    assert max_diff(weights(failing.model), weights(planned.model)) < 5e-5  # fp: Adam, other sums
    assert max_diff(weights(failing.model), weights(plain.model)) < 5e-5
    assert max_diff(weights(plain.model), weights(tiny_llama())) > 1e-3  # it trained: not vacuous
    # Warned once, counted in the log history and in the process's fallback counts.
    assert len(failing.caught) == 1 and "ran out of memory" in str(failing.caught[0].message)
    assert recorded_fallbacks().get("trainer.oom_backoff") == 1
    assert failing.state.log_history[-1]["oom_backoffs"] == 1


def test_backoff_on_the_first_step(tmp_path):
    """The costliest micro-batch comes first (the default), so the failure is the run's first pass."""
    failing = train(tmp_path, "fail", "token_budget", {"fail_over_tokens": 120, "fail_stage": "backward"})
    event = failing.smart_batching.backoff_state.events[0]
    assert event["step"] == 0
    plain = train(tmp_path, "plain", "token_budget", False)
    assert failing.state.global_step == plain.state.global_step
    assert max_diff(weights(failing.model), weights(plain.model)) < 5e-5


def test_the_budget_regrows_below_the_smallest_failure(tmp_path):
    """regrow_steps=1: after a step with no failure the budget doubles again, but never to a size that
    failed; the run still keeps its steps and weights."""
    failing = train(tmp_path, "fail", "packed", {"fail_over_tokens": 100, "regrow_steps": 1})
    state = failing.smart_batching.backoff_state
    first = state.events[0]["budget"]
    assert state.smallest_failed > 100 and first < state.budget <= state.smallest_failed - 1
    plain = train(tmp_path, "plain", "packed", False)
    assert failing.state.global_step == plain.state.global_step
    assert max_diff(weights(failing.model), weights(plain.model)) < 5e-5


def test_a_single_example_over_the_budget_cannot_back_off(tmp_path):
    with pytest.raises(BackoffExhaustedError, match="cannot be split further"):
        train(tmp_path, "fail", "token_budget", {"fail_over_tokens": 4})


def test_resume_reproduces_the_backoff(tmp_path):
    """The checkpoint keeps the budget: a resumed run (no fault injected now) splits as the interrupted
    one did and ends with its weights exactly."""
    fault = {"fail_over_tokens": 100}
    full = train(tmp_path, "full", "packed", fault, save_strategy="steps", save_steps=2)
    saved = json.loads((tmp_path / "full" / "out" / "checkpoint-2" / SAMPLER_STATE_NAME).read_text())
    assert saved["oom_backoff"]["budget"] == full.smart_batching.backoff_state.budget
    resumed = SmartBatchingTrainer(
        model=tiny_llama(),
        args=training_args(
            tmp_path / "full", gradient_accumulation_steps=2, save_strategy="steps", save_steps=2
        ),
        train_dataset=counting_dataset(40),
        strategy="packed",
        strategy_options=STRATEGIES["packed"],
        oom_backoff=True,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    assert resumed.smart_batching.backoff_state.budget == full.smart_batching.backoff_state.budget
    assert resumed.smart_batching.backoff_state.num_split > 0
    assert max_diff(weights(resumed.model), weights(full.model)) == 0.0


def test_lr_scaling_needs_a_schedule(tmp_path):
    with pytest.raises(ConfigError, match="lr_scaling"):
        SmartBatchingTrainer(
            model=tiny_llama(), args=training_args(tmp_path), train_dataset=counting_dataset(8),
            strategy="token_budget", strategy_options={"max_tokens": 192}, lr_scaling="sqrt",
        )  # fmt: skip


def test_deepspeed_and_multi_process_fsdp_are_refused_by_name(tmp_path, monkeypatch):
    """Where the back-off (or a multi-piece step) cannot keep ranks in lockstep it is refused before
    training: DeepSpeed owns accumulation and backward; FSDP gathers inside every pass. (Neither runs
    here: accelerate enables FSDP on GPU-like devices only, DeepSpeed is not installed; the Trainer's
    own flags are set as they would be.)"""
    from smart_batching.hf.adaptive import check_backoff_topology

    trainer = SmartBatchingTrainer(
        model=tiny_llama(), args=training_args(tmp_path), train_dataset=counting_dataset(8),
        strategy="token_budget", strategy_options={"max_tokens": 192},
    )  # fmt: skip
    trainer.is_deepspeed_enabled = True
    with pytest.raises(ConfigError, match="DeepSpeed"):
        trainer.setup_smart_batching("token_budget", strategy_options={"max_tokens": 192}, oom_backoff=True)
    with pytest.raises(ConfigError, match="batch_schedule"):
        trainer.setup_smart_batching(
            "token_budget", strategy_options={"max_tokens": 192}, batch_schedule="0:200"
        )
    trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled = False, True
    check_backoff_topology(trainer, OomBackoff(), pieces=True)  # one process: nothing to wait for
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ConfigError, match="needs DDP"):
        check_backoff_topology(trainer, OomBackoff(), pieces=False)
    check_backoff_topology(
        trainer, None, pieces=True
    )  # a schedule alone runs under FSDP (test_adaptive_fsdp)
