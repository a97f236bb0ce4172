"""``group_by_length``: batches of similar lengths, fixed batch size.

Two modes:

- ``"sorted"`` (the default): sort the whole dataset by length (ties at random), cut into batches,
  shuffle batches. Tightest padding; batch order is random but each batch is homogeneous. ``window=W``
  sorts only within shuffled windows of W examples, drawn afresh every epoch: the practice of HF's
  megabatches (windows of 50 batches) and of Axolotl's multipack ``group_size``, with the batches then
  shuffled as fairseq's ``batch_by_size`` users do, so consecutive steps are not runs from long to short.
- ``"megabatch"``: HuggingFace ``LengthGroupedSampler`` semantics. Shuffle, cut into megabatches of
  ``megabatch_mult * batch_size`` examples, sort each megabatch by length (descending, stable), and move
  the longest example of the dataset to the front so an out-of-memory shows at the first step. Batches
  are consecutive chunks of that order. Randomness comes from numpy, not torch, so the indices differ
  from HF's for the same seed while the distribution is the same. A trainer set to
  ``train_sampling_strategy="group_by_length"`` gets this mode (``hf_sampling_options``).

Why ``"sorted"`` is the default: in the accuracy-parity study (benchmarks/RESULTS.md) both modes are
within noise of random batches under a decaying learning rate and sorted pads less; under a constant
learning rate HF's megabatch order costs more accuracy, because its batches run from long to short
within each megabatch and the epoch ends on the shortest examples.

In both modes the batch holding the longest example goes first, HF's rule
(:meth:`GroupByLengthSpec.leads_with_costliest`; ties to the largest footprint, rows × longest). With
full batches it is also the batch of the largest footprint. Megabatch mode has it already; sorted mode
swaps it with batch 0 after the shuffle, which costs one batch position per epoch in randomness. (In
sorted mode the last, incomplete batch holds the longest examples: it goes first, as HF's rule says,
even where a full batch before it has more token slots.)

Both are O(n): one permutation plus counting sorts. 10M examples plan in about half the time of
numpy's stable argsort of their lengths, many times faster than transformers' ``LengthGroupedSampler``
(``benchmarks/planner_speed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from smart_batching.errors import ConfigError
from smart_batching.plan import BatchShapes
from smart_batching.planners._common import (
    PlanParts,
    apply_overlong,
    drop_tail,
    fixed_offsets,
    padded_parts,
    permutation,
    sort_blocks,
    sort_by_length,
    sort_within_windows,
)
from smart_batching.planners._rounds import fixed_size_round
from smart_batching.planners._spec import Cut, Knobs, PlannerSpec, Room, Tuning

MODES = ("megabatch", "sorted")
GENERATORS = ("numpy", "torch")


@dataclass(frozen=True, kw_only=True)
class GroupByLengthSpec(PlannerSpec):
    """Fixed-size batches of similar lengths.

    Attributes:
        batch_size: examples per batch.
        mode: ``"sorted"`` (global sort, shuffled batches; the default) or ``"megabatch"`` (HF
            ``LengthGroupedSampler``).
        megabatch_mult: megabatch size in batches; None means HF's default ``min(n // (4 * batch_size), 50)``.
        window: the randomness knob of ``mode="sorted"``: sort only within shuffled windows of this many
            examples, drawn afresh every epoch (None: the whole dataset, the tightest padding). Smaller
            windows give each batch more random company at more padding (``analyze`` shows both).
        drop_last: leave out the last incomplete batch (its examples are counted as dropped).
        max_length: most tokens per example; None means no limit. Longer ones follow ``overlong``.
        overlong: ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"`` for examples over ``max_length``.
        generator: where the megabatch permutation comes from. ``"numpy"`` (the default): our compiled
            permutation, HF's distribution. ``"torch"``: ``torch.randperm(n, generator=
            torch.Generator().manual_seed(seed))`` as HF's ``get_length_grouped_indices`` draws it, the
            ``epoch + 1``-th draw for epoch ``epoch``: the very order ``LengthGroupedSampler(batch_size,
            lengths=lengths, generator=torch.Generator().manual_seed(seed))`` yields on its
            ``epoch + 1``-th pass (``tests/conformance``). For reproducing an HF run; it costs
            ``epoch + 1`` torch permutations and is not for streams.
    """

    name: ClassVar[str] = "group_by_length"
    description: ClassVar[str] = "fixed batch size, similar lengths together (HF megabatches or full sort)"
    variant_option: ClassVar[str | None] = "mode"
    analysis_variants: ClassVar[tuple[str, ...]] = ("megabatch",)
    hf_sampling: ClassVar[str | None] = "group_by_length"
    hf_sampling_options: ClassVar[dict[str, Any]] = {"mode": "megabatch"}
    batch_size: int = 8
    mode: str = "sorted"
    megabatch_mult: int | None = None
    window: int | None = None
    drop_last: bool = False
    max_length: int | None = None
    overlong: str = "error"
    generator: str = "numpy"

    def __post_init__(self) -> None:
        if self.generator not in GENERATORS:
            raise ConfigError(
                f"GroupByLengthSpec: generator= must be one of {', '.join(GENERATORS)}; got {self.generator!r}"
            )
        if self.generator == "torch" and self.mode != "megabatch":
            raise ConfigError(
                "GroupByLengthSpec: generator='torch' reproduces HF's megabatches: set mode='megabatch'"
            )
        self._check_positive("batch_size", self.batch_size)
        self._check_positive("megabatch_mult", self.megabatch_mult, allow_none=True)
        self._check_positive("window", self.window, allow_none=True)
        if self.window is not None and self.mode != "sorted":
            raise ConfigError(
                "GroupByLengthSpec: window= sorts within shuffled windows in mode='sorted'; megabatches "
                "are HF's windows (megabatch_mult=): set mode='sorted' or leave window=None"
            )
        self._check_positive("max_length", self.max_length, allow_none=True)
        self._check_overlong(self.overlong)
        if self.mode not in MODES:
            raise ConfigError(
                f"GroupByLengthSpec: mode= must be one of {', '.join(MODES)}; got {self.mode!r}"
            )

    @classmethod
    def options_from(cls, knobs: Knobs) -> dict[str, Any]:
        return knobs.given(batch_size="batch_size", max_length="max_length", overlong="overlong")

    @classmethod
    def example_options(cls, longest: int) -> dict[str, dict[str, Any]]:
        return {
            "": {"batch_size": 8},
            "megabatch": {"batch_size": 4, "mode": "megabatch"},
            "window": {"batch_size": 4, "window": 37},
            "drop_last": {"batch_size": 5, "drop_last": True},
        }

    def check_streamable(self) -> None:
        super().check_streamable()
        if self.generator == "torch":
            raise ConfigError(
                "generator='torch' reproduces HF's order over a whole dataset; a stream is planned a buffer at a "
                "time: leave generator='numpy'"
            )

    def leads_with_costliest(self) -> bool:
        """Always: HF's ``LengthGroupedSampler`` puts the megabatch with the longest example first so
        that an out-of-memory shows at the first step, in both modes and on any number of processes."""
        return True

    def mixes_steps_by_default(self) -> bool:
        """Yes: steps of one length stratum left its held-out loss above ``random``'s, mixed steps level
        with it on three sets of four (ten seeds; benchmarks/RESULTS.md, "mix_steps at ten seeds")."""
        return True

    def costliest_keys(self, shapes: BatchShapes) -> tuple[np.ndarray, np.ndarray]:
        """HF's rule: the longest example first; ties to the largest footprint (a full batch first)."""
        return shapes.longest, self.footprint(shapes)

    def plan_round(
        self, lens: np.ndarray, rng: np.random.Generator, room: Room | None, tuning: Tuning
    ) -> Cut:
        if self.mode == "megabatch":
            order, _ = megabatch_order(lens, self.batch_size, self.megabatch_mult, rng)
            shuffle_batches = False
        else:
            order, shuffle_batches = sort_by_length(lens, rng)[0], True
        return fixed_size_round(
            lens, order, rng, room, batch_size=self.batch_size, drop_last=self.drop_last,
            shuffle_batches=shuffle_batches,
        )  # fmt: skip


