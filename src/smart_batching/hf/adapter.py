"""What a trainer kind is: the adapter contract (:class:`TrainerKind`) and what a kind's refusals may advise
(:class:`Accepts`).

A trainer kind (transformers' ``Trainer`` with TRL's ``SFTTrainer``, TRL's ``DPOTrainer``) is adapted by
one sub-package of :mod:`smart_batching.hf` that declares a :class:`TrainerKind`;
:mod:`smart_batching.hf.kinds` registers them in matching order, and ``apply_smart_batching`` /
``with_smart_batching`` look the kind up there. This module sits below the adapters and the shared core
alike: the core phrases its refusals' advice from the :class:`Accepts` a kind hands it, so a refusal never
advises a setting that the same kind then refuses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from smart_batching.errors import ConfigError, OverlongError
from smart_batching.planners import OVERLONG_POLICIES


def either(values: tuple[str, ...] | list[str]) -> str:
    """``('a', 'b', 'c')`` -> ``"'a', 'b' or 'c'"``."""
    quoted = [repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


@dataclass(frozen=True, kw_only=True)
class Accepts:
    """What a trainer kind accepts among the settings a refusal may advise; the refusals of the shared core
    (``auto_find_batch_size``, ``label_names``, an overlong unit) phrase their advice from it.

    Attributes:
        unit: what one unit of the plan is, in messages (``"example"``, ``"pair"``).
        auto_budget: ``max_tokens="auto"`` / ``capacity="auto"`` are accepted.
        overlong: the ``overlong=`` policies accepted (the planners' own, or fewer where a unit cannot be cut).
        own_collator: a ``data_collator`` of the user's replaces smart batching's (so it may write other
            label names).
    """

    unit: str = "example"
    auto_budget: bool = True
    overlong: tuple[str, ...] = OVERLONG_POLICIES
    own_collator: bool = True

    def __post_init__(self) -> None:
        unknown = [p for p in self.overlong if p not in OVERLONG_POLICIES]
        if unknown or "error" not in self.overlong:
            raise ConfigError(
                f"Accepts(overlong={self.overlong!r}): policies among {', '.join(OVERLONG_POLICIES)}, 'error' included"
            )

    def budget_advice(self) -> str:
        """How to size batches by memory instead of HF's ``auto_find_batch_size``."""
        if self.auto_budget:
            return "use strategy_options={'max_tokens': 'auto'} (or 'capacity': 'auto')"
        return f"give max_tokens= (or capacity=) a number of tokens per batch of {self.unit}s"

    def label_names_advice(self) -> str:
        """What to do about ``label_names`` other than ``["labels"]``."""
        if self.own_collator:
            return "pass your own data_collator that writes these, or set label_names=None"
        return "set label_names=None"

    def overlong_advice(self, setting: str) -> str:
        """What to do about a unit over the limit named ``setting``."""
        cuts = [p for p in self.overlong if p != "error"]
        return f"Raise {setting}=" + (f", or choose overlong={either(cuts)}" if cuts else "")


EXAMPLES = Accepts()
"""Everything the planners and the shared core offer: what the ``Trainer`` kind accepts, whose units are
examples (or the documents of TRL's packed rows)."""


def refuse_overlong(costs: np.ndarray, spec: Any, accepts: Accepts) -> None:
    """Refuse, before planning, units that cost more than ``spec``'s limit under ``overlong="error"``, with
    ``accepts``' advice (for a kind whose units the planners' own message would advise cutting).

    Raises:
        OverlongError: some unit is over the limit.
    """
    limit, setting = spec.token_limit()
    if limit is None or getattr(spec, "overlong", "error") != "error" or not len(costs):
        return
    over = np.flatnonzero(np.asarray(costs) > limit)
    if len(over):
        unit, first = accepts.unit, int(over[0])
        raise OverlongError(
            f"{len(over)} {unit}(s) cost more than {setting}={limit} tokens ({unit} {first} costs "
            f"{int(costs[first])}). {accepts.overlong_advice(setting)}."
        )


def split_options(setup: Callable[..., Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """``apply_smart_batching``'s keywords as ``setup``'s: its own parameters go there, the rest are the
    strategy's fields (merged into ``strategy_options``)."""
    keys = set(inspect.signature(setup).parameters) - {"self", "strategy"}
    out = {k: v for k, v in options.items() if k in keys}
    spec_options = {k: v for k, v in options.items() if k not in keys}
    if spec_options:
        out["strategy_options"] = {**dict(out.get("strategy_options") or {}), **spec_options}
    return out


_MIXED: dict[tuple[type, type], type] = {}


def mixed_class(mixin: type, trainer_cls: type, namespace: Mapping[str, Any] | None = None) -> type:
    """``SmartBatching<trainer_cls>``: a subclass of ``trainer_cls`` with a kind's ``mixin`` first (and the
    attributes of ``namespace``), made once per (mixin, class); ``trainer_cls`` itself where it has the
    mixin already."""
    if issubclass(trainer_cls, mixin):
        return trainer_cls
    key = (mixin, trainer_cls)
    if key not in _MIXED:
        _MIXED[key] = type(
            f"SmartBatching{trainer_cls.__name__}", (mixin, trainer_cls), dict(namespace or {})
        )
    return _MIXED[key]


@dataclass(frozen=True, kw_only=True)
class TrainerKind:
    """One trainer kind and its adapter: what :func:`~smart_batching.hf.apply_smart_batching` and
    :func:`~smart_batching.hf.with_smart_batching` need of it.

    Attributes:
        name: the kind's name, as refusals and the registry say it (``"DPOTrainer"``).
        description: one line: which trainers, and what a unit of the plan is.
        recognises: ``recognises(trainer_or_class) -> bool``, for an instance or a class (through
            :mod:`smart_batching.compat`'s ``is_*`` functions).
        apply: ``apply(trainer, strategy, **options) -> trainer``: switch an instance in place.
        with_class: ``with_class(cls) -> cls``: the class with the kind's overrides mixed in.
        refusals: ``{option: advice}``: keywords of ``apply_smart_batching`` this kind refuses by name,
            each with what to do instead; refused before ``apply`` runs.
        accepts: what the kind's refusals may advise (:class:`Accepts`).
    """

    name: str
    description: str
    recognises: Callable[[Any], bool]
    apply: Callable[..., Any]
    with_class: Callable[[type], type]
    refusals: Mapping[str, str] = field(default_factory=dict)
    accepts: Accepts = field(default_factory=Accepts)

    def refuse(self, options: Mapping[str, Any]) -> None:
        """Raise :class:`~smart_batching.errors.ConfigError` naming every option of ``options`` in
        :attr:`refusals`, with its advice."""
        refused = [o for o in self.refusals if o in options]
        if refused:
            advice = "; ".join(dict.fromkeys(self.refusals[o] for o in refused))
            raise ConfigError(f"{', '.join(refused)} is not supported on a {self.name}: {advice}")


__all__ = ["EXAMPLES", "Accepts", "TrainerKind", "either", "refuse_overlong", "split_options"]
