"""The Trainer integration every trainer kind builds on: :class:`SmartBatchingMixin` and
:class:`SmartBatchingTrainer`; the train DataLoader on planned batches (map-style, streamed, several
processes). Loss and resume overrides live in :mod:`.loss` and :mod:`.resume`; the kinds' adapters
(:mod:`.sft`, :mod:`.dpo`) and the entry points (:mod:`.kinds`) sit above."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from smart_batching import compat
from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import EXAMPLES, Accepts
from smart_batching.hf.adaptive import AdaptiveMixin
from smart_batching.hf.data import (
    _is_iterable,
    checked_lengths,
    dataset_lengths,
    dataset_units,
    default_pad_token_id,
    make_collator,
    model_input_dataset,
    warn_dropped_mask_columns,
)
from smart_batching.hf.loss import TokenLossMixin, _detect_shift_labels
from smart_batching.hf.packed_model import prepare_packed_model
from smart_batching.hf.precision import describe_precision, warn_slow_cpu_precision
from smart_batching.hf.resume import ResumeMixin
from smart_batching.hf.state import SmartBatchingState
from smart_batching.hf.step_weight import StepWeightMixin
from smart_batching.hf.upstream import collator_options, resolve_upstream
from smart_batching.loss import TokenLoss
from smart_batching.planners import DEFAULT_STRATEGY, make_spec
from smart_batching.sampler import SegmentDataset, SmartBatchSampler

logger = logging.getLogger("smart_batching.hf")


class SmartBatchingMixin(ResumeMixin, AdaptiveMixin, StepWeightMixin, TokenLossMixin):
    """Overrides that make a ``transformers.Trainer`` (or subclass) train on planned batches.

    Use :class:`SmartBatchingTrainer`, :func:`with_smart_batching` or :func:`apply_smart_batching`; the
    options are described on :meth:`setup_smart_batching`. Everything it decides and tracks is one
    object, ``trainer.smart_batching`` (:class:`~smart_batching.hf.state.SmartBatchingState`).

    Hooks overridden: the documented ones (``get_train_dataloader``, ``compute_loss``,
    ``get_batch_samples``, ``train``) and two private ones with no public equivalent, ``_run_epoch``
    (the only place that knows an epoch's number and how many batches a resume skips) and
    ``_save_checkpoint`` (the checkpoint folder the sampler cursor is written into exists only there).
    :data:`smart_batching.compat.TRAINER_HOOKS` lists them with the parameters relied on, and
    ``setup_smart_batching`` refuses a transformers whose Trainer moved one.
    """

    sb_accepts: ClassVar[Accepts] = EXAMPLES
    """What this trainer kind accepts, from which its refusals phrase their advice (a kind's mixin sets its own)."""

    @property
    def sb_spec(self) -> Any:
        """The strategy's spec (``trainer.smart_batching.spec``)."""
        return self.smart_batching.spec

    @property
    def sb_sampler(self) -> Any:
        """The batch sampler once ``get_train_dataloader`` ran (``trainer.smart_batching.sampler``)."""
        return self.smart_batching.sampler

    def __init__(
        self,
        *args: Any,
        strategy: Any = DEFAULT_STRATEGY,
        strategy_options: Mapping[str, Any] | None = None,
        lengths: Any = None,
        length_column: str | None = "length",
        seed: int | None = None,
        packed_attention: bool = True,
        shift_labels: bool | None = None,
        streaming_buffer_size: int = 10_000,
        target_logits_only: bool = True,
        empty_examples: str = "skip",
        batch_schedule: Any = None,
        lr_scaling: str | None = None,
        oom_backoff: Any = None,
        loss_normalization: str = "step",
        mix_steps: bool | str = "auto",
        **kwargs: Any,
    ) -> None:
        user_collator = kwargs.get("data_collator") is not None
        super().__init__(*args, **kwargs)
        self.setup_smart_batching(
            strategy,
            strategy_options=strategy_options,
            lengths=lengths,
            length_column=length_column,
            seed=seed,
            packed_attention=packed_attention,
            shift_labels=shift_labels,
            replace_collator=not user_collator,
            streaming_buffer_size=streaming_buffer_size,
            target_logits_only=target_logits_only,
            empty_examples=empty_examples,
            batch_schedule=batch_schedule,
            lr_scaling=lr_scaling,
            oom_backoff=oom_backoff,
            loss_normalization=loss_normalization,
            mix_steps=mix_steps,
        )

    def setup_smart_batching(
        self,
        strategy: Any = DEFAULT_STRATEGY,
        *,
        strategy_options: Mapping[str, Any] | None = None,
        lengths: Any = None,
        length_column: str | None = "length",
        seed: int | None = None,
        packed_attention: bool = True,
        shift_labels: bool | None = None,
        replace_collator: bool = True,
        streaming_buffer_size: int = 10_000,
        target_logits_only: bool = True,
        empty_examples: str = "skip",
        batch_schedule: Any = None,
        lr_scaling: str | None = None,
        oom_backoff: Any = None,
        loss_normalization: str = "step",
        mix_steps: bool | str = "auto",
    ) -> None:
        """Configure smart batching on an initialised trainer.

        Args:
            strategy: A registered strategy name (:func:`~smart_batching.planners.strategy_names`) or a
                spec.
            strategy_options: The spec's fields, e.g. ``{"max_tokens": 16384}`` or ``{"capacity": 4096}``.
                Batch sizes come from here; ``per_device_train_batch_size`` is not used for training.
            lengths: Token lengths of ``train_dataset``; None reads the ``length_column`` or the
                ``input_ids`` list lengths.
            length_column: Column holding precomputed lengths (None: always use ``input_ids``).
            seed: Planner seed; None uses ``args.data_seed``, else ``args.seed``.
            packed_attention: For ``packed``: switch the model to packed attention (see
                :func:`prepare_packed_model`); False only checks that the model is safe.
            shift_labels: Causal-LM label shift for the token count of :class:`~smart_batching.loss.TokenLoss`
                (used only for models whose forward takes no loss kwargs); None detects it.
            replace_collator: Install the strategy's collator as ``data_collator``.
            streaming_buffer_size: Examples planned at a time when ``train_dataset`` is streamed (an
                HF or torch ``IterableDataset``); see :mod:`smart_batching.streaming`.
            target_logits_only: In training, have a causal LM compute its LM head only at the positions
                whose logits are scored (``logits_to_keep=``; prompt, padding and example-boundary
                positions are skipped) and take the token loss there: the same loss and gradients,
                less work where the vocabulary is large. Used only where it is exact: a model whose
                ``forward`` takes ``logits_to_keep``, the token-normalised loss (no label smoother, no
                ``compute_loss_func`` of yours, no ``compute_loss`` override in a subclass such as
                TRL's ``SFTTrainer``), no router auxiliary loss.
            empty_examples: Examples with no tokens or no target token (every label ``-100``; found from
                the lengths and the label columns before step 1, see :func:`~smart_batching.hf.data.dataset_units`):
                ``"skip"`` leaves them out of the plan and names the first rows in one warning (HF and
                TRL train around them too), ``"error"`` refuses them with
                :class:`~smart_batching.errors.DataError`. Streamed datasets skip them as they come.
            batch_schedule: Tokens (token-budget strategies) or examples (fixed-size strategies) per
                optimizer step, as a function of what was seen: ``"linear:16384->131072@20%"``,
                ``"0:16k 5M:64k 20M:128k"`` or a :class:`~smart_batching.adaptive.BatchSchedule`. The
                strategy's budget (``max_tokens``, ``capacity``, ``batch_size``) bounds each micro-batch;
                a step runs as many micro-batches as its size needs. None: fixed steps of
                ``gradient_accumulation_steps`` micro-batches.
            lr_scaling: With ``batch_schedule``: ``"sqrt"`` (Adam) or ``"linear"`` (SGD) scales the
                learning rate of each step by its size over the first size (:mod:`smart_batching.adaptive.lr`);
                None keeps the scheduler's rate.
            oom_backoff: Split a micro-batch that runs out of memory into smaller ones within the same
                optimizer step and keep the lower budget (:mod:`smart_batching.adaptive.backoff`): True,
                a dict of :class:`~smart_batching.adaptive.backoff.OomBackoff` options, or False. None:
                off, unless the ``SMART_BATCHING_FAIL_*`` variables inject a fault.
            loss_normalization: ``"step"`` (HF's: each step's loss is the mean over its own target
                tokens, ``num_items_in_batch``) or ``"epoch"``: every target token weighs alike in the
                update also when gradient clipping binds; a step's clipped gradient is multiplied by its
                target tokens over the plan's mean per step, the same update as a loss over that mean
                clipped at ``max_grad_norm`` times the same ratio (:mod:`smart_batching.hf.step_weight`).
                Refused with a streamed dataset, a ``batch_schedule`` and DeepSpeed.
            mix_steps: With ``gradient_accumulation_steps`` > 1, each optimizer step's micro-batch rounds
                come from as many length (cost) strata of the plan's micro-batches, instead of the
                consecutive batches of a shuffled plan (one process) or similar micro-batches (several):
                a step of ``group_by_length`` then holds short and long examples and its target
                tokens vary less between steps, while every micro-batch, and so the padding, is the
                plan's (:func:`~smart_batching.distributed.distribute`). ``"auto"`` (the default) turns
                it on for ``group_by_length`` where it applies (``gradient_accumulation_steps`` >= 2, a
                map-style dataset, no ``batch_schedule``; logged once), the one strategy whose held-out
                loss it was measured to bring level with ``random`` (benchmarks/RESULTS.md, "mix_steps
                at ten seeds"), and off otherwise. True asks for it with any strategy and is refused with
                one micro-batch per step, a streamed dataset and a ``batch_schedule``; False: off. A
                checkpoint resumes only with the setting it was saved with (the refusal names it).

        Raises:
            ConfigError: bad strategy options, or (a strategy that packs rows) a model that would leak
                attention.
        """
        compat.check_trainer_hooks()
        args = self.args
        if length_column == "length" and getattr(args, "length_column_name", "length") != "length":
            length_column = args.length_column_name  # TrainingArguments(length_column_name=...)
        options, upstream = resolve_upstream(
            self, strategy, dict(strategy_options or {}), own_collator=replace_collator
        )
        budget = None
        if "auto" in (options.get("max_tokens"), options.get("capacity")):
            options, budget = self._resolve_auto_budget(strategy, options, lengths, length_column)
        previous = getattr(self, "smart_batching", None)
        self.smart_batching = SmartBatchingState(
            spec=make_spec(strategy, **options),
            seed=int(
                seed if seed is not None else args.data_seed if args.data_seed is not None else args.seed
            ),
            lengths=lengths,
            length_column=length_column,
            streaming_buffer_size=int(streaming_buffer_size),
            target_logits_only=bool(target_logits_only),
            empty_examples=_empty_policy(empty_examples),
            upstream=upstream,
            auto_budget=budget,
            guard=previous.guard if previous is not None else None,  # one guard, however often set up
        )
        self._setup_adaptive(batch_schedule, lr_scaling, oom_backoff)
        self._setup_step_weight(loss_normalization)
        self.smart_batching.mix_steps = self._check_mix_steps(mix_steps)

        self.smart_batching.precision = describe_precision(self)
        warn_slow_cpu_precision(self, self.smart_batching.precision)

        if replace_collator:
            pad = default_pad_token_id(getattr(self, "processing_class", None), self.model)
            self.data_collator = make_collator(
                self.smart_batching.spec, pad_token_id=pad, **collator_options(self, self.smart_batching.spec)
            )

        if self.smart_batching.spec.packs_rows:
            from smart_batching.attention import install_packed_guard

            prepare_packed_model(self.model, packed_attention=packed_attention)
            if self.smart_batching.guard is None:
                self.smart_batching.guard = install_packed_guard(self.model)

        # Token-normalised loss for models that cannot take num_items_in_batch themselves.
        if (
            not self.model_accepts_loss_kwargs
            and self.compute_loss_func is None
            and self.label_smoother is None
        ):
            shift = _detect_shift_labels(self) if shift_labels is None else shift_labels
            self.smart_batching.token_loss = TokenLoss(shift_labels=shift)
            self.compute_loss_func = self.smart_batching.token_loss

        if upstream:
            logger.info("smart batching: from the trainer's arguments: %s", upstream)

    # -- data ---------------------------------------------------------------------------------------

    def _check_mix_steps(self, mix_steps: Any) -> bool:
        """``mix_steps`` as a bool: ``"auto"`` resolved (the spec's ``mixes_steps_by_default``), True refused
        where a step has nothing to mix or no whole plan (:meth:`_why_no_mix`)."""
        if isinstance(mix_steps, str) and mix_steps == "auto":
            return self._auto_mix_steps()
        if not isinstance(mix_steps, bool):
            raise ConfigError(f"mix_steps= takes 'auto', True or False, got {mix_steps!r}")
        why = self._why_no_mix() if mix_steps else None
        if why is not None:
            raise ConfigError(why)
        return mix_steps

    def _why_no_mix(self) -> str | None:
        """Why this run's steps cannot be mixed (the refusal of ``mix_steps=True``), or None."""
        if self.args.gradient_accumulation_steps < 2:
            return (
                "mix_steps=True draws each optimizer step's micro-batches from different length strata, "
                "and a step of gradient_accumulation_steps=1 has one: set "
                "TrainingArguments(gradient_accumulation_steps=k) with k >= 2 (the batch size a micro-batch)"
            )
        if self.train_dataset is not None and _is_iterable(self.train_dataset):
            return (
                "mix_steps=True needs the whole plan of an epoch, and a streamed train_dataset has none: "
                "pass a map-style dataset or drop mix_steps"
            )
        if self.smart_batching.batch_schedule is not None:
            return "mix_steps=True and batch_schedule= together: a schedule forms its own steps; drop one"
        return None

    def _auto_mix_steps(self) -> bool:
        """``mix_steps="auto"``: on where the strategy asks for it
        (:meth:`~smart_batching.planners.PlannerSpec.mixes_steps_by_default`) and ``True`` would be taken
        (a step has micro-batches to mix, the epoch a whole plan); said once in the log when it turns on."""
        spec = self.smart_batching.spec
        on = spec.mixes_steps_by_default() and self._why_no_mix() is None
        self.smart_batching.mix_steps_auto = on
        if on:
            logger.info(
                "smart batching: mix_steps='auto' is on: each optimizer step takes one micro-batch of each of "
                "%d length strata of %s's plan (the same micro-batches, steps of more even tokens); "
                "mix_steps=False keeps consecutive batches",
                self.args.gradient_accumulation_steps,
                spec.name,
            )
        return on

    def _resolve_auto_budget(
        self, strategy: Any, options: dict[str, Any], lengths: Any, length_column: str | None
    ) -> tuple[dict[str, Any], int]:
        """``max_tokens="auto"`` / ``capacity="auto"``: the largest budget whose costliest batch trains
        within memory (:func:`smart_batching.adaptive.autotune.find_max_tokens`). ``memory_cap_bytes`` (required on
        CPU) caps the peak; ``tokens_per_step`` keeps the tokens of an optimizer step constant by setting
        ``gradient_accumulation_steps``."""
        from smart_batching.adaptive.autotune import accumulation_steps_for, find_max_tokens

        key = "max_tokens" if options.get("max_tokens") == "auto" else "capacity"
        cap = options.pop("memory_cap_bytes", None)
        per_step = options.pop("tokens_per_step", None)
        candidates = options.pop("auto_candidates", None)
        if lengths is None:
            lengths = dataset_lengths(self.train_dataset, length_column=length_column)
        args = self.args
        dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        extra = {"candidates": candidates} if candidates else {}
        plan_options = {k: v for k, v in options.items() if k != key}
        budget = find_max_tokens(
            self.model, lengths, getattr(strategy, "name", strategy), memory_cap_bytes=cap,
            autocast_dtype=dtype, **extra, **plan_options,
        )  # fmt: skip
        options[key] = budget
        if per_step:
            args.gradient_accumulation_steps = accumulation_steps_for(int(per_step), budget)
        logger.info("smart batching: %s=auto resolved to %d tokens", key, budget)
        return options, budget

    def make_train_sampler(self) -> SmartBatchSampler:
        """A fresh sampler over ``train_dataset`` (epoch 0, cursor 0).

        With several processes it is a :class:`~smart_batching.distributed.sampler.DistributedSmartBatchSampler`:
        every rank computes the same balanced plan and iterates its own micro-batches,
        ``gradient_accumulation_steps`` per optimizer step, with equal token counts across ranks.
        """
        lengths = checked_lengths(
            self.train_dataset, self.smart_batching.lengths, self.smart_batching.length_column
        )
        units = dataset_units(self.train_dataset, lengths, empty_examples=self.smart_batching.empty_examples)
        args = self.args
        if self.smart_batching.batch_schedule is not None:
            return self._step_sampler(lengths, units)
        if args.world_size > 1 or self.smart_batching.mix_steps:
            from smart_batching.distributed import World
            from smart_batching.distributed.sampler import DistributedSmartBatchSampler

            sampler = DistributedSmartBatchSampler(
                lengths,
                self.smart_batching.spec,
                world=World(args.process_index, args.world_size),
                accum_steps=args.gradient_accumulation_steps,
                mix_steps=self.smart_batching.mix_steps,
                seed=self.smart_batching.seed,
                units=units,
            )
            if not sampler.distributed_plan().num_empty_slots:
                return sampler
            if args.world_size > 1 or not self.smart_batching.mix_steps_auto:
                raise ConfigError(
                    f"the dataset has too few examples for {args.world_size} processes × "
                    f"{args.gradient_accumulation_steps} accumulation steps: some micro-batches would be empty. "
                    "Lower gradient_accumulation_steps= or the number of processes"
                    + (" (or pass mix_steps=False on one process)." if args.world_size == 1 else ".")
                )
            # Too few examples to fill every step's strata: one process trains its batches as they come.
            logger.info(
                "smart batching: mix_steps='auto' is off: %d examples are too few for steps of %d "
                "micro-batches, none of them empty",
                sampler.num_examples,
                args.gradient_accumulation_steps,
            )
            self.smart_batching.mix_steps = self.smart_batching.mix_steps_auto = False
        return SmartBatchSampler(
            lengths, self.smart_batching.spec, seed=self.smart_batching.seed, units=units
        )

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if _is_iterable(self.train_dataset):
            return self._streaming_dataloader()
        sampler = self.make_train_sampler()
        self._plan_step_weight(sampler)
        if self.smart_batching.resume_state is not None:
            self._check_resume_steps(self.smart_batching.resume_state)
            sampler.check_state_dict(self.smart_batching.resume_state)
        self.smart_batching.sampler = sampler
        from smart_batching.collate import PaddingCollator

        if isinstance(self.data_collator, PaddingCollator):
            plan = sampler.plan  # the current epoch's, cached for the loader
            if len(plan) and self.smart_batching.spec.fixed_width(int(plan.lengths.max())) is not None:
                # One width for every row (max_length): the planned width, not the batch's longest.
                self.data_collator.pad_to_multiple_of = int(plan.batch_width[0])

        from smart_batching.collate import PackingCollator

        if isinstance(self.data_collator, (PaddingCollator, PackingCollator)):
            dataset = model_input_dataset(self.train_dataset)  # only the columns our collators read
        else:  # the caller's collator: the columns HF would give it
            dataset = compat.remove_unused_columns(self, self.train_dataset)
            warn_dropped_mask_columns(self.train_dataset, dataset)
        if sampler.yields_segments:
            dataset = SegmentDataset(dataset)
        collate = self.data_collator
        if self.smart_batching.batch_schedule is not None:  # one item per optimizer step
            from smart_batching.adaptive.steps import StepCollator, StepDataset

            dataset, collate = StepDataset(dataset), StepCollator(collate)
        args = self.args
        params: dict[str, Any] = {
            "batch_sampler": sampler,
            "collate_fn": collate,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "worker_init_fn": partial(
                compat.seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            ),
        }
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
            params["multiprocessing_context"] = args.dataloader_multiprocessing_context
            params["in_order"] = getattr(args, "dataloader_in_order", True)
        loader = self.accelerator.prepare(DataLoader(dataset, **params))
        if args.world_size > 1:
            # Our batches are already this rank's share of a balanced plan.
            compat.make_shard_passthrough(loader, sampler)
        return loader

    def _streaming_dataloader(self) -> DataLoader:
        """A streamed ``train_dataset`` (HF ``IterableDataset`` or torch ``IterableDataset``): batches are
        planned online over a bounded buffer (:mod:`smart_batching.streaming`); ``streaming_buffer_size``
        examples at a time (default 10,000). Needs ``max_steps`` (the stream has no length).

        On several processes each rank plans its own shard of the stream (``split_dataset_by_node`` for an
        HF stream, every ``world_size``-th example otherwise), and :class:`~smart_batching.distributed.even_steps.EvenSteps`
        keeps the ranks in lockstep: a rank whose shard ends first trains null batches (every label -100,
        no loss, no gradient) until the last rank's shard ends, so every example is used once and no
        collective waits forever. The last optimizer step of a pass is filled up with null batches to
        ``gradient_accumulation_steps`` micro-batches (the Trainer cannot shorten it: a stream has no
        length), so no micro-batch's gradient spills into the next pass."""
        from smart_batching.streaming import StreamingBatchDataset

        args = self.args
        if args.max_steps is None or args.max_steps <= 0:
            raise ConfigError("a streamed train_dataset has no length: set TrainingArguments(max_steps=...)")
        schedule = self.smart_batching.batch_schedule
        dataset = StreamingBatchDataset(
            self.train_dataset,
            self.smart_batching.spec,
            buffer_size=self.smart_batching.streaming_buffer_size,
            seed=self.smart_batching.seed,
            rank=args.process_index,
            world_size=args.world_size,
            collate_fn=self.data_collator if schedule is None else None,  # steps collate their micro-batches
            empty_examples=self.smart_batching.empty_examples,
        )
        self.smart_batching.sampler = None
        self.smart_batching.stream = dataset
        # Not passed through accelerator.prepare: the dataset shards itself, and accelerate's
        # IterableDataset wrappers would re-shard and re-batch our already collated batches. Trainer
        # moves them to the device in _prepare_inputs.
        loader = DataLoader(dataset, batch_size=None, num_workers=args.dataloader_num_workers)
        from smart_batching.distributed.even_steps import EvenSteps, null_batch

        make_null = null_batch
        if schedule is not None:  # one item per optimizer step (smart_batching.adaptive.stream)
            from smart_batching.adaptive.stream import StepStream, null_micro_batches

            loader = StepStream(loader, schedule, self.data_collator, world_size=args.world_size)
            self.smart_batching.step_stream = loader
            make_null = null_micro_batches
        self.smart_batching.even_steps = EvenSteps(
            loader, multiple=args.gradient_accumulation_steps, make_null=make_null
        )
        return DataLoader(self.smart_batching.even_steps, batch_size=None, num_workers=0)


def _empty_policy(value: str) -> str:
    from smart_batching.units import EMPTY_POLICIES

    if value not in EMPTY_POLICIES:
        raise ConfigError(f"empty_examples={value!r} must be one of {', '.join(EMPTY_POLICIES)}")
    return value


class SmartBatchingTrainer(SmartBatchingMixin, Trainer):
    """``transformers.Trainer`` that trains on planned batches.

    Takes every ``Trainer`` argument plus the keyword-only options of
    :meth:`SmartBatchingMixin.setup_smart_batching`: ``strategy``, ``strategy_options``, ``lengths``,
    ``length_column``, ``seed``, ``packed_attention``, ``shift_labels``. A ``data_collator`` you pass is
    kept (it must honour ``segment_start``/``segment_length`` when the strategy truncates or splits).
    """
