"""TRL's ``DPOTrainer`` on planned batches: preference pairs are the units (the kind's mixin).

::

    trainer = DPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(...), train_dataset=pairs,
                         processing_class=tokenizer)
    apply_smart_batching(trainer, "packed")        # one line: planned, packed, prompt-shared rows
    trainer.train()

What it changes, and why:

* **The plan.** Each pair (prompt, chosen, rejected, as TRL prepared it) is one unit, so its chosen and
  rejected sequences always share a micro-batch. The planner sees the pair's cost in tokens
  (:meth:`~smart_batching.hf.dpo.collate.PairLengths.costs`, after TRL's truncation): two rows as wide as
  its longer sequence for the padded strategies, both sequences for ``packed``, and prompt + chosen +
  rejected (the prompt once) for ``packed`` with prompt sharing. Any strategy plans these lengths
  (:func:`smart_batching.plan_batches`); with several processes the distributed sampler balances each
  step's pair costs across ranks.
* **The rows** (strategy ``packed``): :class:`~smart_batching.hf.dpo.collate.PairCollator` puts the pairs
  of a batch in one padding-free row, each pair as prompt, chosen, rejected under the shared-prefix mask
  (:mod:`smart_batching.attention.prefix_sharing`), or as its two sequences (``prompt_sharing=False``).
  The policy and the reference model are switched to that attention and checked on a probe pair before
  step 1 (:func:`~smart_batching.hf.dpo.model.check_pair_layout`).
* **The log-probabilities.** TRL's loss code is not replaced: :class:`~smart_batching.hf.dpo.model.PairForward`
  hooks the models so that TRL's fused LM head scores only the target tokens, from the packed row (or
  TRL's padded batch), and returns them in TRL's padded layout. Every ``loss_type``, ``ld_alpha``,
  ``use_weighting`` and the logged reward metrics then see values equal to TRL's own padded computation
  (to floating-point summation order); :data:`~smart_batching.hf.dpo.upstream.DPO_OPTIONS` lists each
  ``DPOConfig`` option and what happens to it.
* **The step's loss.** TRL averages the pairs of a micro-batch and the Trainer averages micro-batches;
  planned micro-batches hold different numbers of pairs, so each micro-batch's loss is reweighted by its
  share of the step's pairs (all ranks): the step's loss is the mean over its pairs, as TRL's is when
  its micro-batches are equal. With equal micro-batches the weight is exactly 1.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader

from smart_batching import compat
from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import Accepts, mixed_class, refuse_overlong, split_options
from smart_batching.hf.data import _is_iterable
from smart_batching.hf.dpo.collate import PairCollator, PairLengths, dataset_pair_lengths
from smart_batching.hf.dpo.model import PairForward, check_pair_layout, pair_models
from smart_batching.hf.dpo.upstream import PAIRS, resolve_dpo_upstream
from smart_batching.hf.state import SmartBatchingState
from smart_batching.hf.trainer import SmartBatchingMixin, _empty_policy
from smart_batching.planners import DEFAULT_STRATEGY, make_spec

logger = logging.getLogger("smart_batching.hf")


@dataclass
class DPOSmartBatchingState(SmartBatchingState):
    """:class:`~smart_batching.hf.state.SmartBatchingState` plus what DPO adds.

    Attributes:
        prompt_sharing: packed rows share each pair's prompt (strategy ``packed`` only).
        trl_collator: the trainer's own collator (TRL's ``DataCollatorForPreference``), kept for the
            padded strategies.
        pairs: the pairs' token counts after truncation (set when the sampler is made).
        forwards: the :class:`~smart_batching.hf.dpo.model.PairForward` hooks on the policy and reference.
        step_pairs: pairs in the optimizer step being trained, over all ranks (None: no reweighting).
        step_batches: micro-batches in that step on this rank.
    """

    prompt_sharing: bool = False
    trl_collator: Any = None
    pairs: PairLengths | None = None
    forwards: list[PairForward] = field(default_factory=list)
    step_pairs: int | None = None
    step_batches: int = 0

    @property
    def layout(self) -> str:
        """``"shared"``, ``"unshared"`` or ``"padded"``: how a pair lies in a batch."""
        if not self.spec.packs_rows:
            return "padded"
        return "shared" if self.prompt_sharing else "unshared"


class DPOSmartBatchingMixin(SmartBatchingMixin):
    """:class:`~smart_batching.hf.SmartBatchingMixin` for TRL's ``DPOTrainer``; see the module docstring.

    Use :func:`~smart_batching.hf.apply_smart_batching` on a ``DPOTrainer`` or
    :func:`~smart_batching.hf.with_smart_batching` of its class; options are described on
    :meth:`setup_smart_batching`.
    """

    sb_accepts: ClassVar[Accepts] = PAIRS

    def __init__(
        self,
        *args: Any,
        strategy: Any = DEFAULT_STRATEGY,
        strategy_options: Mapping[str, Any] | None = None,
        seed: int | None = None,
        prompt_sharing: bool = True,
        target_logits_only: bool = True,
        empty_examples: str = "skip",
        **kwargs: Any,
    ) -> None:
        super(SmartBatchingMixin, self).__init__(*args, **kwargs)  # the trainer's own __init__
        self.setup_smart_batching(
            strategy, strategy_options=strategy_options, seed=seed, prompt_sharing=prompt_sharing,
            target_logits_only=target_logits_only, empty_examples=empty_examples,
        )  # fmt: skip

    def setup_smart_batching(  # type: ignore[override]
        self,
        strategy: Any = DEFAULT_STRATEGY,
        *,
        strategy_options: Mapping[str, Any] | None = None,
        seed: int | None = None,
        prompt_sharing: bool = True,
        target_logits_only: bool = True,
        empty_examples: str = "skip",
    ) -> None:
        """Configure smart batching on an initialised ``DPOTrainer``.

        Args:
            strategy: A registered strategy name or a spec; it plans pair costs (tokens).
            strategy_options: The spec's fields (``{"max_tokens": 8192}``, ``{"capacity": 4096}``);
                ``batch_size`` counts pairs.
            seed: Planner seed; None uses ``args.data_seed``, else ``args.seed``.
            prompt_sharing: Strategy ``packed``: one prompt per pair, shared by its chosen and rejected
                completion (False: each pair as its two sequences).
            target_logits_only: With a padded strategy, run TRL's LM head only at target positions (as
                TRL does on CUDA; on CPU TRL scores every position). Packed rows always do.
            empty_examples: ``"skip"`` or ``"error"`` for pairs with no tokens.

        Raises:
            ConfigError: an option of ``DPOConfig`` or of the strategy that cannot be honoured, a
                streamed dataset, or a model whose attention cannot keep a packed row's sequences apart.
        """
        compat.check_trainer_hooks()
        missing = compat.missing_trl_dpo_attributes(self)
        if missing:
            raise ConfigError(
                f"this DPOTrainer has no {', '.join(missing)}, which smart batching reads: install the tested TRL "
                "(docs/getting-started.md, 'Versions')"
            )
        if _is_iterable(self.train_dataset):
            raise ConfigError(
                "a streamed preference dataset (IterableDataset) cannot be planned by pair yet: pass a "
                "map-style datasets.Dataset"
            )
        options, upstream = resolve_dpo_upstream(self, strategy, dict(strategy_options or {}))
        spec = make_spec(strategy, **options)
        args = self.args
        previous = getattr(self, "smart_batching", None)
        if isinstance(previous, DPOSmartBatchingState):
            for forward in previous.forwards:
                forward.remove()
        trl_collator = (
            previous.trl_collator if isinstance(previous, DPOSmartBatchingState) else self.data_collator
        )
        state = DPOSmartBatchingState(
            spec=spec,
            seed=int(
                seed if seed is not None else args.data_seed if args.data_seed is not None else args.seed
            ),
            length_column=None,
            target_logits_only=bool(target_logits_only),
            empty_examples=_empty_policy(empty_examples),
            upstream=upstream,
            prompt_sharing=bool(prompt_sharing) and spec.packs_rows,
            trl_collator=trl_collator,
        )
        self.smart_batching = state
        self.data_collator = trl_collator
        if spec.packs_rows:
            if not compat.is_trl_preference_collator(trl_collator):
                raise ConfigError(
                    f"strategy {spec.name!r} collates pairs itself (PairCollator), but this DPOTrainer has its "
                    f"own data_collator ({type(trl_collator).__name__}): leave data_collator out or use a padded "
                    "strategy"
                )
            self.data_collator = PairCollator(
                pad_token_id=trl_collator.pad_token_id, layout=state.layout, max_length=args.max_length,
                truncation_mode=args.truncation_mode, columns=compat.TRL_DPO_COLUMNS,
            )  # fmt: skip
        self._install_pair_forwards()
        if upstream:
            logger.info("smart batching: from the trainer's arguments: %s", upstream)

    def _install_pair_forwards(self) -> None:
        from smart_batching.attention.prefix_sharing import (
            PREFIX_SHARED_ATTENTION,
            enable_prefix_shared_attention,
        )

        state = self.smart_batching
        packs = state.spec.packs_rows
        models = pair_models(self)
        if not packs and (not state.target_logits_only or compat.is_peft_model(models[0])):
            return  # TRL's own forward, as it is
        lacking = [m for m in models if not compat.trl_fused_lm_head_takes_shift_labels(m)]
        if lacking:
            why = (
                f"{type(lacking[0]).__name__} has no TRL fused LM head that takes shift_labels (TRL >= 1.13)"
            )
            if packs:
                raise ConfigError(f"strategy {state.spec.name!r} needs TRL's fused LM head: {why}")
            from smart_batching.fallbacks import warn_fallback

            warn_fallback(
                "dpo.target_logits",
                f"TRL's LM head scores every position, not only the targets, because {why}; the loss is the "
                "same. Pass target_logits_only=False to choose this path (and silence this warning).",
            )
            return
        if packs:
            for model in models:
                enable_prefix_shared_attention(model)
                check_pair_layout(model, prompt_sharing=state.prompt_sharing)
        state.forwards = [
            PairForward(m, target_logits_only=state.target_logits_only, attention=(PREFIX_SHARED_ATTENTION,))
            for m in models
        ]

    # -- data ---------------------------------------------------------------------------------------

    def pair_lengths(self) -> PairLengths:
        """Token counts of ``train_dataset``'s pairs after TRL's truncation (from Arrow offsets)."""
        return dataset_pair_lengths(
            self.train_dataset, max_length=self.args.max_length, truncation_mode=self.args.truncation_mode,
            columns=compat.TRL_DPO_COLUMNS[:3],
        )  # fmt: skip

    def make_train_sampler(self) -> Any:
        """A fresh sampler over the pairs' costs in this layout (see the module docstring)."""
        state = self.smart_batching
        state.pairs = self.pair_lengths()
        state.lengths = state.pairs.costs(state.layout)
        refuse_overlong(state.lengths, state.spec, self.sb_accepts)  # the planners' advice would cut a pair
        return super().make_train_sampler()

    def get_train_dataloader(self) -> DataLoader:
        loader = super().get_train_dataloader()
        lengths = self.smart_batching.lengths
        width = self.smart_batching.spec.fixed_width(int(lengths.max())) if len(lengths) else None
        if width is not None and compat.is_trl_preference_collator(self.data_collator):
            # One width for every batch (strategy max_length): a pair's padded cost is two rows.
            self.data_collator.pad_to_multiple_of = -(-int(width) // 2)
        return loader

    # -- the step's loss ----------------------------------------------------------------------------

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list, Any]:
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        state = self.smart_batching
        state.step_pairs = None
        counts = [b["completion_mask"].shape[0] // 2 for b in batch_samples if "completion_mask" in b]
        if counts and len(counts) == len(batch_samples) and self.loss_is_scaled_for_ga is False:
            total = torch.tensor(sum(counts), device=device)
            if self.args.world_size > 1:
                total = self.accelerator.gather(total).sum()
            state.step_pairs, state.step_batches = int(total), len(batch_samples)
        return batch_samples, num_items

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """TRL's ``compute_loss``, weighted by this micro-batch's share of the step's pairs (1 when the
        step's micro-batches hold equal numbers of pairs)."""
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        state = self.smart_batching
        if not (state.step_pairs and getattr(model, "training", False) and "completion_mask" in inputs):
            return result
        pairs = inputs["completion_mask"].shape[0] // 2
        weight = pairs * state.step_batches * self.args.world_size / state.step_pairs
        if weight == 1.0:
            return result
        if return_outputs:
            return result[0] * weight, result[1]
        return result * weight


def with_dpo_smart_batching(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (TRL's ``DPOTrainer`` or a subclass) with the DPO overrides."""
    # Pairs take no batch_schedule or oom_backoff, so the adaptive step (AdaptiveMixin.training_step) is
    # left out: the trainer's own training_step runs (TRL's keeps its activation-offloading context).
    return mixed_class(DPOSmartBatchingMixin, trainer_cls, {"training_step": trainer_cls.training_step})


def apply_dpo_smart_batching(trainer: Any, strategy: Any = DEFAULT_STRATEGY, **options: Any) -> Any:
    """:func:`~smart_batching.hf.apply_smart_batching` for a ``DPOTrainer``: options of
    :meth:`DPOSmartBatchingMixin.setup_smart_batching` go there, the rest are the strategy's fields."""
    setup = split_options(DPOSmartBatchingMixin.setup_smart_batching, options)
    trainer.__class__ = with_dpo_smart_batching(type(trainer))
    trainer.setup_smart_batching(strategy, **setup)
    return trainer


__all__ = [
    "DPOSmartBatchingMixin",
    "DPOSmartBatchingState",
    "apply_dpo_smart_batching",
    "with_dpo_smart_batching",
]
