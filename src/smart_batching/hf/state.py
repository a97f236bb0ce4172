"""The one object a smart-batching Trainer keeps: ``trainer.smart_batching``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SmartBatchingState:
    """What :meth:`~smart_batching.hf.SmartBatchingMixin.setup_smart_batching` decided and what training
    has consumed, in one place (the Trainer itself gets no other attribute).

    Attributes:
        spec: the strategy's spec.
        seed: planner seed.
        lengths: token lengths given by the caller (None: read from the dataset).
        length_column: dataset column of precomputed lengths.
        streaming_buffer_size: examples planned at a time when ``train_dataset`` is streamed.
        target_logits_only: the caller's setting; ``target_logits`` is what the first step decided.
        fused_head: whether the LM head runs fused with the loss (:mod:`smart_batching.hf.lm_head`);
            None until the first training step decides.
        precision: what the run computes in: ``dtype`` (the model's), ``autocast`` (the mixed
            precision dtype or None), ``checkpointing``, ``cpu_bf16`` (on CPU:
            :func:`smart_batching.compat.cpu_half_matmul`; ``cpu_bf16_forced`` where
            ``SMART_BATCHING_CPU_HALF`` set it), and once a step ran ``lm_head_matmul``
            (the dtype of the fused LM head's matrix products).
        empty_examples: ``"skip"`` or ``"error"`` for examples with no tokens or no target token.
        trl_metrics: target-only logits stand in for TRL ``SFTTrainer``'s loss, and its metrics are logged.
        upstream: what the trainer's own data settings (TRL ``SFTConfig``, ``TrainingArguments``) came
            to, one line each (:func:`smart_batching.hf.upstream.check_upstream_options`).
        sampler: the batch sampler of a map-style ``train_dataset`` (set by ``get_train_dataloader``).
        stream: the ``StreamingBatchDataset`` of a streamed ``train_dataset``.
        even_steps: its lockstep wrapper on several processes.
        token_loss: the token-normalised loss installed for models that take no loss kwargs.
        guard: the packed-attention guard's hook handle (strategies that pack rows).
        auto_budget: the budget ``max_tokens="auto"`` / ``capacity="auto"`` resolved to.
        epoch, consumed: the epoch in training and the micro-batches this process consumed of it (the
            checkpoint's sampler cursor).
        resume_state: the cursor read from the checkpoint resumed from; ``resume_checked`` once it
            was compared with where Trainer resumes.
        stream_offset: stream pass minus Trainer epoch, after a resume.
        batch_schedule: the :class:`~smart_batching.adaptive.BatchSchedule` of step sizes, or None.
        lr_scaling: ``"sqrt"``, ``"linear"`` or None: the learning rate of a step of another size.
        backoff: the :class:`~smart_batching.adaptive.backoff.OomBackoff` settings, or None (off).
        backoff_state: what the back-off did (:class:`~smart_batching.adaptive.backoff.BackoffState`),
            saved with each checkpoint.
        step: the optimizer step in progress (:class:`~smart_batching.hf.adaptive.StepRun`).
        forward_done: the piece running has finished its forward pass (a failure is in backward).
        steps_per_epoch: with a batch schedule, the optimizer steps of each epoch the run trains.
        step_sizes: with a batch schedule, the schedule's size at each optimizer step of the run.
        step_weights, step_tokens: with a batch schedule, the size each optimizer step of the run
            realises (in the schedule's unit) and its real tokens, all ranks (planned with the sizes).
        step_stream: with a batch schedule on a streamed dataset, the :class:`~smart_batching.adaptive.stream.StepStream`.
        loss_normalization: ``"step"`` or ``"epoch"`` (:mod:`smart_batching.hf.step_weight`).
        epoch_normalization: with ``"epoch"``, its :class:`~smart_batching.hf.step_weight.EpochNormalization`
            callback (``mean_targets``: the plan's target tokens per step; ``factors``: each step's scale).
        mix_steps: each step's micro-batches drawn from as many length strata (one process or several).
        mix_steps_auto: ``mix_steps`` was turned on by ``"auto"`` (not asked for), for the resume refusal.
    """

    spec: Any
    seed: int
    lengths: Any = None
    length_column: str | None = "length"
    streaming_buffer_size: int = 10_000
    target_logits_only: bool = True
    target_logits: bool | None = None
    fused_head: bool | None = None
    precision: dict[str, Any] = field(default_factory=dict)
    empty_examples: str = "skip"
    trl_metrics: bool = False
    upstream: dict[str, str] = field(default_factory=dict)
    sampler: Any = None
    stream: Any = None
    even_steps: Any = None
    token_loss: Any = None
    guard: Any = None
    auto_budget: int | None = None
    epoch: int = 0
    consumed: int = 0
    resume_state: dict[str, Any] | None = None
    resume_checked: bool = True
    stream_offset: int = 0
    batch_schedule: Any = None
    lr_scaling: str | None = None
    backoff: Any = None
    backoff_state: Any = None
    step: Any = None
    forward_done: bool = False
    steps_per_epoch: list[int] | None = None
    step_sizes: Any = None
    step_weights: Any = None
    step_tokens: Any = None
    step_stream: Any = None
    loss_normalization: str = "step"
    epoch_normalization: Any = None
    mix_steps: bool = False
    mix_steps_auto: bool = False
