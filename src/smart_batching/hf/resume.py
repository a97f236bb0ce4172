"""Epochs and resume in the Trainer: the sampler cursor saved with each checkpoint, checked against
where Trainer resumes; stream cursors for streamed data; epochs whose batch count differs from the
first; and the process group released before interpreter exit."""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from smart_batching import compat
from smart_batching.errors import ConfigError, DataError

logger = logging.getLogger("smart_batching.hf")

SAMPLER_STATE_NAME = "smart_batching_sampler.json"
"""File name of the sampler cursor inside a Trainer checkpoint folder."""


class ResumeMixin:
    """Trainer overrides for epochs, checkpoints and resume; their state is ``self.smart_batching``
    (:class:`~smart_batching.hf.state.SmartBatchingState`), set by
    :meth:`~smart_batching.hf.SmartBatchingMixin.setup_smart_batching`."""

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.smart_batching.consumed += len(
            batch_samples
        )  # micro-batches trained, for the checkpoint's cursor
        return batch_samples, num_items

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        checkpoint = resume_from_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = compat.last_checkpoint(self.args.output_dir) if checkpoint else None
        self.smart_batching.resume_state = read_sampler_state(checkpoint) if checkpoint else None
        self.smart_batching.resume_checked = self.smart_batching.resume_state is None
        self._resume_backoff(self.smart_batching.resume_state)
        result = super().train(resume_from_checkpoint, *args, **kwargs)
        if self.args.world_size > 1:
            # Only after a run that ended well: tearing a group down while another rank still waits in
            # a collective (a failed run) can hang instead.
            _release_at_exit(self)
        return result

    def _resume_backoff(self, state: Mapping[str, Any] | None) -> None:
        """The back-off budget and counts of the checkpoint, so micro-batches split as they did."""
        sb = self.smart_batching
        if sb.backoff is not None and state is not None and "oom_backoff" in state:
            sb.backoff_state.load_state_dict(state["oom_backoff"])

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # transformers 5.x calls _run_epoch with keywords only.
        if self.smart_batching.stream is not None:
            return self._run_stream_epoch(*args, **kwargs)
        epoch = kwargs["epoch"]
        if self.smart_batching.steps_per_epoch and kwargs.get("resume_from_checkpoint") is not None:
            # Epochs of a batch schedule differ in steps: find the resumed epoch from the global step.
            true_epoch, step = self._schedule_position(self.state.global_step)
            if epoch < true_epoch:
                return None  # trained before the checkpoint
            if epoch == true_epoch:
                kwargs["epochs_trained"] = epoch
                kwargs["steps_trained_in_current_epoch"] = 0 if self.args.ignore_data_skip else step
        resuming = kwargs.get("resume_from_checkpoint") is not None and epoch == kwargs.get("epochs_trained")
        skipped = (
            kwargs.get("steps_trained_in_current_epoch", 0)
            if resuming and not self.args.ignore_data_skip
            else 0
        )
        if not self.smart_batching.resume_checked:
            self._check_resume_position(epoch, skipped)
        self.smart_batching.epoch, self.smart_batching.consumed = epoch, skipped
        if self.smart_batching.sampler is not None and "steps_in_epoch" in kwargs:
            num_batches = self._local_batches(epoch)
            if num_batches != kwargs["steps_in_epoch"]:
                # Trainer sized every epoch on the first; run this one to its real end instead of cutting it.
                log = logger.info if self.smart_batching.steps_per_epoch else logger.warning  # expected then
                log(
                    "epoch %d has %d batches, Trainer expected %d; running all of them",
                    epoch,
                    num_batches,
                    kwargs["steps_in_epoch"],
                )
                ga = self.args.gradient_accumulation_steps
                kwargs["steps_in_epoch"] = num_batches
                kwargs["num_update_steps_per_epoch"] = max(math.ceil(num_batches / ga), 1)
        return super()._run_epoch(*args, **kwargs)

    def _run_stream_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """One pass over a streamed ``train_dataset``.

        A stream has no length, so Trainer counts every pass as ``max_steps`` long and would resume by
        skipping ``global_step × gradient_accumulation_steps`` batches of pass 0, the wrong place once a
        pass has ended. The checkpoint's stream cursor (pass, micro-batches consumed) says where to go on.
        """
        epoch = kwargs["epoch"]
        skipped = 0
        if not self.smart_batching.resume_checked:
            self.smart_batching.resume_checked = True
            state = self.smart_batching.resume_state
            if state is not None and not self.args.ignore_data_skip:
                self._check_stream_state(state)
                if (
                    self.smart_batching.step_stream is not None
                    and state.get("schedule_pass_start") is not None
                ):
                    self.smart_batching.step_stream.resume(int(state["schedule_pass_start"]))
                self.smart_batching.stream_offset = int(state["epoch"]) - epoch
                skipped = kwargs["steps_trained_in_current_epoch"] = int(state["batches_yielded"])
            elif kwargs.get("resume_from_checkpoint") is not None and not self.args.ignore_data_skip:
                logger.warning(
                    "the checkpoint has no stream cursor (%s): Trainer skips %d batches of the first pass",
                    SAMPLER_STATE_NAME,
                    kwargs.get("steps_trained_in_current_epoch", 0),
                )
                skipped = kwargs.get("steps_trained_in_current_epoch", 0)
        self.smart_batching.epoch, self.smart_batching.consumed = (
            epoch + self.smart_batching.stream_offset,
            skipped,
        )
        # A plain DataLoader (or accelerate's skipping copy of it on resume) has no set_epoch.
        self.smart_batching.stream.set_epoch(self.smart_batching.epoch)
        return super()._run_epoch(*args, **kwargs)

    def _stream_state(self) -> dict[str, Any]:
        return {
            "kind": "stream",
            "strategy": self.smart_batching.spec.name,
            "spec": repr(self.smart_batching.spec),
            "seed": self.smart_batching.seed,
            "buffer_size": self.smart_batching.streaming_buffer_size,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "num_processes": self.accelerator.num_processes,
            "epoch": self.smart_batching.epoch,
            "batches_yielded": self.smart_batching.consumed,
            "batch_schedule": None
            if self.smart_batching.batch_schedule is None
            else str(self.smart_batching.batch_schedule),
            # What the schedule had seen when this pass started (the pass is replayed up to the cursor).
            "schedule_pass_start": getattr(self.smart_batching.step_stream, "pass_start", None),
        }

    def _check_stream_state(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "stream":
            raise ConfigError(
                "the checkpoint was trained on a map-style dataset and this run streams its train_dataset; resume "
                "with the original dataset, or set ignore_data_skip=True to restart the data order"
            )
        now = self._stream_state()
        for key in (
            "num_processes",
            "strategy",
            "spec",
            "seed",
            "buffer_size",
            "gradient_accumulation_steps",
            "batch_schedule",
        ):
            if state.get(key) != now[key]:
                raise ConfigError(
                    f"the checkpoint's stream was planned with {key}={state.get(key)!r} and this run has "
                    f"{now[key]!r}: the stream would be batched differently. Resume with the original setting, "
                    "or set ignore_data_skip=True to restart the data order"
                )

    def _schedule_position(self, global_step: int) -> tuple[int, int]:
        """``(epoch, steps into it)`` of a global step under a batch schedule (epochs of their own length)."""
        counts = self.smart_batching.steps_per_epoch
        done = 0
        for e, n in enumerate(counts):
            if global_step < done + n:
                return e, global_step - done
            done += n
        return len(counts), global_step - done

    def _local_batches(self, epoch: int) -> int:
        """Items this process gets in ``epoch``: all of the plan on one process; with several, its share of
        the balanced plan (the same number on every rank, whatever re-forming the balancer did); under a
        batch schedule, the epoch's optimizer steps."""
        sampler = self.smart_batching.sampler
        if hasattr(sampler, "stepped_plan"):
            return sampler.stepped_plan(epoch).num_steps
        if hasattr(sampler, "distributed_plan"):
            return sampler.distributed_plan(epoch).num_steps * sampler.accum_steps
        return len(sampler.plan_for_epoch(epoch))

    def _check_resume_steps(self, state: Mapping[str, Any]) -> None:
        """Refuse to resume a map-style cursor whose optimizer steps were formed with another ``mix_steps``:
        the plan is the same, but its micro-batches fall into other steps, so skipping the trained ones
        would train some examples twice and miss others."""
        if "fingerprint" not in state or self.args.ignore_data_skip:
            return  # a stream's cursor (refused elsewhere), or the data order restarts anyway
        saved, now = bool(state.get("mix_steps", 0)), self.smart_batching.mix_steps
        if saved == now:
            return
        why = (
            " (mix_steps='auto', the default, turns it on for group_by_length with gradient_accumulation_steps "
            ">= 2; a checkpoint saved without it has consecutive batches as steps)"
            if self.smart_batching.mix_steps_auto
            else ""
        )
        raise ConfigError(
            f"the checkpoint's optimizer steps were formed with mix_steps={saved} and this run has "
            f"mix_steps={now}{why}: its steps would hold other micro-batches, and the rest of the epoch other "
            f"examples. Resume with mix_steps={saved}, or set ignore_data_skip=True to restart the data order"
        )

    def _check_resume_position(self, epoch: int, skipped: int) -> None:
        self.smart_batching.resume_checked = True
        state = self.smart_batching.resume_state
        if state is None:
            return
        saved_world = state.get("num_processes", 1)
        if saved_world != self.accelerator.num_processes:
            raise ConfigError(
                f"the checkpoint was trained on {saved_world} processes and this run has "
                f"{self.accelerator.num_processes}: the world size changed, so each process would see other "
                "batches. Resume with the original number of processes, or set ignore_data_skip=True"
            )
        if self.args.ignore_data_skip:
            return
        saved = (int(state["epoch"]), int(state["batches_yielded"]))
        if saved != (epoch, skipped):
            raise ConfigError(
                f"the checkpoint's sampler cursor says training consumed {saved[1]} batches of epoch {saved[0]}, "
                f"but Trainer would resume after {skipped} batches of epoch {epoch}: gradient_accumulation_steps or "
                "the number of batches per epoch changed. Resume with the original settings, or set "
                "ignore_data_skip=True to restart the data order"
            )

    def sampler_state(self) -> dict[str, Any] | None:
        """The cursor of the batches this process consumed (not the ones the DataLoader prefetched).

        ``batches_yielded`` counts this process's batches; ``num_processes`` is saved with it, and the
        out-of-memory back-off's budget and counts (``oom_backoff``) when it is on.
        """
        if self.smart_batching.stream is not None:
            state = self._stream_state()
        elif self.smart_batching.sampler is None:
            return None
        else:
            state = self.smart_batching.sampler.state_dict()
            epoch, consumed = self.smart_batching.epoch, self.smart_batching.consumed
            if consumed >= self._local_batches(epoch):
                epoch, consumed = epoch + 1, 0
            state.update(epoch=epoch, batches_yielded=consumed, num_processes=self.accelerator.num_processes)
        if self.smart_batching.backoff is not None:
            state["oom_backoff"] = self.smart_batching.backoff_state.state_dict()
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        state = self.sampler_state()
        if state is None or not self.args.should_save:
            return
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{compat.checkpoint_prefix()}-{self.state.global_step}"
        )
        if os.path.isdir(folder):
            with open(os.path.join(folder, SAMPLER_STATE_NAME), "w") as f:
                json.dump(state, f, indent=1)


