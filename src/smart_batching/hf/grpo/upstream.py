"""TRL ``GRPOConfig``'s options under smart batching: honoured, or refused by name before step 1.

:data:`GRPO_OPTIONS` is the GRPO table of docs/options.md and docs/guides/trl-grpo.md (``tests/conformance/test_vs_trl_grpo.py`` holds the rows
it tests). :func:`resolve_grpo_upstream` refuses what cannot be kept. :data:`COMPLETIONS` is what the kind
accepts where a refusal advises (a completion is one unit, never cut; budgets are numbers),
:data:`REFUSALS` the options of ``apply_smart_batching`` it refuses.
"""

from __future__ import annotations

from typing import Any

from smart_batching import compat
from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import Accepts
from smart_batching.hf.upstream import UpstreamOption, _names
from smart_batching.planners import spec_class

GRPO = "GRPOConfig"

GRPO_OPTIONS: tuple[UpstreamOption, ...] = (
    UpstreamOption(GRPO, "loss_type",
        "Honoured, every loss TRL 1.16 offers (grpo, dapo, dr_grpo, bnpo, cispo, sapo, luspo, vespo): "
        "TRL's `_compute_loss` runs unchanged on per-token log-probabilities equal to its padded computation."),
    UpstreamOption(GRPO, "beta",
        "Honoured: the reference model's log-probabilities are computed the same way (prompt once per group "
        "with `packed`)."),
    UpstreamOption(GRPO, "num_iterations / steps_per_generation / gradient_accumulation_steps",
        "Honoured: TRL's buffering, shuffle and split of the generation batch stay; the old policy's "
        "log-probabilities, where TRL computes them, are computed the same way (tested with "
        "steps_per_generation=2, gradient_accumulation_steps=2 and num_iterations=2)."),
    UpstreamOption("smart batching", "balance_ranks",
        "On several ranks, each optimizer step's completions are dealt again between the ranks and "
        "micro-batches by tokens, each micro-batch keeping TRL's count: the step holds TRL's completions and "
        "its gradient is TRL's (tested on 2 gloo ranks: loss, grad norm, rewards and weights as TRL alone); "
        "`kl`, `entropy` and the clip ratios, which TRL averages per micro-batch, are averaged over the new "
        "micro-batches. `\"auto\"` (default) deals where that holds and otherwise warns once and keeps TRL's "
        "deal (`loss_type='bnpo'`, an entropy bonus, `top_entropy_quantile` < 1, `steps_per_generation` not a "
        "multiple of `gradient_accumulation_steps`); `True` refuses those settings; `False` keeps TRL's deal."),
    UpstreamOption(GRPO, "importance_sampling_level / epsilon / epsilon_high / delta / top_entropy_quantile",
        "Honoured: read by TRL's loss code on our log-probabilities and entropies (tested equal to TRL's; "
        "the sequence level under luspo, the token level otherwise; `delta`, `top_entropy_quantile` not "
        "tested)."),
    UpstreamOption(GRPO, "scale_rewards / reward_weights / mask_truncated_completions",
        "Honoured: rewards and advantages are TRL's."),
    UpstreamOption(GRPO, "pad_to_multiple_of",
        "TRL's padded view keeps it; `packed` rows are padding-free (not tested)."),
    UpstreamOption(GRPO, "cast_lm_head_to_fp32 / temperature",
        "TRL's fused LM head scores our rows, so they apply as in TRL (not tested)."),
    UpstreamOption(GRPO, "gradient_checkpointing",
        "Honoured (on by default in GRPOConfig; the conformance tests run with it)."),
    UpstreamOption(GRPO, "use_vllm / use_transformers_paged / generation_kwargs",
        "Generation stays TRL's. vLLM is not installed here: not tested."),
    UpstreamOption("RLOOTrainer", "RLOOConfig",
        "The same kind: RLOO's training pass calls the same `_get_per_token_logps_and_entropies` (policy, old "
        "policy, and the reference model for `beta`'s KL in the reward), planned the same way; its "
        "sequence-level clipped loss, leave-one-out advantages and metrics stay TRL's (tested: training runs "
        "under `packed` and `token_budget` log TRL alone's history and end with its weights). The rows below "
        "hold for it where RLOOConfig has the option (it has no `loss_type`)."),
    UpstreamOption(GRPO, "router_aux_loss_coef",
        "Refused for a model that adds a router auxiliary loss (TRL averages it over its own chunks of "
        "padded rows)."),
    UpstreamOption("GRPOTrainer", "peft_config",
        "Refused with strategy packed (not tested here: PEFT is not installed)."),
    UpstreamOption("dataset", "vision prompts (image / images)",
        "Refused: the forward takes image inputs per padded row."),
    UpstreamOption("TrainingArguments", "auto_find_batch_size",
        "Refused by TRL's GRPOConfig itself (and by smart batching if set later): give `max_tokens` / "
        "`capacity` a number of tokens."),
    UpstreamOption("smart batching", "max_tokens=\"auto\" / capacity=\"auto\" / overlong",
        "Refused: a completion is never cut or dropped (TRL's loss scores all of it); give a number of tokens."),
)  # fmt: skip

