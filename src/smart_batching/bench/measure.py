"""What a training run is measured with: a counting collator and Trainer callbacks.

* :class:`CountingCollator` wraps the strategy's collator and records, per batch, the examples, the
  real tokens, the token slots the model actually computed over (so padding is measured, not
  planned) and the target tokens the loss is taken over (so what is learned from is measured too).
* :class:`StepTimer` times each optimizer step (``on_step_begin`` to ``on_step_end``: forward, backward,
  clipping, optimizer; the batch is already collated) and each iteration (``on_step_end`` to the next:
  also data loading and collation). On CUDA it synchronises first, so the times are the GPU's.
* :class:`LossRecorder` keeps the logged training loss of every step.
* :class:`HeldOutCurve` evaluates the held-out loss at a cadence during training, off the clock
  (:mod:`.curve`).
* :class:`ProgressBar` is one tqdm bar per run, on stderr, with the current loss.
* :func:`plan_token_weights` measures what the run's plan does to the weight of a token per length
  quarter, from the plan alone.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from smart_batching.analysis.weights import token_weights
from smart_batching.collate import PaddingCollator
from smart_batching.data.lengths import dataset_target_counts
from smart_batching.loss import count_target_tokens
from smart_batching.plan import BatchPlan

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - the hf extra is required by the bench
    TrainerCallback = object  # type: ignore[assignment,misc]


class CountingCollator:
    """Wrap a collator and count what each batch it builds holds.

    After training, ``examples``, ``real_tokens``, ``slots`` and ``target_tokens`` are lists with one entry
    per batch: examples in the batch, real (non-padding) tokens, ``input_ids.numel()`` (rows × width), and
    the labels the loss counts (``shift_labels`` where the collator gives them, else ``labels`` less each
    row's first; 0 without labels).
    """

    def __init__(self, collator: Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]) -> None:
        self.collator = collator
        self.examples: list[int] = []
        self.real_tokens: list[int] = []
        self.slots: list[int] = []
        self.target_tokens: list[int] = []

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
        batch = self.collator(features)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        self.examples.append(len(features))
        self.slots.append(int(ids.numel()))
        self.real_tokens.append(int(mask.sum()) if mask is not None else int(ids.numel()))
        shifted, labels = batch.get("shift_labels"), batch.get("labels")
        if shifted is not None:
            self.target_tokens.append(int(count_target_tokens(shifted, shift_labels=False)))
        elif labels is not None and labels.dim() == 2:
            self.target_tokens.append(int(count_target_tokens(labels)))
        else:  # no labels, or one per example (classification)
            self.target_tokens.append(0 if labels is None else int(labels.numel()))
        return batch


class ClassificationCollator:
    """Pad ``input_ids`` (right side) and stack one integer ``labels`` per example: ``(num_rows,)``."""

    def __init__(self, pad_token_id: int, *, pad_to_multiple_of: int | None = None) -> None:
        self.padding = PaddingCollator(pad_token_id, pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        labels = torch.tensor([int(f["labels"]) for f in features], dtype=torch.long)
        inner = [{k: v for k, v in f.items() if k not in ("labels", "prompt_length")} for f in features]
        batch = self.padding(inner)
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": labels}


def classification_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
    """Cross-entropy over examples; summed and divided by ``num_items_in_batch`` when Trainer gives it."""
    logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs[0]
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(logits, labels)
    total = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    return total / torch.as_tensor(num_items_in_batch, device=total.device, dtype=total.dtype)


def percentiles(values: Sequence[float]) -> dict[str, float | int | None]:
    """``p50``, ``p90``, ``mean``, ``max`` and ``n`` of a list of seconds (None when empty)."""
    if not values:
        return {"p50": None, "p90": None, "mean": None, "max": None, "n": 0}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90 = np.percentile(arr, [50, 90])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "mean": float(arr.mean()),
        "max": float(arr.max()),
        "n": len(arr),
    }


class StepTimer(TrainerCallback):
    """Optimizer-step and iteration times in seconds (see the module docstring)."""

    def __init__(self, device: Any = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.step_seconds: list[float] = []
        self.iteration_seconds: list[float] = []
        self._begin: float | None = None
        self._last_end: float | None = None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last_end = self._now()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin = self._now()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = self._now()
        if self._begin is not None:
            self.step_seconds.append(now - self._begin)
        if self._last_end is not None:
            self.iteration_seconds.append(now - self._last_end)
        self._last_end = now


class LossRecorder(TrainerCallback):
    """The training loss Trainer logs (``logging_steps=1``: every optimizer step)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs and "loss" in logs:
            self.steps.append(int(state.global_step))
            self.losses.append(float(logs["loss"]))


class HeldOutCurve(TrainerCallback):
    """Evaluate at a cadence during training; the curve with training-only clocks (see the module doc).

    Args:
        evaluate: ``evaluate(model) -> {"loss": float, ...}`` on the fixed held-out set; it may put the
            model in eval mode (and must put back any other change it makes), the callback puts it back
            in training mode after.
        every: the cadence (resolved: steps or tokens).
        real_tokens: the per-batch real-token counts of the run, appended as batches are collated
            (:class:`~.measure.CountingCollator`'s ``real_tokens``), read at each step's end.
        examples: the per-batch example counts, likewise.
        initial_loss: held-out loss of the initial weights (the point at step 0); None leaves it out.
        epoch_ends: also evaluate at each epoch's end but the last (False: only at the cadence).
        micro_per_step: collated batches per optimizer step (gradient accumulation).
    """

    def __init__(
        self,
        evaluate: Callable[[Any], dict[str, Any]],
        every: Any,
        *,
        real_tokens: Sequence[int],
        examples: Sequence[int],
        initial_loss: float | None = None,
        epoch_ends: bool = True,
        micro_per_step: int = 1,
    ) -> None:
        self.evaluate = evaluate
        self.micro_per_step = int(micro_per_step)
        self.epoch_ends = epoch_ends
        self.every = every
        self.real_tokens = real_tokens
        self.examples = examples
        self.points: list[dict[str, Any]] = []
        if initial_loss is not None:
            self.points.append(
                {
                    "step": 0,
                    "tokens": 0,
                    "examples": 0,
                    "wall_seconds": 0.0,
                    "cpu_seconds": 0.0,
                    "epoch": 0.0,
                    "loss": initial_loss,
                }
            )
        self.eval_wall = 0.0
        self.eval_cpu = 0.0
        self._start: tuple[float, float] | None = None
        self._next_tokens: int | None = None

    def start(self) -> None:
        """Start the clocks now (call it where the caller's own training clock starts, so the last
        point and the run's ``wall_seconds`` agree); else they start at ``on_train_begin``."""
        self._start = (time.perf_counter(), time.process_time())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._start is None:
            self.start()
        if self.every is not None and self.every.tokens is not None:
            self._next_tokens = self.every.tokens

    def clocks(self) -> tuple[float, float]:
        """Training wall and CPU seconds since the start, evaluations left out."""
        if self._start is None:
            return 0.0, 0.0
        wall = time.perf_counter() - self._start[0] - self.eval_wall
        cpu = time.process_time() - self._start[1] - self.eval_cpu
        return wall, cpu

    def _due(self, step: int, tokens: int) -> bool:
        if self.every is None:
            return False
        if self.every.steps is not None:
            return step % self.every.steps == 0
        if self._next_tokens is not None and tokens >= self._next_tokens:
            while self._next_tokens <= tokens:
                self._next_tokens += self.every.tokens  # type: ignore[operator]
            return True
        return False

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        step = int(state.global_step)
        tokens, examples = self._seen(step)
        if model is None or not self._due(step, tokens) or step >= state.max_steps:
            return  # the last step's point is the final evaluation, taken after training
        self.add_point(model, step, tokens, examples, epoch=float(state.epoch or 0.0))

    def _seen(self, step: int) -> tuple[int, int]:
        """Real tokens and examples of the first ``step`` optimizer steps."""
        batches = step * self.micro_per_step
        return int(sum(self.real_tokens[:batches])), int(sum(self.examples[:batches]))

    def on_epoch_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """A point at every epoch's end but the last (the final evaluation is that one), whatever the
        cadence: the held-out loss of each epoch, for multi-epoch comparisons."""
        step = int(state.global_step)
        last = round(state.epoch or 0.0) >= round(float(args.num_train_epochs))
        if (
            model is None
            or not self.epoch_ends
            or last
            or step >= state.max_steps
            or (self.points and self.points[-1]["step"] == step)
        ):
            if self.points and self.points[-1]["step"] == step:
                self.points[-1]["epoch"] = float(round(state.epoch or 0.0))
            return
        tokens, examples = self._seen(step)
        self.add_point(model, step, tokens, examples, epoch=float(round(state.epoch or 0.0)))

    def add_point(
        self, model: Any, step: int, tokens: int, examples: int, *, epoch: float, loss: float | None = None
    ) -> None:
        """Evaluate now (or take ``loss`` as this point's value) and append the point (``epoch``: epochs
        done, fractional mid-epoch)."""
        wall, cpu = self.clocks()
        if loss is None:
            w0, c0 = time.perf_counter(), time.process_time()
            was_training = bool(getattr(model, "training", False))
            try:
                result = self.evaluate(model)
            finally:
                if was_training:
                    model.train()
            self.eval_wall += time.perf_counter() - w0
            self.eval_cpu += time.process_time() - c0
            loss = float(result["loss"])
            extra = {k: v for k, v in result.items() if k == "accuracy"}
        else:
            extra = {}
        self.points.append(
            {"step": step, "tokens": tokens, "examples": examples, "wall_seconds": wall, "cpu_seconds": cpu,
             "epoch": round(epoch, 4), "loss": loss, **extra}
        )  # fmt: skip

    def curve(self) -> dict[str, Any]:
        """The points as columns (see the module docstring), with the evaluation time beside them."""
        keys = ["step", "tokens", "examples", "wall_seconds", "cpu_seconds", "epoch", "loss"]
        if any("accuracy" in p for p in self.points):
            keys.append("accuracy")
        out: dict[str, Any] = {k: [p.get(k) for p in self.points] for k in keys}
        for k in ("wall_seconds", "cpu_seconds"):
            out[k] = [round(v, 4) for v in out[k]]
        out["eval_wall_seconds"] = round(self.eval_wall, 4)
        out["eval_cpu_seconds"] = round(self.eval_cpu, 4)
        out["every"] = self.every.to_dict() if self.every is not None else None
        return out


class ProgressBar(TrainerCallback):
    """One tqdm bar per run on stderr: optimizer steps done, current loss."""

    def __init__(self, description: str, *, enabled: bool = True) -> None:
        self.description = description
        self.enabled = enabled
        self.bar: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=state.max_steps, desc=self.description, unit="step", file=sys.stderr, leave=False
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if self.bar is not None and logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def length_histogram(lengths: np.ndarray, bins: int = 40) -> dict[str, list[float]]:
    """A compact histogram of token lengths for the records: ``{"edges": [...], "counts": [...]}``."""
    if lengths.size == 0:
        return {"edges": [0.0, 1.0], "counts": [0]}
    counts, edges = np.histogram(lengths, bins=min(bins, max(1, int(lengths.max()) - int(lengths.min()) + 1)))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def examples_digest(example_ids: np.ndarray, seg_lengths: np.ndarray) -> str:
    """Digest of the multiset of ``(example, tokens)`` a run trained on: equal digests, equal data."""
    order = np.lexsort((seg_lengths, example_ids))
    pairs = np.stack([example_ids[order], seg_lengths[order]]).astype(np.int64)
    return hashlib.blake2b(np.ascontiguousarray(pairs).tobytes(), digest_size=8).hexdigest()


def example_targets(data: Any) -> np.ndarray | None:
    """(num_train,) the target tokens of each training example of a causal-LM bench, as the loss counts
    them (:func:`smart_batching.data.lengths.dataset_target_counts`: its tokens after the prompt,
    ``prompt_length``, or those its ``assistant_masks`` mark; never the first, which no label predicts);
    None for classification."""
    if data.task == "classification" or "input_ids" not in data.train.column_names:
        return None
    return dataset_target_counts(data.train, data.lengths)


def plan_token_weights(data: Any, plan: BatchPlan, steps: np.ndarray | None = None) -> list[float] | None:
    """The weight of a target token per length quarter (shortest first) over its share in ``plan``, a
    run's epoch-0 plan (:func:`~smart_batching.analysis.weights.token_weights`; ``steps``: the optimizer
    step of each segment where a step holds several batches); None without targets."""
    targets = example_targets(data)
    if targets is None or not targets.any():
        return None
    return token_weights(plan, targets, steps)


__all__ = [
    "ClassificationCollator",
    "CountingCollator",
    "HeldOutCurve",
    "LossRecorder",
    "ProgressBar",
    "StepTimer",
    "classification_loss",
    "example_targets",
    "examples_digest",
    "length_histogram",
    "percentiles",
    "plan_token_weights",
]