def megabatch_order(
    lengths: np.ndarray,
    batch_size: int,
    mult: int | None,
    rng: np.random.Generator,
    perm: np.ndarray | None = None,
) -> np.ndarray:
    """HF ``get_length_grouped_indices``, vectorised, on ``perm`` (default: a permutation drawn from
    ``rng``). Returns (n,) positions and their lengths."""
    n = lengths.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if mult is None:
        mult = max(1, min(n // (batch_size * 4), 50))
    mega = mult * batch_size
    if perm is None:
        perm = permutation(n, rng)  # (n,)
    values = lengths[perm]  # (n,)
    local = sort_blocks(values, mega, descending=True)  # (n,)
    order, ordered = perm[local], values[local]
    # Swap the first element of the megabatch holding the global maximum into position 0.
    starts = np.arange(0, n, mega)
    best = int(np.argmax(ordered[starts]))
    j = int(starts[best])
    order[0], order[j] = order[j], order[0]
    ordered[0], ordered[j] = ordered[j], ordered[0]
    return order, ordered


def plan_group_by_length(lengths: np.ndarray, spec: GroupByLengthSpec, rng: np.random.Generator) -> PlanParts:
    segments, counts = apply_overlong(lengths, spec.max_length, spec.overlong, "max_length")
    seg_len = segments.length
    if spec.mode == "megabatch":
        perm = torch_permutation(seg_len.shape[0], rng) if spec.generator == "torch" else None
        order, ordered = megabatch_order(seg_len, spec.batch_size, spec.megabatch_mult, rng, perm)
        offsets = fixed_offsets(order.shape[0], spec.batch_size, drop_last=spec.drop_last)
        if spec.drop_last:
            counts = drop_tail(segments, counts, order, offsets)
        return padded_parts(segments, counts, order, offsets, ordered=ordered)
    order, ordered = sort_within_windows(seg_len, rng, spec.window)
    offsets = fixed_offsets(order.shape[0], spec.batch_size, drop_last=spec.drop_last)
    if spec.drop_last:
        counts = drop_tail(segments, counts, order, offsets)
    # Batches in a random order, applied when the plan is laid out (with the costliest one first).
    shuffle = permutation(len(offsets) - 1, rng)
    return padded_parts(segments, counts, order, offsets, ordered=ordered, batch_order=shuffle)


def torch_permutation(n: int, rng: np.random.Generator) -> np.ndarray:
    """The permutation HF's ``get_length_grouped_indices`` draws for the plan ``rng`` stands for: ``rng``
    comes from ``SeedSequence([seed, epoch])`` (:func:`~smart_batching.planners.plan_batches`), and a
    ``LengthGroupedSampler`` with ``torch.Generator().manual_seed(seed)`` draws ``torch.randperm(n)`` once
    per pass, so epoch ``epoch`` is the ``epoch + 1``-th draw."""
    import torch

    entropy = rng.bit_generator.seed_seq.entropy
    if not (isinstance(entropy, list) and len(entropy) == 2):
        raise ConfigError(
            "generator='torch' needs a plan from plan_batches(seed=, epoch=); streams are not supported"
        )
    seed, epoch = (int(x) for x in entropy)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epoch):
        torch.randperm(n, generator=generator)
    return torch.randperm(n, generator=generator).numpy().astype(np.int64)
