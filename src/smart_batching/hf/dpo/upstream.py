"""TRL ``DPOConfig``'s options under smart batching: honoured, or refused by name before step 1.

:data:`DPO_OPTIONS` is the DPO table of docs/options.md (``tests/conformance/test_vs_trl_dpo.py`` holds each row);
``TrainingArguments`` options follow :data:`smart_batching.hf.upstream.UPSTREAM_OPTIONS` as for any
trainer. :func:`resolve_dpo_upstream` applies both. :data:`PAIRS` is what the kind accepts where a
refusal advises (a pair is one unit: never cut; no searched budget), :data:`REFUSALS` the options of
``apply_smart_batching`` it refuses.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from smart_batching import compat
from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import Accepts, either
from smart_batching.hf.upstream import UpstreamOption, _names, resolve_upstream

DPO = "DPOConfig"

DPO_OPTIONS: tuple[UpstreamOption, ...] = (
    UpstreamOption(DPO, "max_length / truncation_mode",
        "Honoured: each sequence (prompt + completion) is truncated as TRL's collator truncates it, and "
        "pairs are planned at their truncated lengths. Strategy packed takes `2 * max_length` as its "
        "`capacity` unless `capacity` is given (two full sequences fit one row). Under `keep_end` a pair "
        "shares its prompt only where both sequences lost as many tokens."),
    UpstreamOption(DPO, "padding_free",
        "TRL 1.16 turns it off and pads. Honoured by strategy packed (padding-free rows); refused with a "
        "padded strategy."),
    UpstreamOption(DPO, "pad_to_multiple_of",
        "Honoured by the padded strategies (TRL's collator is kept); refused with strategy packed."),
    UpstreamOption(DPO, "precompute_ref_log_probs / precompute_ref_batch_size",
        "Honoured: TRL computes the reference log-probabilities before smart batching is applied; our "
        "batches carry them and the reference model is not run."),
    UpstreamOption(DPO, "loss_type / loss_weights",
        "Honoured, every loss TRL 1.16 offers: TRL's loss code runs on per-token log-probabilities equal "
        "to its padded computation. `aot` and `aot_unpaired` sort the pairs of a micro-batch: they see the "
        "planned micro-batch."),
    UpstreamOption(DPO, "beta / label_smoothing / discopop_tau / ld_alpha / f_divergence_type / f_alpha_divergence_coef",
        "Honoured: read by TRL's loss code, which runs unchanged."),
    UpstreamOption(DPO, "use_weighting",
        "Honoured: TRL's fused LM head computes the WPO weights' `log_sum_sq_probs` at the same positions."),
    UpstreamOption(DPO, "router_aux_loss_coef",
        "Honoured by the padded strategies. Refused with strategy packed for a model that adds a router "
        "auxiliary loss (TRL computes it over the padded batch's tokens, prompt twice)."),
    UpstreamOption(DPO, "sync_ref_model / ref_model_mixup_alpha / ref_model_sync_steps",
        "Honoured: TRL's callback updates the reference weights in place."),
    UpstreamOption(DPO, "disable_dropout",
        "Honoured: TRL switches dropout off before smart batching is applied."),
    UpstreamOption(DPO, "activation_offloading",
        "Honoured: TRL's `training_step` (its offloading context) stays in force."),
    UpstreamOption(DPO, "model_init_kwargs / trust_remote_code / dataset_num_proc / pad_token",
        "Honoured: model loading and dataset preparation are TRL's and run before smart batching."),
    UpstreamOption("DPOTrainer", "peft_config",
        "Honoured by the padded strategies (TRL's forward, full logits). Refused with strategy packed "
        "(not tested here: PEFT is not installed)."),
    UpstreamOption("dataset", "vision pairs (image / images)",
        "Refused: TRL processes them on the fly, so there are no token counts to plan."),
    UpstreamOption("smart batching", "max_tokens=\"auto\" / capacity=\"auto\"",
        "Refused for DPO: the search measures one model's step, DPO runs two; give a number."),
)  # fmt: skip

PAIRS = Accepts(unit="pair", auto_budget=False, overlong=("error", "drop"), own_collator=False)
"""What a ``DPOTrainer`` accepts where a refusal advises: a pair is one unit (it is never truncated or
split: ``overlong`` is ``'error'`` or ``'drop'``), budgets are numbers (the search measures one model's
step; DPO runs two), and its collators are TRL's or :class:`~smart_batching.hf.dpo.collate.PairCollator`
(other label names are not written by a collator of yours)."""

REFUSALS = dict.fromkeys(
    ("batch_schedule", "lr_scaling", "oom_backoff"),
    "preference pairs take no adaptive batch size; remove it, or set a fixed max_tokens / capacity for the pairs",
)
"""``apply_smart_batching`` options refused on a ``DPOTrainer``: the adaptive step (pieces of a step,
out-of-memory back-off) is left out, TRL's ``training_step`` runs."""


