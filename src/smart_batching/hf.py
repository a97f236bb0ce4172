"""HF ``Trainer`` and accelerate glue: train with planned batches in one line.

::

    from smart_batching.hf import SmartBatchingTrainer

    trainer = SmartBatchingTrainer(
        model=model, args=args, train_dataset=tokenized,     # a datasets.Dataset with input_ids
        strategy="packed", strategy_options={"capacity": 4096},
    )
    trainer.train()

or, for a trainer that already exists (TRL's ``SFTTrainer``, your own subclass)::

    apply_smart_batching(trainer, "token_budget", max_tokens=16384)

What it changes, and why:

* **The train DataLoader.** A :class:`~smart_batching.sampler.SmartBatchSampler` over the dataset's token
  lengths (read from Arrow list offsets, never row by row) is the ``batch_sampler``; the collator is
  :class:`~smart_batching.collate.PackingCollator` for ``packed`` and
  :class:`~smart_batching.collate.PaddingCollator` otherwise (unless you pass ``data_collator``). The
  DataLoader is built here, not by ``Trainer._get_dataloader``, and then handed to
  ``accelerator.prepare``. With one process accelerate keeps the batch sampler as is; with several it
  deals whole batches round-robin through ``BatchSamplerShard``, which drops nothing because the
  sampler has no ``batch_size`` (with a ``batch_size`` it would skip every round holding a smaller batch).
* **Packed attention.** For ``packed`` the model is switched to
  :func:`~smart_batching.attention.enable_packed_attention` (unless it already runs flash attention),
  and a model that would still let packed examples attend to each other is refused with
  :class:`~smart_batching.errors.ConfigError` before training starts. A guard checks every forward.
* **Loss.** transformers 5 already divides a summed token loss by ``num_items_in_batch`` (target tokens of
  the whole optimizer step) for models whose ``forward`` takes ``**kwargs``. For other models a
  :class:`~smart_batching.loss.TokenLoss` is installed as ``compute_loss_func`` and the token count is
  taken with the same label shift, so variable-size micro-batches are weighed by their tokens.
* **Resume.** Positioning is left to ``Trainer`` (it skips the batches already trained with
  ``skip_first_batches``; the plan is a pure function of ``(lengths, strategy, seed, epoch)``, so the
  remaining batches are the same). Each checkpoint also holds ``smart_batching_sampler.json``, the sampler
  cursor of the batches actually consumed; on resume it is checked against the dataset, strategy and
  seed (a changed one raises ``ConfigError`` naming it) and against where ``Trainer`` is about to
  resume (which disagrees if, e.g., ``gradient_accumulation_steps`` changed). Relying on both for
  positioning would skip the batches twice.

This module imports transformers; ``smart_batching`` itself does not import it.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from smart_batching.errors import ConfigError, require
from smart_batching.loss import TokenLoss, count_target_tokens, kept_token_loss_sum, target_positions
from smart_batching.planners import make_spec
from smart_batching.sampler import SegmentDataset, SmartBatchSampler

require("transformers", "hf")

from transformers import Trainer  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, seed_worker  # noqa: E402

logger = logging.getLogger(__name__)

SAMPLER_STATE_NAME = "smart_batching_sampler.json"
"""File name of the sampler cursor inside a Trainer checkpoint folder."""

# Columns the collators read; everything else (text, messages, ...) is left out of the fetch.
MODEL_INPUT_COLUMNS = ("input_ids", "labels", "completion_mask", "prompt_length", "token_type_ids")


# --------------------------------------------------------------------------------------------------
# Data: lengths, columns, collators, loaders
# --------------------------------------------------------------------------------------------------


def dataset_lengths(
    dataset: Any, *, length_column: str | None = "length", input_column: str = "input_ids"
) -> np.ndarray:
    """Token length of every example, in dataset order: ``(num_examples,)`` int64.

    A ``datasets.Dataset`` is read column-wise by :func:`smart_batching.lengths.lengths_from_dataset`:
    its ``length_column`` when it has one, else the list lengths of ``input_column`` from the Arrow
    offsets (no Python work per row; a ``select``/``shuffle`` index mapping is honoured). Any other
    map-style dataset is read row by row (slow on big data: pass ``lengths=`` instead).

    Raises:
        DataError: the column is missing or holds no token counts.
    """
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets ships with the hf extra
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        from smart_batching.lengths import lengths_from_dataset

        columns = dataset.column_names
        column = length_column if length_column and length_column in columns else input_column
        return lengths_from_dataset(dataset, column)
    n = len(dataset)
    return np.fromiter((len(dataset[i][input_column]) for i in range(n)), dtype=np.int64, count=n)


def model_input_dataset(dataset: Any) -> Any:
    """``dataset`` restricted to the columns the collators read (``datasets.Dataset`` only)."""
    names = getattr(dataset, "column_names", None)
    if names is None or not hasattr(dataset, "select_columns"):
        return dataset
    keep = [c for c in names if c in MODEL_INPUT_COLUMNS]
    return dataset if len(keep) == len(names) else dataset.select_columns(keep)


def default_pad_token_id(processing_class: Any = None, model: Any = None) -> int:
    """The tokenizer's pad token, else its EOS, else the model config's, else 0.

    Padding positions are masked out of attention and loss, so the id only has to be a valid token.
    """
    tok = getattr(processing_class, "tokenizer", processing_class)
    config = getattr(model, "config", None)
    for source in (tok, config):
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(source, attr, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
    return 0


def make_collator(strategy: str, *, pad_token_id: int = 0, **options: Any) -> Callable:
    """The collator a strategy needs: packing for ``packed``, padding (right side) otherwise.

    Args:
        strategy: A strategy name (``spec.name``).
        pad_token_id: Written into padding positions (padded strategies only).
        **options: Passed to the collator (e.g. ``pad_to_multiple_of=8``).
    """
    from smart_batching.collate import PackingCollator, PaddingCollator

    if strategy == "packed":
        return PackingCollator(**options)
    return PaddingCollator(pad_token_id, **options)


def smart_dataloader(
    dataset: Any,
    strategy: Any = "token_budget",
    *,
    lengths: Any = None,
    seed: int = 0,
    collate_fn: Callable | None = None,
    pad_token_id: int = 0,
    loader_cls: type = DataLoader,
    **options: Any,
) -> DataLoader:
    """A DataLoader over planned batches, for plain PyTorch / accelerate loops.

    Args:
        dataset: A map-style dataset of tokenized examples (``input_ids`` and optional ``labels``...).
        strategy: A strategy name or spec.
        lengths: Token lengths; None reads them with :func:`dataset_lengths`.
        seed: Planner seed.
        collate_fn: None picks :func:`make_collator` for the strategy.
        pad_token_id: For the padding collator.
        loader_cls: ``DataLoader`` or ``torchdata.stateful_dataloader.StatefulDataLoader``.
        **options: Strategy options (``max_tokens=``, ``capacity=``...) and DataLoader keywords
            (``num_workers=``, ``pin_memory=``...): names a spec field are planner options.

    Returns:
        The DataLoader; ``loader.batch_sampler`` is the :class:`SmartBatchSampler`.
    """
    spec_fields = _spec_fields(strategy)
    plan_options = {k: v for k, v in options.items() if k in spec_fields}
    loader_options = {k: v for k, v in options.items() if k not in spec_fields}
    if lengths is None:
        lengths = dataset_lengths(dataset)
    sampler = SmartBatchSampler(lengths, strategy, seed=seed, **plan_options)
    data = model_input_dataset(dataset)
    if sampler.yields_segments:
        data = SegmentDataset(data)
    if collate_fn is None:
        collate_fn = make_collator(sampler.strategy, pad_token_id=pad_token_id)
    return loader_cls(data, batch_sampler=sampler, collate_fn=collate_fn, **loader_options)


def _spec_fields(strategy: Any) -> set[str]:
    from dataclasses import fields

    from smart_batching.planners import REGISTRY, PlannerSpec

    if isinstance(strategy, PlannerSpec):
        return set()
    if strategy not in REGISTRY:
        make_spec(strategy)  # raises the unknown-strategy error
    return {f.name for f in fields(REGISTRY[strategy][0])}


# --------------------------------------------------------------------------------------------------
# Packed attention
# --------------------------------------------------------------------------------------------------

_PACKED_AWARE = ("smart_batching_packed", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def _probe_packed_batch() -> dict[str, Any]:
    # Two 2-token examples in one row, as PackingCollator builds it.
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    return {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 0, 1]]),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": 2,
        "max_length_k": 2,
    }


def prepare_packed_model(model: Any, *, packed_attention: bool = True) -> None:
    """Make sure ``model`` keeps packed examples apart, or refuse it.

    Args:
        model: A transformers model.
        packed_attention: Switch the model to :func:`~smart_batching.attention.enable_packed_attention`
            unless it already uses a packing-aware implementation (flash attention). False leaves the
            model as it is and only checks it.

    Raises:
        ConfigError: the model cannot switch, or would attend across packed examples.
    """
    from smart_batching.attention import check_packed_batch, enable_packed_attention

    config = getattr(model, "config", None)
    if config is None:
        raise ConfigError(
            f"strategy 'packed' needs a transformers model (with .config) whose attention can follow "
            f"cu_seq_lens_q; {type(model).__name__} has none. Use a padded strategy (token_budget, group_by_length)"
        )
    impl = str(getattr(config, "_attn_implementation", None) or "eager")
    if packed_attention and not impl.startswith(_PACKED_AWARE):
        enable_packed_attention(model)
    check_packed_batch(model, _probe_packed_batch())


# --------------------------------------------------------------------------------------------------
# Trainer integration
# --------------------------------------------------------------------------------------------------


class SmartBatchingMixin:
    """Overrides that make a ``transformers.Trainer`` (or subclass) train on planned batches.

    Use :class:`SmartBatchingTrainer`, :func:`with_smart_batching` or :func:`apply_smart_batching`; the
    options are described on :meth:`setup_smart_batching`.
    """

    def __init__(
        self,
        *args: Any,
        strategy: Any = "token_budget",
        strategy_options: Mapping[str, Any] | None = None,
        lengths: Any = None,
        length_column: str | None = "length",
        seed: int | None = None,
        packed_attention: bool = True,
        shift_labels: bool | None = None,
        streaming_buffer_size: int = 10_000,
        target_logits_only: bool = True,
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
        )

    def setup_smart_batching(
        self,
        strategy: Any = "token_budget",
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
    ) -> None:
        """Configure smart batching on an initialised trainer.

        Args:
            strategy: A strategy name (``"random"``, ``"group_by_length"``, ``"token_budget"``,
                ``"packed"``, ``"max_length"``) or a spec.
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

        Raises:
            ConfigError: bad strategy options, or (``packed``) a model that would leak attention.
        """
        args = self.args
        options = dict(strategy_options or {})
        if "auto" in (options.get("max_tokens"), options.get("capacity")):
            options = self._resolve_auto_budget(strategy, options, lengths, length_column)
        self.sb_spec = make_spec(strategy, **options)
        self.sb_seed = int(
            seed if seed is not None else args.data_seed if args.data_seed is not None else args.seed
        )
        self.sb_lengths = lengths
        self.sb_streaming_buffer = int(streaming_buffer_size)
        self.sb_target_logits_only = bool(target_logits_only)
        self._sb_target_logits: bool | None = None  # decided on the first training step
        self.sb_length_column = length_column
        self.sb_sampler: SmartBatchSampler | None = None
        self.sb_stream: Any = None  # the StreamingBatchDataset of a streamed train_dataset
        self.sb_even_steps: Any = None  # its lockstep wrapper on several processes
        self._sb_resume_state: dict[str, Any] | None = None
        self._sb_resume_checked = True
        self._sb_epoch = 0
        self._sb_consumed = 0
        self._sb_stream_offset = 0  # stream pass = Trainer epoch + this, after a resume

        if replace_collator:
            pad = default_pad_token_id(getattr(self, "processing_class", None), self.model)
            self.data_collator = make_collator(self.sb_spec.name, pad_token_id=pad)

        if self.sb_spec.name == "packed":
            from smart_batching.attention import install_packed_guard

            prepare_packed_model(self.model, packed_attention=packed_attention)
            if getattr(self, "_sb_guard", None) is None:
                self._sb_guard = install_packed_guard(self.model)

        # Token-normalised loss for models that cannot take num_items_in_batch themselves.
        self._sb_token_loss: TokenLoss | None = None
        if (
            not self.model_accepts_loss_kwargs
            and self.compute_loss_func is None
            and self.label_smoother is None
        ):
            shift = _detect_shift_labels(self) if shift_labels is None else shift_labels
            self._sb_token_loss = TokenLoss(shift_labels=shift)
            self.compute_loss_func = self._sb_token_loss

        if args.train_sampling_strategy not in ("random", None):
            logger.warning(
                "train_sampling_strategy=%r is ignored: smart batching plans the batches (strategy %r)",
                args.train_sampling_strategy,
                self.sb_spec.name,
            )
        if args.dataloader_drop_last:
            logger.warning(
                "dataloader_drop_last is ignored: set drop_last in strategy_options where the strategy has it"
            )

    # -- data ---------------------------------------------------------------------------------------

    def _resolve_auto_budget(
        self, strategy: Any, options: dict[str, Any], lengths: Any, length_column: str | None
    ) -> dict[str, Any]:
        """``max_tokens="auto"`` / ``capacity="auto"``: the largest budget whose costliest batch trains
        within memory (:func:`smart_batching.autotune.find_max_tokens`). ``memory_cap_bytes`` (required on
        CPU) caps the peak; ``tokens_per_step`` keeps the tokens of an optimizer step constant by setting
        ``gradient_accumulation_steps``."""
        from smart_batching.autotune import accumulation_steps_for, find_max_tokens

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
        self.sb_auto_budget = budget
        return options

    def make_train_sampler(self) -> SmartBatchSampler:
        """A fresh sampler over ``train_dataset`` (epoch 0, cursor 0).

        With several processes it is a :class:`~smart_batching.distributed_sampler.DistributedSmartBatchSampler`:
        every rank computes the same balanced plan and iterates its own micro-batches,
        ``gradient_accumulation_steps`` per optimizer step, with equal token counts across ranks.
        """
        lengths = self.sb_lengths
        if lengths is None:
            lengths = dataset_lengths(self.train_dataset, length_column=self.sb_length_column)
        args = self.args
        if args.world_size > 1:
            from smart_batching.distributed import World
            from smart_batching.distributed_sampler import DistributedSmartBatchSampler

            sampler = DistributedSmartBatchSampler(
                lengths,
                self.sb_spec,
                world=World(args.process_index, args.world_size),
                accum_steps=args.gradient_accumulation_steps,
                seed=self.sb_seed,
            )
            if sampler.distributed_plan().num_empty_slots:
                raise ConfigError(
                    f"the dataset has too few examples for {args.world_size} processes × "
                    f"{args.gradient_accumulation_steps} accumulation steps: some micro-batches would be empty. "
                    "Lower gradient_accumulation_steps= or the number of processes."
                )
            return sampler
        return SmartBatchSampler(lengths, self.sb_spec, seed=self.sb_seed)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if _is_iterable(self.train_dataset):
            return self._streaming_dataloader()
        sampler = self.make_train_sampler()
        if self._sb_resume_state is not None:
            sampler.check_state_dict(self._sb_resume_state)
        self.sb_sampler = sampler
        from smart_batching.collate import PaddingCollator

        if self.sb_spec.name == "max_length" and isinstance(self.data_collator, PaddingCollator):
            # "Longest Sequence" padding: every row padded to the planned width, not the batch's longest.
            plan = sampler.plan
            if len(plan):
                self.data_collator.pad_to_multiple_of = int(plan.batch_width[0])

        dataset = model_input_dataset(self.train_dataset)
        if sampler.yields_segments:
            dataset = SegmentDataset(dataset)
        args = self.args
        params: dict[str, Any] = {
            "batch_sampler": sampler,
            "collate_fn": self.data_collator,
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory,
            "persistent_workers": args.dataloader_persistent_workers,
            "worker_init_fn": partial(
                seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
            ),
        }
        if args.dataloader_num_workers > 0:
            params["prefetch_factor"] = args.dataloader_prefetch_factor
            params["multiprocessing_context"] = args.dataloader_multiprocessing_context
            params["in_order"] = getattr(args, "dataloader_in_order", True)
        loader = self.accelerator.prepare(DataLoader(dataset, **params))
        if args.world_size > 1:
            # Our batches are already this rank's share of a balanced plan: make accelerate's
            # BatchSamplerShard a passthrough, as transformers does for its own rank-aware sampler.
            shard = getattr(loader, "batch_sampler", None)
            if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
                shard.num_processes = 1
                shard.process_index = 0
        return loader

    def _streaming_dataloader(self) -> DataLoader:
        """A streamed ``train_dataset`` (HF ``IterableDataset`` or torch ``IterableDataset``): batches are
        planned online over a bounded buffer (:mod:`smart_batching.streaming`); ``streaming_buffer_size``
        examples at a time (default 10,000). Needs ``max_steps`` (the stream has no length).

        On several processes each rank plans its own shard of the stream (``split_dataset_by_node`` for an
        HF stream, every ``world_size``-th example otherwise), and :class:`~smart_batching.even_steps.EvenSteps`
        keeps the ranks in lockstep: a rank whose shard ends first trains null batches (every label -100,
        no loss, no gradient) until the last rank's shard ends, so every example is used once and no
        collective waits forever. The last optimizer step of a pass is filled up with null batches to
        ``gradient_accumulation_steps`` micro-batches (the Trainer cannot shorten it: a stream has no
        length), so no micro-batch's gradient spills into the next pass."""
        from smart_batching.streaming import StreamingBatchDataset

        args = self.args
        if args.max_steps is None or args.max_steps <= 0:
            raise ConfigError("a streamed train_dataset has no length: set TrainingArguments(max_steps=...)")
        dataset = StreamingBatchDataset(
            self.train_dataset,
            self.sb_spec,
            buffer_size=self.sb_streaming_buffer,
            seed=self.sb_seed,
            rank=args.process_index,
            world_size=args.world_size,
            collate_fn=self.data_collator,
        )
        self.sb_sampler = None
        self.sb_stream = dataset
        # Not passed through accelerator.prepare: the dataset shards itself, and accelerate's
        # IterableDataset wrappers would re-shard and re-batch our already collated batches. Trainer
        # moves them to the device in _prepare_inputs.
        loader = DataLoader(dataset, batch_size=None, num_workers=args.dataloader_num_workers)
        from smart_batching.even_steps import EvenSteps

        self.sb_even_steps = EvenSteps(loader, multiple=args.gradient_accumulation_steps)
        return DataLoader(self.sb_even_steps, batch_size=None, num_workers=0)

    # -- loss -----------------------------------------------------------------------------------------

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._sb_consumed += len(batch_samples)
        if self._sb_token_loss is not None and batch_samples and "labels" in batch_samples[0]:
            # Count with the same shift TokenLoss uses (Trainer's own count follows the model's loss_type).
            n = count_target_tokens(
                [b["labels"] for b in batch_samples], shift_labels=self._sb_token_loss.shift_labels
            ).to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                n = self.accelerator.gather(n).sum()
            num_items = n
        return batch_samples, num_items

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """``Trainer.compute_loss``, with the LM head computed only where the loss looks (training only).

        The loss is the same sum of token cross-entropies over ``num_items_in_batch`` that the model
        (or :class:`~smart_batching.loss.TokenLoss`) computes from full logits; see ``target_logits_only``
        in :meth:`setup_smart_batching` for when this path is taken.
        """
        if not (
            num_items_in_batch is not None
            and "labels" in inputs
            and getattr(model, "training", False)
            and self._target_logits_apply(model)
        ):
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        shifted = inputs.pop("shift_labels", None)  # labels already shifted by the collator
        targets, shift = (labels, True) if shifted is None else (shifted, False)
        keep = target_positions(targets, shift_labels=shift)
        outputs = model(**inputs, logits_to_keep=keep)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
        total = kept_token_loss_sum(logits, targets, keep, shift_labels=shift)
        loss = total / torch.as_tensor(num_items_in_batch, device=total.device, dtype=total.dtype)
        if self.args.average_tokens_across_devices:
            # As Trainer.compute_loss: num_items_in_batch counts every rank's tokens, DDP averages gradients.
            loss_scale = self.accelerator.num_processes // self.get_tp_size()
            loss = loss * (loss_scale if self.args.n_gpu <= 1 else self.args.n_gpu)
        return (loss, outputs) if return_outputs else loss

    def _target_logits_apply(self, model: Any) -> bool:
        """Whether the target-only-logits loss is exact for this trainer and model (decided once)."""
        if self._sb_target_logits is None:
            self._sb_target_logits = self._decide_target_logits(model)
            if self._sb_target_logits:
                logger.info("smart batching: the LM head runs only at target positions (target_logits_only)")
        return self._sb_target_logits

    def _decide_target_logits(self, model: Any) -> bool:
        import inspect

        if not self.sb_target_logits_only or self.label_smoother is not None:
            return False
        token_loss = self.compute_loss_func is None and self.model_accepts_loss_kwargs
        ours = self._sb_token_loss is not None and self.compute_loss_func is self._sb_token_loss
        if not (token_loss or ours) or (ours and not self._sb_token_loss.shift_labels):
            return False
        # A subclass's compute_loss (e.g. TRL's SFTTrainer, which reads full logits for its metrics) wins.
        mro = type(self).__mro__
        after = mro[mro.index(SmartBatchingMixin) + 1 :]
        first = next((c for c in after if "compute_loss" in vars(c)), None)
        if first is not Trainer:
            return False
        unwrapped = self.accelerator.unwrap_model(model)
        config = getattr(unwrapped, "config", None)
        if getattr(config, "output_router_logits", False) or not _detect_shift_labels(self):
            return False
        try:
            params = inspect.signature(unwrapped.forward).parameters
        except (TypeError, ValueError):
            return False
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and getattr(pc, "sp_enabled", False):
            return False
        return "logits_to_keep" in params

    # -- epochs and resume ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if self.args.world_size > 1:
            _release_at_exit(self)
        checkpoint = resume_from_checkpoint
        if isinstance(checkpoint, bool):
            checkpoint = get_last_checkpoint(self.args.output_dir) if checkpoint else None
        self._sb_resume_state = read_sampler_state(checkpoint) if checkpoint else None
        self._sb_resume_checked = self._sb_resume_state is None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        # transformers 5.x calls _run_epoch with keywords only.
        if self.sb_stream is not None:
            return self._run_stream_epoch(*args, **kwargs)
        epoch = kwargs["epoch"]
        resuming = kwargs.get("resume_from_checkpoint") is not None and epoch == kwargs.get("epochs_trained")
        skipped = (
            kwargs.get("steps_trained_in_current_epoch", 0)
            if resuming and not self.args.ignore_data_skip
            else 0
        )
        if not self._sb_resume_checked:
            self._check_resume_position(epoch, skipped)
        self._sb_epoch, self._sb_consumed = epoch, skipped
        if self.sb_sampler is not None and "steps_in_epoch" in kwargs:
            num_batches = self._local_batches(epoch)
            if num_batches != kwargs["steps_in_epoch"]:
                # Trainer sized every epoch on the first; run this one to its real end instead of cutting it.
                logger.warning(
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
        if not self._sb_resume_checked:
            self._sb_resume_checked = True
            state = self._sb_resume_state
            if state is not None and not self.args.ignore_data_skip:
                self._check_stream_state(state)
                self._sb_stream_offset = int(state["epoch"]) - epoch
                skipped = kwargs["steps_trained_in_current_epoch"] = int(state["batches_yielded"])
            elif kwargs.get("resume_from_checkpoint") is not None and not self.args.ignore_data_skip:
                logger.warning(
                    "the checkpoint has no stream cursor (%s): Trainer skips %d batches of the first pass",
                    SAMPLER_STATE_NAME,
                    kwargs.get("steps_trained_in_current_epoch", 0),
                )
                skipped = kwargs.get("steps_trained_in_current_epoch", 0)
        self._sb_epoch, self._sb_consumed = epoch + self._sb_stream_offset, skipped
        # A plain DataLoader (or accelerate's skipping copy of it on resume) has no set_epoch.
        self.sb_stream.set_epoch(self._sb_epoch)
        return super()._run_epoch(*args, **kwargs)

    def _stream_state(self) -> dict[str, Any]:
        return {
            "kind": "stream",
            "strategy": self.sb_spec.name,
            "spec": repr(self.sb_spec),
            "seed": self.sb_seed,
            "buffer_size": self.sb_streaming_buffer,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "num_processes": self.accelerator.num_processes,
            "epoch": self._sb_epoch,
            "batches_yielded": self._sb_consumed,
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
        ):
            if state.get(key) != now[key]:
                raise ConfigError(
                    f"the checkpoint's stream was planned with {key}={state.get(key)!r} and this run has "
                    f"{now[key]!r}: the stream would be batched differently. Resume with the original setting, "
                    "or set ignore_data_skip=True to restart the data order"
                )

    def _local_batches(self, epoch: int) -> int:
        """Micro-batches this process gets in ``epoch``: all of the plan on one process; with several, its
        share of the balanced plan (the same number on every rank, whatever re-forming the balancer did)."""
        sampler = self.sb_sampler
        if hasattr(sampler, "distributed_plan"):
            return sampler.distributed_plan(epoch).num_steps * sampler.accum_steps
        return len(sampler.plan_for_epoch(epoch))

    def _check_resume_position(self, epoch: int, skipped: int) -> None:
        self._sb_resume_checked = True
        state = self._sb_resume_state
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

        ``batches_yielded`` counts this process's batches; ``num_processes`` is saved with it.
        """
        if self.sb_stream is not None:
            return self._stream_state()
        if self.sb_sampler is None:
            return None
        state = self.sb_sampler.state_dict()
        epoch, consumed = self._sb_epoch, self._sb_consumed
        if consumed >= self._local_batches(epoch):
            epoch, consumed = epoch + 1, 0
        state.update(epoch=epoch, batches_yielded=consumed, num_processes=self.accelerator.num_processes)
        return state

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        state = self.sampler_state()
        if state is None or not self.args.should_save:
            return
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
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

    for trainer in list(_EXITING_TRAINERS):
        trainer.accelerator.free_memory()  # its references to the prepared (wrapped) model and optimizer
        trainer.model_wrapped = trainer.model
    _EXITING_TRAINERS.clear()
    shutdown()


def _detect_shift_labels(trainer: Any) -> bool:
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model = trainer.accelerator.unwrap_model(trainer.model)
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # Subclasses of a causal LM (a wrapper with a narrower forward) shift like their parent.
    return any(c.__name__ in causal or c.__name__.endswith("ForCausalLM") for c in type(model).__mro__)


def _is_iterable(dataset: Any) -> bool:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return True
    try:
        import datasets

        return isinstance(dataset, datasets.IterableDataset)
    except ImportError:  # pragma: no cover - datasets is in the hf extra
        return False


def read_sampler_state(checkpoint: str | os.PathLike) -> dict[str, Any] | None:
    """The sampler cursor saved in a checkpoint folder, or None when it has none."""
    path = os.path.join(checkpoint, SAMPLER_STATE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


class SmartBatchingTrainer(SmartBatchingMixin, Trainer):
    """``transformers.Trainer`` that trains on planned batches.

    Takes every ``Trainer`` argument plus the keyword-only options of
    :meth:`SmartBatchingMixin.setup_smart_batching`: ``strategy``, ``strategy_options``, ``lengths``,
    ``length_column``, ``seed``, ``packed_attention``, ``shift_labels``. A ``data_collator`` you pass is
    kept (it must honour ``segment_start``/``segment_length`` when the strategy truncates or splits).
    """


_MIXED: dict[type, type] = {}


def with_smart_batching(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (e.g. TRL's ``SFTTrainer``) with the smart-batching overrides."""
    if issubclass(trainer_cls, SmartBatchingMixin):
        return trainer_cls
    if trainer_cls not in _MIXED:
        _MIXED[trainer_cls] = type(
            f"SmartBatching{trainer_cls.__name__}", (SmartBatchingMixin, trainer_cls), {}
        )
    return _MIXED[trainer_cls]


def apply_smart_batching(trainer: Any, strategy: Any = "token_budget", **options: Any) -> Any:
    """Switch an existing trainer to planned batches, in place.

    The trainer's class is swapped for :func:`with_smart_batching` of it, so its own overrides (e.g.
    ``SFTTrainer.compute_loss``) stay in force. Call it before ``trainer.train()``.

    Args:
        trainer: A ``transformers.Trainer`` (or subclass) instance.
        strategy: A strategy name or spec.
        **options: ``strategy_options=``, ``lengths=``, ``seed=``, ... as in
            :meth:`SmartBatchingMixin.setup_smart_batching`, or the strategy's own fields directly
            (``max_tokens=16384``).

    Returns:
        The same trainer.
    """
    setup_keys = {
        "strategy_options",
        "lengths",
        "length_column",
        "seed",
        "packed_attention",
        "shift_labels",
        "replace_collator",
        "streaming_buffer_size",
        "target_logits_only",
    }
    setup = {k: v for k, v in options.items() if k in setup_keys}
    spec_options = {k: v for k, v in options.items() if k not in setup_keys}
    if spec_options:
        setup["strategy_options"] = {**dict(setup.get("strategy_options") or {}), **spec_options}
    trainer.__class__ = with_smart_batching(type(trainer))
    trainer.setup_smart_batching(strategy, **setup)
    return trainer


__all__ = [
    "MODEL_INPUT_COLUMNS",
    "SAMPLER_STATE_NAME",
    "SmartBatchingMixin",
    "SmartBatchingTrainer",
    "apply_smart_batching",
    "dataset_lengths",
    "default_pad_token_id",
    "make_collator",
    "model_input_dataset",
    "prepare_packed_model",
    "read_sampler_state",
    "smart_dataloader",
    "with_smart_batching",
]