_EXITING_TRAINERS: weakref.WeakSet = weakref.WeakSet()


def _release_at_exit(trainer: Any) -> None:
    """At interpreter exit, drop ``trainer``'s DDP/FSDP wrappers and destroy the process group while
    Python is still alive: a gloo group left to finalisation can abort the process
    (see :func:`smart_batching.distributed.shutdown`)."""
    atexit.unregister(_release_trainers)  # registered once, however many trainers
    atexit.register(_release_trainers)
    _EXITING_TRAINERS.add(trainer)


def _release_trainers() -> None:
    from smart_batching.distributed import shutdown

    try:
        for trainer in list(_EXITING_TRAINERS):
            trainer.accelerator.free_memory()  # its references to the prepared (wrapped) model and optimizer
            trainer.model_wrapped = trainer.model
        _EXITING_TRAINERS.clear()
        shutdown()
    except Exception as e:  # at exit: report, never mask the run's own outcome
        logger.warning("smart batching: could not release the process group at exit: %s", e)


def read_sampler_state(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The sampler cursor saved in a checkpoint folder, or None when it has none."""
    path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(
            f"{path}: the sampler cursor is not valid JSON ({exc}); resume from another checkpoint, or set "
            "ignore_data_skip=True to restart the data order"
        ) from exc
    if not isinstance(state, dict):
        raise DataError(f"{path}: the sampler cursor must be a JSON object, got {type(state).__name__}")
    return state