COMPLETIONS = Accepts(unit="completion", auto_budget=False, overlong=("error",), own_collator=False)
"""What a ``GRPOTrainer`` accepts where a refusal advises: a completion is one unit, never cut or dropped,
budgets are numbers of tokens, and the collator is TRL's."""

REFUSALS = dict.fromkeys(
    ("batch_schedule", "lr_scaling", "oom_backoff"),
    "GRPO's micro-batches are TRL's slices of its generation batch; remove it and give max_tokens / capacity",
)
"""``apply_smart_batching`` options refused on a ``GRPOTrainer``: TRL's ``training_step`` runs."""


def resolve_grpo_upstream(trainer: Any, strategy: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Refuse what a ``GRPOTrainer`` about to be set up cannot keep; returns the strategy's options.

    Raises:
        ConfigError: a setting that cannot be honoured, named with what to change.
    """
    cls = spec_class(strategy)
    name = cls.name
    if cls.budget_option is None:  # the strategies planned under a token budget (packed, token_budget)
        raise ConfigError(
            f"strategy {name!r} is not available for a GRPOTrainer: its training pass is planned by tokens; "
            "use 'packed' (prompt once per group) or 'token_budget'"
        )
    args = trainer.args
    if getattr(args, "auto_find_batch_size", False):
        raise ConfigError(
            "TrainingArguments(auto_find_batch_size=True) is not supported on a GRPOTrainer: "
            f"set auto_find_batch_size=False and {COMPLETIONS.budget_advice()}"
        )
    if "auto" in (options.get("max_tokens"), options.get("capacity")):
        raise ConfigError(f"max_tokens='auto' / capacity='auto' are not available for a GRPOTrainer: "
                          f"{COMPLETIONS.budget_advice()}")  # fmt: skip
    overlong = options.get("overlong", "error")
    if overlong != "error":
        raise ConfigError(
            f"overlong={overlong!r} would cut or drop a completion, which TRL's loss scores whole: set "
            "overlong='error' and a budget every completion with its prompt fits"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ConfigError(
            f"{type(trainer.model).__name__} adds a router auxiliary loss (router_aux_loss_coef), which TRL "
            "averages over its own chunks of padded rows: set router_aux_loss_coef=0.0 or train without "
            "apply_smart_batching"
        )
    if getattr(trainer, "_is_vlm", False) or "image" in _columns(trainer) or "images" in _columns(trainer):
        raise ConfigError(
            "vision prompts (image/images): the forward takes image inputs per padded row; train them "
            "without apply_smart_batching"
        )
    if cls.packs_rows and compat.is_peft_model(trainer.model):
        raise ConfigError(
            "strategy 'packed' with a PEFT model (peft_config) is not supported yet: use 'token_budget'"
        )
    if compat.sequence_parallel_enabled(trainer.accelerator):
        raise ConfigError(
            "sequence parallelism (accelerate's ParallelismConfig sp_size > 1) splits each sequence across "
            "ranks; smart batching's GRPO rows do not: turn it off or train without apply_smart_batching"
        )
    return options


def _columns(trainer: Any) -> list[str]:
    return list(getattr(trainer.train_dataset, "column_names", None) or [])


def grpo_markdown_table() -> str:
    """:data:`GRPO_OPTIONS` as the markdown table of docs/options.md."""
    lines = ["| option | what smart batching does |", "|---|---|"]
    lines += [f"| {o.owner}: {_names(o.name)} | {o.rule} |" for o in GRPO_OPTIONS]
    return "\n".join(lines)


__all__ = [
    "COMPLETIONS",
    "GRPO_OPTIONS",
    "REFUSALS",
    "grpo_markdown_table",
    "resolve_grpo_upstream",
]
