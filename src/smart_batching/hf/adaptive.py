"""Adaptive batch size in the Trainer: steps of several micro-batches run within one optimizer step,
and out-of-memory back-off that keeps the step (:mod:`smart_batching.adaptive.backoff`).

How a micro-batch runs (``training_step``), by setting:

==========================  ======================================================================
one process                 each piece through ``Trainer.training_step`` on the model; a failure is
                            caught, the piece split, the step goes on.
several processes,          every piece runs on the module inside DDP (no collective in its forward
``oom_backoff`` on (DDP)    or backward, so a rank that fails leaves no other rank waiting); at the
                            step's last micro-batch one all-reduce tells every rank whether any rank
                            backed off and the lowest budget, then a two-token pass through the DDP
                            model (its loss times 0) all-reduces the accumulated gradients, as DDP's
                            own synchronised backward would have.
several processes, pieces   every piece but the last under ``no_sync``; every rank runs as many
without back-off            pieces (the balanced plan gives each rank the same micro-batch count).
==========================  ======================================================================

A failure in backward has already added part of the micro-batch's gradient: the gradients are zeroed
and the step's earlier micro-batches (and the pieces of this one that succeeded) run again before the
split pieces, so the step's gradient is the same sum.

Not supported, refused by :func:`check_backoff_topology`: FSDP on several processes (FSDP gathers
parameters inside every forward and backward: a rank that fails half-way leaves the others waiting in
a collective, the hang Composer's open FSDP2 auto-microbatching work reports) and DeepSpeed (its
engine owns the accumulation steps and the backward).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from smart_batching import compat
from smart_batching.adaptive.backoff import (
    BackoffState,
    OomBackoff,
    free_memory,
    injected_fault,
    is_out_of_memory,
    null_piece,
    split_inputs,
    token_slots,
)
from smart_batching.adaptive.lr import check_lr_scaling, lr_factors, scale_lr_lambdas
from smart_batching.adaptive.schedule import BatchSchedule, schedule_unit
from smart_batching.adaptive.steps import MicroBatches
from smart_batching.adaptive.stream import StreamMicroBatches
from smart_batching.errors import ConfigError, SmartBatchingError
from smart_batching.fallbacks import warn_fallback

logger = logging.getLogger("smart_batching.hf")

_NO_BUDGET = 2**62


class BackoffExhaustedError(SmartBatchingError, RuntimeError):
    """A micro-batch ran out of memory and cannot be split further (one example over the budget)."""


class _GradientsLost(Exception):
    """A replayed micro-batch failed in backward: replay the step's micro-batches from the start."""


@dataclass
class StepRun:
    """The optimizer step in progress: its micro-batches (for replay) and what happened in it."""

    batches: list[Any] = field(default_factory=list)
    position: int = 0  # micro-batches of ``batches`` already run
    failed: bool = False  # a piece of this rank ran out of memory in this step


def check_backoff_topology(trainer: Any, backoff: OomBackoff | None, pieces: bool) -> None:
    """Refuse the settings under which back-off or multi-piece steps cannot keep the ranks in lockstep.

    Raises:
        ConfigError: DeepSpeed (back-off or a batch schedule), or FSDP on several processes with back-off.
    """
    if backoff is None and not pieces:
        return
    what = "oom_backoff" if backoff is not None else "batch_schedule"
    if compat.trainer_uses_deepspeed(trainer):
        raise ConfigError(
            f"{what}: DeepSpeed's engine owns the accumulation steps and the backward, so a step of several "
            f"pieces cannot run through it; train without DeepSpeed, or set {what}=None"
        )
    if backoff is not None and trainer.args.world_size > 1 and compat.trainer_uses_fsdp(trainer):
        raise ConfigError(
            "oom_backoff on several processes needs DDP: FSDP gathers parameters inside every forward and "
            "backward, so a rank that runs out of memory half-way would leave the others waiting in a "
            "collective. Set oom_backoff=False (or train with DDP)"
        )


