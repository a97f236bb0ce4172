"""The trainer's own data settings: every upstream option that shapes the data path is honoured, or
refused by name before the first step.

One line on a trainer (``apply_smart_batching(sft_trainer, "packed")``) changes the batches and nothing
else: the same documents, the same tokens in the loss, the same attention boundaries as the trainer
alone. :data:`UPSTREAM_OPTIONS` says, for each option of ``TrainingArguments`` and TRL's ``SFTConfig``
that touches the data path, what smart batching does with it; the table in docs/options.md is this table
(``tests/conformance/test_upstream_options.py`` holds each row). :func:`resolve_upstream` applies it when
smart batching is set up: options it honours fill in strategy options the caller left out (an option
given in ``strategy_options`` wins), and combinations it cannot honour raise
:class:`~smart_batching.errors.ConfigError` naming the setting to change. Nothing is dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from smart_batching.errors import ConfigError
from smart_batching.hf.adapter import EXAMPLES, Accepts


@dataclass(frozen=True)
class UpstreamOption:
    """One row of the table: an upstream option and what smart batching does with it."""

    owner: str  # "TrainingArguments" or "SFTConfig"
    name: str
    rule: str


TA, SFT = "TrainingArguments", "SFTConfig"

UPSTREAM_OPTIONS: tuple[UpstreamOption, ...] = (
    UpstreamOption(TA, "per_device_train_batch_size",
        "Honoured as `batch_size` by the fixed-size strategies (random, max_length, group_by_length) "
        "unless `strategy_options` sets one; token_budget and packed size batches by `max_tokens` / "
        "`capacity` instead."),
    UpstreamOption(TA, "train_sampling_strategy",
        "`random` (the default): smart batching plans the order. `group_by_length` (the old "
        "`group_by_length=True`): honoured with strategy group_by_length in mode='megabatch' (HF's "
        "megabatches, longest first; the strategy's own default is mode='sorted'), refused with any other "
        "strategy. `sequential`: refused."),
    UpstreamOption(TA, "length_column_name",
        "Read as the precomputed length column when `length_column` is left at its default."),
    UpstreamOption(TA, "dataloader_drop_last",
        "Honoured as `drop_last` by the strategies that have one (random, max_length, "
        "group_by_length); refused with token_budget and packed, which have no short last batch to drop."),
    UpstreamOption(TA, "remove_unused_columns",
        "With smart batching's collators, they get the columns they read (input_ids, labels, masks, "
        "seq_lengths, position_ids, ...). With your own `data_collator`, HF's rule: True keeps the "
        "model's signature columns, False keeps every column; where True drops `prompt_length`, "
        "`completion_mask` or `assistant_masks` before your collator, a warning says so "
        "(`trainer.mask_columns`)."),
    UpstreamOption(TA, "label_names",
        "`labels` (the default) honoured; other names are refused unless you pass your own "
        "`data_collator` (smart batching's collators write `labels`)."),
    UpstreamOption(TA, "label_smoothing_factor",
        "Honoured: the Trainer's label smoother is kept (target-only logits step aside)."),
    UpstreamOption(TA, "auto_find_batch_size",
        "Refused: the plan sets the batch sizes; use `max_tokens=\"auto\"` / `capacity=\"auto\"` "
        "(on a `DPOTrainer`, which refuses those: a number of tokens)."),
    UpstreamOption(TA, "gradient_accumulation_steps",
        "Honoured: the loss of an optimizer step is normalised by the target tokens of all its "
        "micro-batches; with several processes each step deals that many micro-batches per rank. "
        "With strategy group_by_length (HF Trainer, SFTTrainer) each step takes its micro-batches from as "
        "many length strata (`mix_steps=\"auto\"`; `mix_steps=False` keeps consecutive batches)."),
    UpstreamOption(TA, "average_tokens_across_devices",
        "Honoured: the token count is summed across ranks as transformers does."),
    UpstreamOption(TA, "seed / data_seed",
        "The planner seed is `data_seed`, else `seed`, unless `seed=` is given."),
    UpstreamOption(TA, "dataloader_num_workers / pin_memory / persistent_workers / prefetch_factor",
        "Honoured: passed to the train DataLoader."),
    UpstreamOption(SFT, "packing / packing_strategy",
        "TRL packs rows during dataset preparation. bfd / bfd_split rows carry `seq_lengths`: with "
        "strategy packed their documents are the units we plan (TRL's boundaries kept, our fill); a "
        "padded strategy is refused. `wrapped` rows have no document boundaries (TRL lets them attend "
        "across by design): each row is one unit."),
    UpstreamOption(SFT, "padding_free",
        "Honoured by strategy packed (padding-free rows); refused with a padded strategy."),
    UpstreamOption(SFT, "max_length / truncation_mode",
        "TRL truncates during preparation (packing=False) or packs to it (packing=True). Strategy "
        "packed takes `max_length` as its `capacity` unless `capacity` is given."),
    UpstreamOption(SFT, "completion_only_loss",
        "Honoured: TRL builds `labels` from it during preparation and they are used as is (a "
        "leftover `completion_mask` column is not applied over `labels`)."),
    UpstreamOption(SFT, "assistant_only_loss",
        "Honoured the same way, through the `labels` TRL builds from `assistant_masks`."),
    UpstreamOption(SFT, "pad_to_multiple_of",
        "Honoured by the padded strategies' collator; refused with strategy packed (its rows are "
        "padding-free)."),
    UpstreamOption(SFT, "dataset_text_field / dataset_kwargs / formatting_func / eos_token / shuffle_dataset",
        "Honoured: dataset preparation is TRL's and runs before smart batching sees the data."),
    UpstreamOption(SFT, "pad_token",
        "Honoured: padding uses the tokenizer's pad token."),
    UpstreamOption(SFT, "loss_type",
        "Honoured: `SFTTrainer.compute_loss` stays in force."),
    UpstreamOption("dataset", "empty and fully masked examples",
        "Left out of the plan before step 1 and named in one warning (HF and TRL train around them); "
        "`empty_examples=\"error\"` refuses them."),
)  # fmt: skip


def resolve_upstream(
    trainer: Any,
    strategy: Any,
    options: dict[str, Any],
    *,
    own_collator: bool,
    accepts: Accepts | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Apply :data:`UPSTREAM_OPTIONS` to a trainer about to be set up for ``strategy``.

    Args:
        trainer: The trainer (its ``args`` are read, never changed).
        strategy: The strategy's name, or a spec (whose fields all count as given).
        options: The strategy options the caller gave (not changed).
        own_collator: smart batching's collator is installed (not the caller's ``data_collator``).
        accepts: What the trainer's kind accepts: the refusals advise only that. None: the trainer's
            ``sb_accepts`` (its kind's mixin declares it), else everything the core offers.

    Returns:
        ``(options, decisions)``: the strategy options with the honoured upstream values filled in, and
        one line per upstream option that changed something (for ``trainer.smart_batching.upstream``).

    Raises:
        ConfigError: a setting smart batching cannot honour with this strategy, named with what to change.
    """
    from smart_batching.compat import TRAINER_DEFAULT_SAMPLING
    from smart_batching.planners import PlannerSpec, spec_class, strategy_names

    args = trainer.args
    if accepts is None:
        accepts = getattr(trainer, "sb_accepts", EXAMPLES)
    cls = spec_class(strategy)
    name = cls.name
    spec_fields = {f.name for f in fields(cls)}
    given = spec_fields if isinstance(strategy, PlannerSpec) else set(options)
    packs = bool(cls.packs_rows)
    out = dict(options)
    decided: dict[str, str] = {}

    def fill(option: str, field: str, value: Any) -> None:
        if field in spec_fields and field not in given and value is not None:
            out[field] = value
            decided[option] = f"{field}={value!r}"

    fill("per_device_train_batch_size", "batch_size", int(args.per_device_train_batch_size))

    sampling = getattr(args, "train_sampling_strategy", None)
    if sampling is not None and sampling == cls.hf_sampling:
        for field, value in cls.hf_sampling_options.items():
            fill("train_sampling_strategy", field, value)
        kept = ", ".join(f"{k}={out[k]!r}" for k in cls.hf_sampling_options if k in out)
        decided["train_sampling_strategy"] = (
            f"{sampling} (HF's semantics, kept by strategy {name!r}{' with ' + kept if kept else ''})"
        )
    elif sampling not in TRAINER_DEFAULT_SAMPLING:
        keeper = next((n for n in strategy_names() if spec_class(n).hf_sampling == sampling), None)
        also = f", or use strategy={keeper!r} (it keeps HF's {sampling} semantics)" if keeper else ""
        order = "keeps the dataset order" if sampling == "sequential" else "asks for HF's own order"
        raise ConfigError(
            f"train_sampling_strategy={sampling!r} {order}, but smart batching plans the order with strategy "
            f"{name!r}: set train_sampling_strategy='random'{also}"
        )

    if args.dataloader_drop_last:
        if "drop_last" not in spec_fields:
            raise ConfigError(
                f"dataloader_drop_last=True: strategy {name!r} has no short last batch to drop (every example is "
                "planned into a full budget); set dataloader_drop_last=False"
            )
        fill("dataloader_drop_last", "drop_last", True)

    if getattr(args, "auto_find_batch_size", False):
        raise ConfigError(
            "auto_find_batch_size=True: the plan sets the batch sizes, so HF's halving would change nothing; set "
            f"auto_find_batch_size=False and {accepts.budget_advice()}"
        )

    label_names = getattr(args, "label_names", None)
    if own_collator and label_names and list(label_names) != ["labels"]:
        raise ConfigError(
            f"label_names={list(label_names)}: smart batching's collators write 'labels'; "
            f"{accepts.label_names_advice()}"
        )

    # TRL's SFTConfig (duck-typed: TRL is not imported here).
    packing = bool(getattr(args, "packing", False))
    padding_free = bool(getattr(args, "padding_free", False)) or (
        packing and getattr(args, "packing_strategy", "bfd") in ("bfd", "bfd_split")
    )
    if padding_free and not packs:
        what = "packing=True" if packing else "padding_free=True"
        raise ConfigError(
            f"SFTConfig({what}) asks for padding-free rows, but strategy {name!r} pads: use strategy='packed' "
            f"(it plans the documents of TRL's rows, keeping their boundaries), or set {what.split('=')[0]}=False"
        )
    max_length = getattr(args, "max_length", None) if hasattr(args, "packing") else None
    if packs and isinstance(max_length, int):
        fill("max_length", "capacity", max_length)
    multiple = getattr(args, "pad_to_multiple_of", None) if hasattr(args, "packing") else None
    if isinstance(multiple, int):
        if packs:
            raise ConfigError(
                f"SFTConfig(pad_to_multiple_of={multiple}): strategy {name!r} writes padding-free rows of the "
                "planned length; set pad_to_multiple_of=None"
            )
        decided["pad_to_multiple_of"] = f"collator pad_to_multiple_of={multiple}"
    return out, decided


def collator_options(trainer: Any, spec: Any) -> dict[str, Any]:
    """Options for smart batching's collator that come from the trainer's args (``pad_to_multiple_of``)."""
    multiple = getattr(trainer.args, "pad_to_multiple_of", None) if hasattr(trainer.args, "packing") else None
    if isinstance(multiple, int) and not spec.packs_rows:
        return {"pad_to_multiple_of": multiple}
    return {}


def markdown_table() -> str:
    """:data:`UPSTREAM_OPTIONS` as the markdown table of docs/options.md."""
    lines = ["| option | what smart batching does |", "|---|---|"]
    lines += [f"| {o.owner}: {_names(o.name)} | {o.rule} |" for o in UPSTREAM_OPTIONS]
    return "\n".join(lines)


def _names(name: str) -> str:
    parts = [n.strip() for n in name.split("/")]
    return " / ".join(p if " " in p else f"`{p}`" for p in parts)


__all__ = ["UPSTREAM_OPTIONS", "UpstreamOption", "collator_options", "markdown_table", "resolve_upstream"]