def resolve_dpo_upstream(
    trainer: Any, strategy: Any, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Apply ``TrainingArguments``' rows and :data:`DPO_OPTIONS` to a ``DPOTrainer`` about to be set up.

    Returns:
        ``(options, decisions)`` as :func:`smart_batching.hf.upstream.resolve_upstream`.

    Raises:
        ConfigError: a setting that cannot be honoured with this strategy, named with what to change.
    """
    from smart_batching.planners import PlannerSpec, spec_class

    cls = spec_class(strategy)
    name = cls.name
    if not PAIRS.auto_budget and "auto" in (options.get("max_tokens"), options.get("capacity")):
        raise ConfigError(
            "max_tokens='auto' / capacity='auto' are not available for DPOTrainer (the search measures one "
            "model's step; DPO runs the policy and the reference model): give a number of tokens"
        )
    args = trainer.args
    if getattr(args, "padding_free", False) and not cls.packs_rows:
        raise ConfigError(
            f"DPOConfig(padding_free=True) asks for padding-free rows, but strategy {name!r} pads: use "
            "strategy='packed', or set padding_free=False"
        )
    out, decided = resolve_upstream(trainer, strategy, options, own_collator=True, accepts=PAIRS)
    if getattr(args, "padding_free", False):
        decided["padding_free"] = "padding-free rows (strategy packed)"
    spec_fields = {f.name for f in fields(cls)}
    given = spec_fields if isinstance(strategy, PlannerSpec) else set(options)
    if getattr(trainer, "_is_vision_dataset", False):
        raise ConfigError(
            "a vision preference dataset (image/images columns): TRL processes it on the fly, so smart "
            "batching has no token counts to plan; train it without apply_smart_batching"
        )
    overlong = out.get("overlong")
    if overlong is not None and overlong not in PAIRS.overlong:
        raise ConfigError(
            f"overlong={overlong!r} would cut a pair into pieces; a pair is one unit: set "
            f"overlong={either(PAIRS.overlong)}"
        )
    max_length = getattr(args, "max_length", None)
    if cls.packs_rows:
        if isinstance(max_length, int) and "capacity" in spec_fields and "capacity" not in given:
            out["capacity"] = 2 * max_length
            decided["max_length"] = f"capacity={2 * max_length} (2 * max_length)"
        multiple = getattr(args, "pad_to_multiple_of", None)
        if isinstance(multiple, int):
            raise ConfigError(
                f"DPOConfig(pad_to_multiple_of={multiple}): strategy {name!r} writes padding-free rows; set "
                "pad_to_multiple_of=None or use a padded strategy (token_budget, group_by_length)"
            )
        if getattr(trainer, "aux_loss_enabled", False):
            raise ConfigError(
                f"{type(trainer.model).__name__} adds a router auxiliary loss, which TRL computes over the "
                f"padded batch; strategy {name!r} packs rows: use a padded strategy or router_aux_loss_coef=0.0"
            )
        if compat.is_peft_model(trainer.model):
            raise ConfigError(
                f"strategy {name!r} with a PEFT model is not supported yet: use a padded strategy "
                "(token_budget, group_by_length)"
            )
    if args.truncation_mode != "keep_start" and max_length is not None:
        decided["truncation_mode"] = f"{args.truncation_mode} (as TRL's collator)"
    if getattr(trainer, "precompute_ref_logps", False):
        decided["precompute_ref_log_probs"] = (
            "reference log-probabilities read from TRL's precomputed columns"
        )
    return out, decided


def dpo_markdown_table() -> str:
    """:data:`DPO_OPTIONS` as the markdown table of docs/options.md."""
    lines = ["| option | what smart batching does |", "|---|---|"]
    lines += [f"| {o.owner}: {_names(o.name)} | {o.rule} |" for o in DPO_OPTIONS]
    return "\n".join(lines)


__all__ = ["DPO_OPTIONS", "PAIRS", "REFUSALS", "dpo_markdown_table", "resolve_dpo_upstream"]