class AdaptiveMixin:
    """Trainer overrides for steps run as pieces; state on ``self.smart_batching``
    (``batch_schedule``, ``lr_scaling``, ``backoff``, ``backoff_state``, ``step``)."""

    def _setup_adaptive(self, batch_schedule: Any, lr_scaling: Any, oom_backoff: Any) -> None:
        sb = self.smart_batching
        sb.lr_scaling = check_lr_scaling(lr_scaling)
        if batch_schedule is not None:
            sb.batch_schedule = BatchSchedule.parse(batch_schedule, unit=schedule_unit(sb.spec))
        if sb.lr_scaling is not None and sb.batch_schedule is None:
            raise ConfigError(
                f"lr_scaling={sb.lr_scaling!r} scales the learning rate of steps whose size a batch_schedule "
                "changes: give batch_schedule= too, or set lr_scaling=None"
            )
        if sb.batch_schedule is not None and self.args.gradient_accumulation_steps != 1:
            raise ConfigError(
                f"batch_schedule sets how many micro-batches each optimizer step runs (as many of the strategy's "
                f"budget as the step's size needs), so gradient_accumulation_steps="
                f"{self.args.gradient_accumulation_steps} has no meaning with it: set gradient_accumulation_steps=1"
            )
        sb.backoff, sb.backoff_state = backoff_setup(self, oom_backoff, sb.batch_schedule is not None)

    def _step_sampler(self, lengths: Any, units: Any) -> Any:
        """The sampler of a batch schedule: one item per optimizer step (this rank's micro-batches)."""
        from smart_batching.adaptive.sampler import StepBatchSampler
        from smart_batching.distributed import World
        from smart_batching.sampler import SmartBatchSampler

        sb, args = self.smart_batching, self.args
        inner = SmartBatchSampler(lengths, sb.spec, seed=sb.seed, units=units)
        return StepBatchSampler(inner, sb.batch_schedule, world=World(args.process_index, args.world_size))

    # -- the run's length and learning rate under a schedule ----------------------------------------------

    def _schedule_steps(
        self, epochs: int | None, max_steps: int | None
    ) -> tuple[list[int], list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """Optimizer steps of each epoch the run trains (planned one epoch after another) until ``epochs``
        epochs or ``max_steps`` steps, and per epoch, at each of its steps: the schedule's size, the size
        realised and the real tokens (all ranks)."""
        sampler = self.smart_batching.sampler
        counts: list[int] = []
        steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        while (epochs is not None and len(counts) < epochs) or (
            max_steps is not None and sum(counts) < max_steps
        ):
            stepped = sampler.stepped_plan(len(counts))
            counts.append(stepped.num_steps)
            steps.append((stepped.step_targets, stepped.step_weight, stepped.step_tokens))
        return counts, steps

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        values = super().set_initial_training_values(args, dataloader)
        sb = self.smart_batching
        if sb.batch_schedule is None or not hasattr(sb.sampler, "stepped_plan"):
            return values
        epochs, _, examples, samples, total_batch, _, max_steps = values
        if args.max_steps > 0:
            counts, steps = self._schedule_steps(None, args.max_steps)
            epochs, max_steps = len(counts), args.max_steps
        else:
            full = int(args.num_train_epochs)
            part = args.num_train_epochs - full  # a share of one more epoch
            counts, steps = self._schedule_steps(full + (part > 0), None)
            max_steps = sum(counts[:full]) + (math.ceil(part * counts[full]) if part > 0 else 0)
            epochs = math.ceil(args.num_train_epochs)
        sb.steps_per_epoch = counts
        columns = (
            zip(*steps, strict=True) if steps else ([np.zeros(0, dtype=np.int64)],) * 3
        )  # sizes, realised, tokens
        sb.step_sizes, sb.step_weights, sb.step_tokens = (np.concatenate(c)[:max_steps] for c in columns)
        # Trainer guesses a resumed epoch as global_step // steps_per_epoch: with the largest epoch that
        # guess is never past the true one (ResumeMixin._run_epoch finds the true one).
        per_epoch = max(counts)
        logger.info(
            "smart batching: batch_schedule %s gives %s optimizer steps per epoch, %d in all",
            sb.batch_schedule, counts, max_steps,
        )  # fmt: skip
        return epochs, per_epoch, examples, samples, total_batch, counts[0], max_steps

    def realised_schedule(self) -> dict[str, list[int]] | None:
        """The batch schedule as the run realised it, one entry per optimizer step trained so far (all
        ranks): ``tokens`` (real tokens), ``size`` (in the schedule's unit) and ``target`` (the
        schedule's size there); None without a schedule."""
        sb = self.smart_batching
        if sb.batch_schedule is None or not sb.steps_per_epoch:
            return None
        n = int(self.state.global_step)  # planned at set-up (set_initial_training_values), not again
        return {
            "tokens": sb.step_tokens[:n].tolist(),
            "size": sb.step_weights[:n].tolist(),
            "target": sb.step_sizes[:n].tolist(),
        }

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        sb = self.smart_batching
        if sb.lr_scaling is None or getattr(scheduler, "_smart_batching_scaled", False):
            return scheduler
        first = sb.batch_schedule.initial_size
        if sb.step_sizes is not None:  # map-style: every step's size is planned
            factors = lr_factors(sb.step_sizes, sb.lr_scaling, first)
            last = len(factors) - 1
            scale_lr_lambdas(scheduler, lambda step: float(factors[min(step, last)]) if last >= 0 else 1.0)
        elif sb.stream is not None:  # a stream: the next step's size from what it has seen so far
            scale_lr_lambdas(scheduler, lambda step: self._stream_lr_factor(first))
        else:
            return scheduler
        scheduler._smart_batching_scaled = True
        return scheduler

    def _stream_lr_factor(self, first: int) -> float:
        stream = self.smart_batching.step_stream
        size = first if stream is None else stream.schedule.size_at(stream.seen)
        return float(lr_factors([size], self.smart_batching.lr_scaling, first)[0])

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        # The back-off's count goes into the Trainer's log history (trainer_state.json) with the loss.
        if self.smart_batching.backoff is not None:
            logs["oom_backoffs"] = self.smart_batching.backoff_state.num_backoffs
        super().log(logs, *args, **kwargs)

    # -- the step's micro-batches ------------------------------------------------------------------------

    def _adaptive_active(self) -> bool:
        sb = self.smart_batching
        return sb.backoff is not None or sb.batch_schedule is not None

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        if not self._adaptive_active():
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        items = []
        for _ in range(num_batches):
            try:
                items.append(next(epoch_iterator))
            except StopIteration:
                break
        flat = [
            mb
            for item in items
            for mb in (item if isinstance(item, MicroBatches) else [item])
            if mb is not None
        ]
        _, num_items = super().get_batch_samples(iter(flat), len(flat), device)  # counted over micro-batches
        self.smart_batching.step = StepRun(batches=flat)
        return items, num_items

    def compute_loss(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        out = super().compute_loss(model, inputs, *args, **kwargs)
        self.smart_batching.forward_done = True  # a failure from here on is in backward
        return out

    def floating_point_ops(self, inputs: Any) -> int:
        if isinstance(inputs, MicroBatches):
            return sum(super(AdaptiveMixin, self).floating_point_ops(mb) for mb in inputs if mb is not None)
        return super().floating_point_ops(inputs)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        if isinstance(inputs, MicroBatches):
            for mb in inputs:
                if mb is not None:
                    super()._track_num_input_tokens(mb)
            return
        super()._track_num_input_tokens(inputs)

    # -- one micro-batch, as pieces ----------------------------------------------------------------------

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        sb = self.smart_batching
        bundle = isinstance(inputs, MicroBatches)
        if sb.backoff is None and not bundle:
            return super().training_step(model, inputs, num_items_in_batch)
        micro = list(inputs) if bundle else [inputs]
        if isinstance(inputs, StreamMicroBatches) and self.args.world_size > 1 and not self._deferred_sync():
            micro += [None] * self._stream_micro_batches(len(micro))  # as many passes as every rank
        present = [mb for mb in micro if mb is not None]
        if sb.step is None:  # called outside the Trainer's loop (a test, a custom loop)
            sb.step = StepRun(batches=present)
        losses = []
        for k, mb in enumerate(micro):
            final = k == len(micro) - 1
            if mb is None:  # this rank has fewer examples than the step's micro-batches
                self._null_pass(model, present[0], num_items_in_batch, final=final)
                continue
            losses.extend(self._run_micro_batch(model, mb, num_items_in_batch, final=final))
            sb.step.position += 1
        if sb.backoff is not None and self.accelerator.sync_gradients:
            self._end_of_step(model, present[0], num_items_in_batch)
        return torch.stack([loss.detach().reshape(()) for loss in losses]).sum()

    def _stream_micro_batches(self, count: int) -> int:
        """How many empty micro-batches this rank adds to a stream's step so that every rank runs as many
        (each rank grouped its own shard): one all-reduce."""
        most = torch.tensor([count], dtype=torch.int64, device=self.args.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
        return int(most.item()) - count

    def _deferred_sync(self) -> bool:
        """Back-off on several processes: pieces run locally, gradients are synchronised at the step's end."""
        return self.smart_batching.backoff is not None and self.args.world_size > 1

    def _local_model(self, model: Any) -> Any:
        if self._deferred_sync():
            return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        return model

    def _pieces(self, inputs: Any) -> list[Any]:
        sb = self.smart_batching
        budget = sb.backoff_state.budget if sb.backoff is not None else None
        if budget is None or token_slots(inputs) <= budget:
            return [inputs]
        pieces = split_inputs(inputs, budget)
        if len(pieces) > 1:
            sb.backoff_state.num_split += 1
        return pieces

    def _run_micro_batch(
        self, model: Any, inputs: Any, num_items: Any, *, final: bool, replaying: bool = False
    ) -> list[torch.Tensor]:
        """Forward and backward of one micro-batch, as pieces within the budget; returns their losses."""
        pieces = self._pieces(inputs)
        losses: list[torch.Tensor] = []
        i = 0
        while i < len(pieces):
            piece = pieces[i]
            last = final and i == len(pieces) - 1
            started = time.perf_counter()
            failure = self._try_piece(model, piece, num_items, last, losses)
            if failure is None:
                i += 1
                continue
            stage, message = failure
            parts = self._back_off(piece, stage, message, time.perf_counter() - started)
            pieces[i : i + 1] = parts
            if stage == "backward":
                if replaying:
                    raise _GradientsLost
                self._restore_gradients(model, num_items, pieces[:i])
        return losses

    def _try_piece(
        self, model: Any, piece: Any, num_items: Any, last: bool, losses: list[torch.Tensor]
    ) -> tuple[str, str] | None:
        """Run one piece; on running out of memory return ``(stage, message)`` with its memory freed."""
        sb = self.smart_batching
        sb.forward_done = False
        local = self._local_model(model)
        sync = nullcontext() if last or self._deferred_sync() else self.accelerator.no_sync(model)
        fault = (
            injected_fault(local, sb.backoff, token_slots(piece), self.args.process_index)
            if sb.backoff is not None
            else nullcontext()
        )
        try:
            with sync, fault:
                losses.append(super().training_step(local, piece, num_items))
            return None
        except Exception as exc:
            if sb.backoff is None or not is_out_of_memory(exc):
                raise
            failure = ("backward" if sb.forward_done else "forward", str(exc).splitlines()[0])
        free_memory()  # outside the except block: the exception and its frames are gone
        return failure

    def _back_off(self, piece: Any, stage: str, message: str, seconds: float) -> list[Any]:
        """Lower the budget after ``piece`` failed and split it; refuse when it cannot shrink."""
        sb = self.smart_batching
        state = sb.backoff_state
        slots = token_slots(piece)
        budget = state.lower(slots, sb.backoff.factor)
        parts = split_inputs(piece, budget)
        if len(parts) < 2:
            raise BackoffExhaustedError(
                f"a micro-batch of {slots} token slots ran out of memory in {stage} ({message}) and cannot be "
                "split further (it holds one example, or one row); lower max_length (or max_tokens / "
                "capacity) so that no single example is this long"
            )
        state.budget = budget
        state.num_failures += 1
        state.failed_seconds += seconds
        state.smallest_failed = min(state.smallest_failed or slots, slots)
        state.events.append(
            {"step": int(self.state.global_step), "micro_batch": sb.step.position, "stage": stage,
             "slots": slots, "budget": budget, "rank": int(self.args.process_index)}
        )  # fmt: skip
        sb.step.failed = True
        warn_fallback(
            "trainer.oom_backoff",
            f"a micro-batch of {slots} token slots ran out of memory in {stage} ({message}); it was split "
            f"into {len(parts)} pieces within the same optimizer step, and micro-batches over {budget} token "
            "slots are split from now on (same loss and examples, more passes). Lower max_tokens / capacity "
            "to plan smaller micro-batches from the start.",
        )
        return parts

    def _restore_gradients(self, model: Any, num_items: Any, done: list[Any]) -> None:
        """After a failure in backward: zero the gradients and run the step's earlier micro-batches and the
        pieces already done again (their losses were counted the first time)."""
        sb = self.smart_batching
        started = time.perf_counter()
        while True:
            model.zero_grad(set_to_none=True)
            try:
                for mb in [*sb.step.batches[: sb.step.position], *done]:  # earlier micro-batches, then pieces
                    self._run_micro_batch(model, mb, num_items, final=False, replaying=True)
                break
            except _GradientsLost:
                continue
        sb.backoff_state.failed_seconds += time.perf_counter() - started

    def _end_of_step(self, model: Any, first: Any, num_items: Any) -> None:
        """At the step's last micro-batch: agree on the budget across ranks and synchronise gradients."""
        sb = self.smart_batching
        state = sb.backoff_state
        failed = sb.step.failed
        if self.args.world_size > 1:
            agreed = torch.tensor(
                [int(failed), -(state.budget or _NO_BUDGET), -(state.smallest_failed or _NO_BUDGET)],
                dtype=torch.int64,
                device=self.args.device,
            )
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
            any_failed, neg_budget, neg_smallest = agreed.tolist()  # one copy to the host, not three
            failed, budget, smallest = bool(any_failed), -neg_budget, -neg_smallest
            state.smallest_failed = None if smallest == _NO_BUDGET else smallest
            if budget != _NO_BUDGET and budget != state.budget:
                state.budget = budget  # another rank backed off: every rank plans with the lowest budget
                state.events.append(
                    {"step": int(self.state.global_step), "micro_batch": None, "stage": "other rank",
                     "slots": None, "budget": budget, "rank": int(self.args.process_index)}
                )  # fmt: skip
            self._synchronise_gradients(model, first, num_items)
        if failed:
            state.num_backoffs += 1
            state.steps_since_failure = 0
        else:
            state.steps_since_failure += 1
            self._maybe_regrow()

    def _synchronise_gradients(self, model: Any, first: Any, num_items: Any) -> None:
        """A two-token pass through the DDP model, its loss times 0: DDP all-reduces (averages) the
        gradients the step's pieces accumulated locally, and broadcasts the buffers."""
        piece = self._prepare_inputs(null_piece(first))
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, piece, num_items_in_batch=num_items)
        self.accelerator.backward(loss * 0.0)

    def _null_pass(self, model: Any, template: Any, num_items: Any, *, final: bool) -> None:
        """An empty micro-batch: a two-token pass with no loss, so this rank runs as many passes (and
        collectives) as the others at this step. Not needed where pieces run locally (deferred sync)."""
        if self._deferred_sync() or self.args.world_size == 1:
            return
        sync = nullcontext() if final else self.accelerator.no_sync(model)
        with sync:
            self._synchronise_gradients(model, template, num_items)

    def _maybe_regrow(self) -> None:
        sb = self.smart_batching
        state, config = sb.backoff_state, sb.backoff
        if (
            config.regrow_steps is None
            or state.budget is None
            or state.steps_since_failure < config.regrow_steps
        ):
            return
        ceiling = (state.smallest_failed or _NO_BUDGET) - 1  # never again a size that failed
        state.budget = min(int(state.budget / config.factor), ceiling)
        state.steps_since_failure = 0
        logger.info("smart batching: oom_backoff budget raised to %s token slots", state.budget)


def backoff_setup(trainer: Any, oom_backoff: Any, pieces: bool) -> tuple[OomBackoff | None, BackoffState]:
    """``oom_backoff=`` resolved and checked against the trainer's topology."""
    config = OomBackoff.coerce(oom_backoff)
    check_backoff_topology(trainer, config, pieces)
    return config, BackoffState(budget=config.max_tokens if config is not None else None)


__all__ = ["AdaptiveMixin", "BackoffExhaustedError", "StepRun", "backoff_setup", "check_backoff_topology"]
