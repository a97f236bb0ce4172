"""``BenchConfig``: every setting of one ``smart-batching bench``, as one frozen, validated value.

:func:`~smart_batching.bench.runner.run_bench` takes a config, or the same fields as keywords::

    from smart_batching.bench import BenchConfig, run_bench

    config = BenchConfig(data="gsm8k/train.jsonl", strategies=("random", "packed"), max_steps=40)
    run_bench(config)
    run_bench(config, seeds=(0, 1))                 # the same config with fields replaced
    run_bench("gsm8k/train.jsonl", max_steps=40)    # keywords build the config

Every check runs when the config is made, before any model or data loads, and a refusal names the
field to change (``ConfigError``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from smart_batching.data.tasks import LOSS_ON
from smart_batching.errors import ConfigError
from smart_batching.planners import STRATEGIES, parse_strategy

DEFAULT_LR = {"causal": 1e-3, "smollm2": 5e-5, "classifier": 1e-4}
PRECISIONS = ("fp32", "bf16", "auto")
"""``BenchConfig.precision`` values: float32, bf16 autocast, or bf16 where a CUDA GPU supports it."""
"""Peak learning rate when ``lr`` is None: by model kind, and for SmolLM2 (pretrained) its own."""


def _positive_int(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"BenchConfig: {name}={value!r} must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What a bench trains, on what, how often, and where it writes.

    Attributes:
        data: ``"default"`` (the embedded dataset), a data file or folder, or a ``datasets.Dataset``.
        model: ``"tiny-llama"``, ``"smollm2"``, ``"minilm"``, a transformers model object, or a loaded
            :class:`~smart_batching.models.zoo.TrainingModel` (benches that share one load).
        tokenizer: a tokenizer name or object; None means the model's own (``smollm2`` for the Llamas).
        strategies: strategy names, in run order (``random`` first: speed ratios are against it);
            options by name are allowed (``token_budget[window=512]``).
        seeds: planner and Trainer seeds; every strategy runs once per seed from the same initial weights.
        max_steps: train on ``max_steps * batch_size`` examples (ignored when ``num_examples`` is given).
        num_examples: training examples (the first ones); None (and no ``max_steps``) means all.
        epochs: full passes over the training examples, the same for every strategy.
        batch_size: examples per batch of ``random``, ``max_length`` and ``group_by_length``.
        max_tokens: padded tokens per ``token_budget`` batch; None means ``batch_size`` × the mean length
            rounded up to 64 tokens (at least the longest example).
        capacity: tokens per ``packed`` row (one row per batch); None as ``max_tokens``.
        max_length: truncate examples to this many tokens, once, for every strategy; None keeps all.
        loss_on: what a causal LM learns from, and is evaluated on: ``"completion"`` (the last reply) or
            ``"assistant"`` (every assistant turn of a conversation; :data:`~smart_batching.data.tasks.LOSS_ON`).
        lr: peak learning rate; None means :data:`DEFAULT_LR` for the model.
        lr_schedule: the Trainer's ``lr_scheduler_type`` (``"constant"``, ``"linear"`` decay to 0, ...),
            the same for every run.
        match_steps: give ``token_budget`` and ``packed`` rows the smallest budget (``max_tokens`` /
            ``capacity``, bisected over their plans for every seed) whose plans have no more batches
            than fixed batches of ``batch_size``, so every strategy takes about the same optimizer
            steps (never more); False keeps ``max_tokens`` and ``capacity`` as given or derived.
        budgets: per-strategy token budgets used as given, ``{name: {"max_tokens": T}}`` or
            ``{name: {"capacity": C}}``: a micro-batch's (a ``[mix_steps=k]`` row's budget is not divided
            by ``k``), as ``match_steps`` computes them; they win over ``max_tokens`` / ``capacity`` and
            over ``match_steps`` for the strategies they name.
        eval_data: held-out data; None picks a dev/test split or sibling file, else holds out the last
            ``eval_examples`` records.
        eval_examples: held-out examples for the eval loss (and accuracy).
        eval_batch_size: examples per padded eval batch.
        eval_every: held-out loss during training (:mod:`~smart_batching.bench.curve`): every N optimizer
            steps (``5``), every N real training tokens (``"20000tok"``), ``"auto"`` (evaluations
            costing about a tenth of the training compute) or None (off: the curve has the initial and
            the final evaluation, and one at each earlier epoch's end). Evaluation time is kept out of
            the training clock. Needs ``nproc=1``.
        target: held-out loss that time to target is measured to; None means ``random``'s final
            held-out loss for the same seed (``random`` must then be among the strategies).
        num_generations: held-out prompts to generate for (GSM8K: the exact-match sample); None means 16
            for GSM8K, 4 for other text, 8 sample predictions for classification.
        max_new_tokens: greedy generation length in tokens; None means 256 for GSM8K, 48 otherwise.
        out_dir: folder for ``records.jsonl`` and the report.
        append: add to an existing ``records.jsonl`` (the report shows every bench in it) instead of
            starting a new one.
        render: render the report when done (also after Ctrl-C).
        progress: a line per set-up step and per finished run on stderr, and a tqdm bar per run when
            stderr is a terminal.
        device: torch device; None means CUDA when available, else CPU.
        threads: torch CPU threads during the bench (restored afterwards); None leaves torch's setting.
            On a shared machine 1 thread makes ``cpu_seconds`` a clean measure of work. With
            ``nproc > 1``: threads of each process; None means the usable cores / ``nproc``.
        nproc: processes each run trains on (torchrun; gloo on CPU, NCCL with one GPU per process), all
            over one balanced plan; 1 trains in this process.
        precision: ``"fp32"``, ``"bf16"`` (``TrainingArguments(bf16=True)``: bf16 autocast, float32
            weights) or ``"auto"`` (bf16 on a CUDA GPU that supports it, float32 elsewhere); the same for
            every strategy. Each record names it (``precision``: setting, dtype, autocast,
            checkpointing, the CPU's bf16 support).
        model_options: ``LlamaConfig`` overrides for ``tiny-llama`` (e.g. ``{"hidden_size": 64}``), or
            ``{"num_hidden_layers": k}`` for ``smollm2`` (its first ``k`` layers); ``{"trainable_layers": k}``
            for both trains only the last ``k`` decoder layers and the final norm.
        batch_schedule: tokens (or examples) per optimizer step as a function of what was seen, for every
            run (``"linear:4096->32768@20%"``, see :mod:`smart_batching.adaptive.schedule`); each step runs as
            many micro-batches of the strategy's budget as it needs. None: one micro-batch per step.
        schedule_unit: what ``batch_schedule`` counts for every strategy, ``"tokens"`` or ``"examples"``;
            None: each strategy's own (tokens for ``token_budget`` and ``packed``, examples for the others).
        lr_scaling: with ``batch_schedule``, ``"sqrt"`` or ``"linear"``: each step's learning rate times its
            size over the first size, to that power (:mod:`smart_batching.adaptive.lr`); None: unscaled.
        oom_backoff: the Trainer's out-of-memory back-off for every run: True, False, or a dict of
            :class:`~smart_batching.adaptive.backoff.OomBackoff` options (``{"fail_over_tokens": T}``
            injects a failure over T token slots, to measure what a back-off costs).
        callbacks: extra ``TrainerCallback`` objects for every run (``nproc=1`` only: they live in this
            process).
        on_record: called with each record as soon as it is written.
    """

    data: Any = "default"
    model: Any = "tiny-llama"
    tokenizer: Any = None
    strategies: Sequence[str] = STRATEGIES
    seeds: Sequence[int] = (0,)
    max_steps: int | None = None
    num_examples: int | None = None
    epochs: int = 1
    batch_size: int = 8
    max_tokens: int | None = None
    capacity: int | None = None
    max_length: int | None = None
    loss_on: str = "completion"
    lr: float | None = None
    lr_schedule: str = "constant"
    match_steps: bool = False
    budgets: Mapping[str, Mapping[str, int]] | None = None
    eval_data: Any = None
    eval_examples: int = 64
    eval_batch_size: int = 8
    eval_every: Any = None
    target: float | None = None
    num_generations: int | None = None
    max_new_tokens: int | None = None
    out_dir: str | os.PathLike = "out/bench"
    append: bool = False
    render: bool = True
    progress: bool = True
    device: Any = None
    threads: int | None = None
    nproc: int = 1
    precision: str = "auto"
    model_options: Mapping[str, Any] | None = None
    batch_schedule: str | None = None
    schedule_unit: str | None = None
    lr_scaling: str | None = None
    oom_backoff: bool | Mapping[str, Any] = False
    callbacks: Sequence[Any] = ()
    on_record: Callable[[dict[str, Any]], None] | None = field(default=None, compare=False)

    def _check_budgets(self) -> None:
        budgets = self.budgets
        if not isinstance(budgets, Mapping):
            raise ConfigError(
                f"BenchConfig: budgets= must be a dict of strategy -> {{option: tokens}}, got {budgets!r}"
            )
        for name, budget in budgets.items():
            if name not in self.strategies:
                raise ConfigError(
                    f"BenchConfig: budgets= names {name!r}, which is not among strategies= {list(self.strategies)}"
                )
            if not isinstance(budget, Mapping) or not budget or set(budget) - {"max_tokens", "capacity"}:
                raise ConfigError(
                    f"BenchConfig: budgets[{name!r}]={budget!r} must be {{'max_tokens': T}} or {{'capacity': C}}"
                )
            for option, value in budget.items():
                _positive_int(f"budgets[{name!r}][{option!r}]", value)
        object.__setattr__(self, "budgets", {name: dict(b) for name, b in budgets.items()})

    def __post_init__(self) -> None:
        if isinstance(self.strategies, str):
            raise ConfigError(
                "BenchConfig: strategies= must be a sequence of names, e.g. ('random', 'packed'); "
                f"got the string {self.strategies!r} (split a comma-separated list first)"
            )
        object.__setattr__(self, "strategies", tuple(self.strategies))
        if not self.strategies:
            raise ConfigError("BenchConfig: strategies= is empty; name at least one strategy")
        try:
            seeds = tuple(int(s) for s in self.seeds)
        except (TypeError, ValueError):
            raise ConfigError(f"BenchConfig: seeds= must be integers, got {self.seeds!r}") from None
        if not seeds:
            raise ConfigError("BenchConfig: seeds= is empty; give at least one seed")
        if any(s < 0 for s in seeds):
            raise ConfigError(f"BenchConfig: seeds= must be non-negative, got {list(seeds)}")
        object.__setattr__(self, "seeds", seeds)
        object.__setattr__(self, "callbacks", tuple(self.callbacks))
        for name in ("epochs", "batch_size", "eval_examples", "eval_batch_size", "nproc"):
            _positive_int(name, getattr(self, name))
        for name in ("max_steps", "num_examples", "max_tokens", "capacity", "max_length", "threads"):
            _positive_int(name, getattr(self, name), allow_none=True)
        for name in ("num_generations", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"BenchConfig: {name}={value!r} must be a non-negative integer or None")
        if self.lr is not None and (
            isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0
        ):
            raise ConfigError(f"BenchConfig: lr={self.lr!r} must be a positive number or None")
        if self.lr_schedule not in ("constant", "linear"):  # the two the studies use; others are asked of HF
            from smart_batching.compat import lr_scheduler_types

            if self.lr_schedule not in lr_scheduler_types():
                raise ConfigError(
                    f"BenchConfig: lr_schedule={self.lr_schedule!r} is not a transformers scheduler; choose one "
                    f"of {', '.join(lr_scheduler_types())}"
                )
        for name in ("match_steps", "append", "render", "progress"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"BenchConfig: {name}= must be True or False, got {getattr(self, name)!r}")
        if self.budgets is not None:
            self._check_budgets()
        if self.loss_on not in LOSS_ON:
            raise ConfigError(
                f"BenchConfig: loss_on={self.loss_on!r} must be one of {', '.join(map(repr, LOSS_ON))}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"BenchConfig: precision={self.precision!r} must be one of {', '.join(PRECISIONS)}"
            )
        if self.model_options is not None and not isinstance(self.model_options, Mapping):
            raise ConfigError(f"BenchConfig: model_options= must be a dict, got {self.model_options!r}")
        from smart_batching.bench.curve import parse_eval_every

        parse_eval_every(self.eval_every)  # a malformed cadence fails here, naming the forms it takes
        if self.eval_every not in (None, 0, "0", "off") and self.nproc > 1:
            raise ConfigError(
                "BenchConfig: eval_every= evaluates in the training process; it cannot be combined with nproc > 1"
            )
        if self.target is not None and (
            isinstance(self.target, bool) or not isinstance(self.target, (int, float)) or not self.target > 0
        ):
            raise ConfigError(f"BenchConfig: target={self.target!r} must be a positive held-out loss or None")
        if self.nproc > 1 and self.callbacks:
            raise ConfigError(
                "BenchConfig: callbacks= run in this process only; they cannot be combined with nproc > 1"
            )
        for name in self.strategies:
            parse_strategy(name)  # unknown strategies fail here; unknown options when the spec is made
        self._check_adaptive()

    def _check_adaptive(self) -> None:
        from smart_batching.adaptive.backoff import OomBackoff
        from smart_batching.adaptive.lr import check_lr_scaling
        from smart_batching.adaptive.schedule import UNITS, BatchSchedule

        if self.batch_schedule is not None:
            BatchSchedule.parse(self.batch_schedule)  # names what is wrong with the text
        if self.schedule_unit is not None and self.schedule_unit not in UNITS:
            raise ConfigError(
                f"BenchConfig: schedule_unit={self.schedule_unit!r} must be one of {', '.join(UNITS)} or None"
            )
        check_lr_scaling(self.lr_scaling)
        if self.lr_scaling is not None and self.batch_schedule is None:
            raise ConfigError(
                "BenchConfig: lr_scaling= scales steps a batch_schedule= sizes; give batch_schedule too"
            )
        if not isinstance(self.oom_backoff, (bool, Mapping)):
            raise ConfigError(
                f"BenchConfig: oom_backoff= must be True, False or a dict, got {self.oom_backoff!r}"
            )
        OomBackoff.coerce(
            dict(self.oom_backoff) if isinstance(self.oom_backoff, Mapping) else self.oom_backoff
        )

    @property
    def train_examples(self) -> int | None:
        """Training examples to take: ``num_examples``, else ``max_steps * batch_size``, else all (None)."""
        if self.num_examples is None and self.max_steps is not None:
            return self.max_steps * self.batch_size
        return self.num_examples

    def replace(self, **changes: Any) -> BenchConfig:
        """A copy with ``changes`` applied (and validated)."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ConfigError(
                f"BenchConfig has no field {', '.join(unknown)}; its fields are: "
                f"{', '.join(f.name for f in fields(self))}"
            )
        return replace(self, **changes)

    @classmethod
    def of(cls, config: BenchConfig | Any = None, **changes: Any) -> BenchConfig:
        """``config`` with ``changes`` applied; a first argument that is not a config is ``data``."""
        if isinstance(config, BenchConfig):
            return config.replace(**changes) if changes else config
        if config is not None:
            if "data" in changes:
                raise ConfigError("give data= once: as the first argument or as a keyword, not both")
            changes["data"] = config
        return cls().replace(**changes) if changes else cls()


__all__ = ["DEFAULT_LR", "PRECISIONS", "BenchConfig"]
