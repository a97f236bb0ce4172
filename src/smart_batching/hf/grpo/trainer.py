"""TRL's ``GRPOTrainer`` (or ``RLOOTrainer``) with its training pass planned by tokens (the kind's mixin).

::

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=prompts)
    apply_smart_batching(trainer, "packed")        # each prompt once per group of completions
    trainer.train()

Generation, rewards, advantages, TRL's buffering and split of the generation batch, the loss of every
``loss_type`` and the metrics stay TRL's. What changes is how the per-token log-probabilities (and
entropies) of the completions are computed, for the policy, the old policy and the reference model alike:
:meth:`GRPOSmartBatchingMixin._get_per_token_logps_and_entropies` replaces TRL's padded forward and
returns tensors of TRL's own shape, ``(completions, logits_to_keep)``, equal to its padded computation
up to floating-point summation order.

* ``packed``: the completions of a call (TRL's chunk of ``batch_size`` completions, or the micro-batch
  in the training pass) are read back from TRL's padded batch, grouped by prompt, and laid out in
  padding-free rows with each prompt once per group (:mod:`smart_batching.hf.grpo.rows`); the groups are
  the units the ``packed`` planner fills rows of ``capacity`` tokens with (a group longer than that is cut
  into several, the prompt in each). ``prompt_sharing=False`` makes every completion its own unit.
* ``token_budget``: the completions of a call are the units, costed by prompt + completion tokens; each
  planned micro-batch runs TRL's own padded forward, at its own width.

On several ranks (``balance_ranks``, on by default where it keeps the optimizer step), the completions of
each optimizer step are dealt again between the ranks and micro-batches by tokens, each micro-batch keeping
TRL's count (:mod:`smart_batching.hf.grpo.ranks`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from smart_batching import compat
from smart_batching.attention.prefix_sharing import PREFIX_SHARED_ATTENTION, enable_prefix_shared_attention
from smart_batching.errors import ConfigError
from smart_batching.fallbacks import warn_fallback
from smart_batching.hf.adapter import Accepts, mixed_class, refuse_overlong, split_options
from smart_batching.hf.grpo.ranks import balance_window, partition_dependence
from smart_batching.hf.grpo.rows import Completions, chunk_rows
from smart_batching.hf.grpo.upstream import COMPLETIONS, resolve_grpo_upstream
from smart_batching.planners import FASTEST_STRATEGY, make_spec, plan_batches

logger = logging.getLogger("smart_batching.hf")

_MULTIMODAL = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


@dataclass
class GRPOSmartBatchingState:
    """``trainer.smart_batching`` on a ``GRPOTrainer``.

    Attributes:
        spec: the strategy's spec (``packed``: ``capacity`` tokens per row; ``token_budget``:
            ``max_tokens`` per padded forward).
        seed: planner seed.
        prompt_sharing: ``packed`` rows hold each prompt once per group of completions.
        num_forwards: forward calls run so far (rows or padded micro-batches).
        num_tokens: token slots they held (real tokens for ``packed``, rows x width for ``token_budget``).
        num_trl_tokens: token slots TRL's padded chunks of the same calls would have held.
        balance_ranks: each optimizer step's completions are dealt again between the ranks by tokens.
        balance_off: why they are not, where there are several ranks (None: they are, or one rank).
        balanced_steps: optimizer steps dealt again so far.
        rank_tokens_before: per balanced step, each rank's tokens (prompt + completion) as TRL dealt them,
            summed over the steps, ``(world,)``; ``rank_tokens_after``: the same after dealing.
        heaviest_before / heaviest_after: the heaviest rank's tokens, summed over the balanced steps.
    """

    spec: Any
    seed: int
    prompt_sharing: bool
    num_forwards: int = 0
    num_tokens: int = 0
    num_trl_tokens: int = 0
    balance_ranks: bool = False
    balance_off: str | None = None
    balanced_steps: int = 0
    heaviest_before: int = 0
    heaviest_after: int = 0
    rank_tokens_before: list[int] | None = None
    rank_tokens_after: list[int] | None = None

    @property
    def step_imbalance_before(self) -> float:
        """The heaviest rank's tokens over the mean rank's, over the balanced steps, as TRL dealt them
        (1.0: even; nan: no step balanced yet)."""
        return _imbalance(self.heaviest_before, self.rank_tokens_before)

    @property
    def step_imbalance_after(self) -> float:
        """:attr:`step_imbalance_before` after dealing."""
        return _imbalance(self.heaviest_after, self.rank_tokens_after)


def _imbalance(heaviest: int, per_rank: list[int] | None) -> float:
    if not per_rank or not sum(per_rank):
        return float("nan")
    return heaviest / (sum(per_rank) / len(per_rank))


class GRPOSmartBatchingMixin:
    """Mixed into TRL's ``GRPOTrainer`` (or a subclass) by :func:`~smart_batching.hf.apply_smart_batching`;
    see the module docstring."""

    sb_accepts: ClassVar[Accepts] = COMPLETIONS
    smart_batching: GRPOSmartBatchingState

    def setup_smart_batching(
        self,
        strategy: Any = FASTEST_STRATEGY,
        *,
        strategy_options: Mapping[str, Any] | None = None,
        seed: int | None = None,
        prompt_sharing: bool = True,
        balance_ranks: bool | str = "auto",
    ) -> None:
        """Configure smart batching on an initialised ``GRPOTrainer``.

        Args:
            strategy: ``"packed"`` or ``"token_budget"`` (a name or a spec).
            strategy_options: The spec's fields (``{"capacity": 4096}``, ``{"max_tokens": 8192}``).
            seed: Planner seed; None uses ``args.seed``.
            prompt_sharing: ``packed``: one prompt per group of completions (False: each completion with
                its own copy of the prompt).
            balance_ranks: On several ranks, deal each optimizer step's completions again between the
                ranks by tokens (each micro-batch keeps TRL's count). ``"auto"``: where the gradient stays
                TRL's (:func:`~smart_batching.hf.grpo.ranks.partition_dependence`), otherwise warn once
                and keep TRL's deal; True: refuse the settings where it would not; False: TRL's deal.

        Raises:
            ConfigError: an option that cannot be honoured (named), or a model whose attention cannot keep
                a packed row's completions apart.
        """
        missing = compat.missing_trl_grpo_attributes(self)
        if missing:
            raise ConfigError(
                f"this {type(self).__name__} has no {', '.join(missing)}, which smart batching reads: install the tested "
                "TRL (docs/getting-started.md, 'Versions')"
            )
        options = resolve_grpo_upstream(self, strategy, dict(strategy_options or {}))
        spec = make_spec(strategy, **options)
        self.smart_batching = GRPOSmartBatchingState(
            spec=spec,
            seed=int(seed if seed is not None else self.args.seed),
            prompt_sharing=bool(prompt_sharing) and spec.packs_rows,
        )
        self._sb_setup_balance(balance_ranks)
        if spec.packs_rows:
            for model in self._sb_models():
                use_cache = model.config.use_cache  # generation keeps its KV cache
                enable_prefix_shared_attention(model)
                model.config.use_cache = use_cache
                self._sb_check_layout(model)

    def _sb_setup_balance(self, balance_ranks: bool | str) -> None:
        if balance_ranks not in ("auto", True, False):
            raise ConfigError(f"balance_ranks={balance_ranks!r}: give 'auto', True or False")
        if balance_ranks is False:
            return
        why = partition_dependence(self)
        if why is not None and balance_ranks is True:
            raise ConfigError(
                f"balance_ranks=True would change the gradient: {why}. Set balance_ranks=False (or 'auto')"
            )
        if self.accelerator.num_processes < 2:
            return  # one rank: nothing to balance
        state = self.smart_batching
        if why is None:
            state.balance_ranks = True
            return
        state.balance_off = why
        warn_fallback(
            "grpo.balance_ranks",
            f"the ranks keep TRL's deal of completions, uneven in tokens, because {why}; change that "
            "setting to have them balanced, or pass balance_ranks=False to ask for TRL's deal",
        )

    # -- every rank an equal share --------------------------------------------------------------------

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's ``_prepare_inputs``; after each new generation batch, every optimizer step's
        micro-batches are dealt again between the ranks (``balance_ranks``)."""
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)  # type: ignore[misc]
        if self.smart_batching.balance_ranks and self.model.training and self._buffered_inputs is not before:
            self._buffered_inputs = self._sb_balance(self._buffered_inputs)
            inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
        return inputs

    def _sb_balance(self, buffered: list[dict[str, Any]]) -> list[dict[str, Any]]:
        state = self.smart_batching
        accum = int(self.args.gradient_accumulation_steps)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        pad = getattr(self.processing_class, "pad_token_id", None)
        pad = int(pad if pad is not None else 0)
        out: list[dict[str, Any]] = []
        for start in range(0, len(buffered), accum):
            dealt, before, after = balance_window(
                buffered[start : start + accum], self.accelerator.gather, rank, world, pad
            )
            out.extend(dealt)
            state.balanced_steps += 1
            state.heaviest_before += int(before.max())
            state.heaviest_after += int(after.max())
            state.rank_tokens_before = (np.array(state.rank_tokens_before or [0] * world) + before).tolist()
            state.rank_tokens_after = (np.array(state.rank_tokens_after or [0] * world) + after).tolist()
        return out

    def _sb_models(self) -> list[Any]:
        unwrap = self.accelerator.unwrap_model
        models = [unwrap(self.model)]
        if getattr(self, "ref_model", None) is not None:
            models.append(unwrap(self.ref_model))
        return models

    def _sb_check_layout(self, model: Any) -> None:
        """Run a probe batch through ``model`` padded (TRL's forward) and in packed rows; refuse the model
        if they disagree (its attention does not keep the completions apart)."""
        vocab = int(getattr(model.config, "vocab_size", 0) or 16)
        device = next(model.parameters()).device
        # Two prompts (3 and 2 tokens, left-padded), three completions of the first, one of the second.
        prompts = [[5, 6, 7]] * 3 + [[8, 9]]
        completions = [[10, 11], [12, 13, 14], [15], [16, 17]]
        ids = torch.zeros(4, 6, dtype=torch.long)
        mask = torch.zeros(4, 6, dtype=torch.long)
        for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            ids[b, 3 - len(p) : 3], mask[b, 3 - len(p) : 3] = torch.tensor(p), 1
            ids[b, 3 : 3 + len(c)], mask[b, 3 : 3 + len(c)] = torch.tensor(c), 1
        ids, mask = (ids % vocab).to(device), mask.to(device)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                expected = super()._get_per_token_logps_and_entropies(model, ids, mask, 3)[0]  # type: ignore[misc]
                got = self._sb_packed(model, ids, mask, 3, None, False)[0]
        finally:
            model.train(was_training)
        tolerance = 1e-3 if expected.dtype == torch.float32 else 5e-2
        if not torch.allclose(got.float(), expected.float(), rtol=tolerance, atol=tolerance):
            impl = getattr(model.config, "_attn_implementation", None)
            raise ConfigError(
                f"{type(model).__name__} (attention {impl!r}) does not keep the completions of a packed row "
                f"apart: its log-probabilities differ from the padded ones by "
                f"{float((got - expected).abs().max()):.3g}; use strategy 'token_budget'"
            )

    # -- the log-probabilities --------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's per-token log-probabilities (and entropies) of ``(B, logits_to_keep)``, from planned rows."""
        given = [k for k, v in multimodal.items() if v is not None]
        if given or compute_aux_loss:
            raise ConfigError(
                f"a GRPO forward with {', '.join(given) or 'a router auxiliary loss'} reached smart batching, "
                "which plans text completions only: train it without apply_smart_batching"
            )
        state = self.smart_batching
        state.num_trl_tokens += input_ids.numel()  # TRL's chunks are as wide as the whole call
        if state.spec.packs_rows:
            return self._sb_packed(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy
            )
        return self._sb_budget(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy)

    def _sb_packed(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        state = self.smart_batching
        width = int(logits_to_keep)
        logps, entropies, targets = [], [], []
        for chunk in chunk_rows(batch_size, input_ids.shape[0]):
            found = Completions.from_padded(input_ids[chunk], attention_mask[chunk], width)
            units = found.split_units(found.units(state.prompt_sharing), state.spec.capacity)
            plan = plan_batches(found.costs(units), state.spec, seed=state.seed)
            rows = [members for b in range(len(plan)) for members in plan.rows(b)]
            if model is not self.accelerator.unwrap_model(model):
                # A wrapped model (DDP) runs collectives in every forward: one forward per call on every
                # rank, as TRL's, so the planned rows go end to end in one row.
                rows = [np.concatenate(rows)]
            for members in rows:
                row = found.row([units[i] for i in members], input_ids.device)
                self._sb_check_attention(model)
                with self.accelerator.autocast():
                    out = model(
                        input_ids=row["input_ids"], position_ids=row["position_ids"],
                        shared_prefix_lengths=row["shared_prefix_lengths"], shift_labels=row["shift_labels"],
                        fused_lm_head=True,
                    )  # fmt: skip
                source = row["source"]
                logps.append(out.log_probs[0].index_select(0, source))
                if compute_entropy:
                    entropies.append(out.entropy[0].index_select(0, source))
                targets.append(row["target"] + int(chunk[0]) * width)
                state.num_forwards += 1
                state.num_tokens += int(row["input_ids"].shape[1])
        index, shape = torch.cat(targets), (input_ids.shape[0], width)
        return (
            _scatter(logps, index, shape),
            _scatter(entropies, index, shape) if compute_entropy else None,
            None,
        )

    def _sb_budget(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        state = self.smart_batching
        width = int(logits_to_keep)
        split = input_ids.shape[1] - width
        mask = attention_mask.cpu()
        prompt = mask[:, :split].sum(1).numpy().astype(np.int64)  # (B,)
        completion = mask[:, split:].sum(1).numpy().astype(np.int64)  # (B,)
        costs = prompt + completion
        refuse_overlong(costs, state.spec, self.sb_accepts)
        logps, entropies, rows, cols = [], [], [], []
        plan = plan_batches(costs, state.spec, seed=state.seed)
        for members in plan:
            p, c = int(prompt[members].max()), max(int(completion[members].max()), 1)
            index = torch.from_numpy(members).to(input_ids.device)
            ids = input_ids.index_select(0, index)[:, split - p : split + c]
            sub_mask = attention_mask.index_select(0, index)[:, split - p : split + c]
            lp, ent, _ = super()._get_per_token_logps_and_entropies(  # type: ignore[misc]
                model, ids, sub_mask, c, compute_entropy=compute_entropy
            )
            logps.append(lp.reshape(-1))
            if compute_entropy:
                entropies.append(ent.reshape(-1))
            rows.append(index.repeat_interleave(c))
            cols.append(torch.arange(c, device=index.device).repeat(len(members)))
            state.num_forwards += 1
            state.num_tokens += len(members) * (p + c)
        index, shape = torch.cat(rows) * width + torch.cat(cols), (input_ids.shape[0], width)
        return (
            _scatter(logps, index, shape),
            _scatter(entropies, index, shape) if compute_entropy else None,
            None,
        )

    def _sb_check_attention(self, model: Any) -> None:
        impl = getattr(
            getattr(self.accelerator.unwrap_model(model), "config", None), "_attn_implementation", None
        )
        if impl != PREFIX_SHARED_ATTENTION:
            raise ConfigError(
                f"a packed GRPO row reached a model with attention {impl!r}, which would let its completions "
                f"attend to each other; smart batching set {PREFIX_SHARED_ATTENTION!r}: do not switch the "
                "attention implementation after apply_smart_batching"
            )


def _scatter(values: list[torch.Tensor], index: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``values`` (per-token results, concatenated) at the flat positions ``index`` of a zero ``shape``
    tensor: TRL's ``(completions, logits_to_keep)`` layout, 0 where no completion token is."""
    flat = torch.cat(values)
    return flat.new_zeros(shape[0] * shape[1]).index_put((index,), flat).view(shape)


def with_grpo_smart_batching(trainer_cls: type) -> type:
    """A subclass of ``trainer_cls`` (TRL's ``GRPOTrainer``, ``RLOOTrainer`` or a subclass) with the GRPO
    overrides."""
    return mixed_class(GRPOSmartBatchingMixin, trainer_cls)


def apply_grpo_smart_batching(trainer: Any, strategy: Any = FASTEST_STRATEGY, **options: Any) -> Any:
    """:func:`~smart_batching.hf.apply_smart_batching` for a ``GRPOTrainer``: options of
    :meth:`GRPOSmartBatchingMixin.setup_smart_batching` go there, the rest are the strategy's fields.
    The trainer is switched only once every option is accepted."""
    setup = split_options(GRPOSmartBatchingMixin.setup_smart_batching, options)
    cls = type(trainer)
    trainer.__class__ = with_grpo_smart_batching(cls)
    try:
        trainer.setup_smart_batching(strategy, **setup)
    except Exception:
        trainer.__class__ = cls
        trainer.__dict__.pop("smart_batching", None)
        raise
    return trainer


__all__ = [
    "GRPOSmartBatchingMixin",
    "GRPOSmartBatchingState",
    "apply_grpo_smart_batching",
    "with_grpo_smart_batching",
]
