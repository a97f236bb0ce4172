"""Out-of-memory back-off that keeps the optimizer step: ``oom_backoff=``.

When a micro-batch runs out of memory in its forward or backward pass, what it held is freed, it is
split into smaller micro-batches covering the same examples, and the same optimizer step goes on with
them: the same token-normalised loss (each piece's loss is its summed token losses over the step's
target tokens, as the whole micro-batch's was), the same step count, the same examples seen. The lower
budget is kept: every later micro-batch over it is split before it runs (so a resumed run, which reads
the budget from its checkpoint, splits as the interrupted one did)::

    micro-batch  [a b c d e f]  4,096 token slots  -> out of memory
    budget       4,096 x factor 0.5 = 2,048 slots
    pieces       [a b c] [d e f]                    -> same step, same loss, gradients summed

What counts as running out of memory (:func:`is_out_of_memory`): CUDA's ``torch.OutOfMemoryError``;
on CPU an allocator failure (``RuntimeError`` "DefaultCPUAllocator: can't allocate memory"); MPS's
"MPS backend out of memory"; and the fault injected for tests (:class:`InjectedOutOfMemoryError`).

A micro-batch is measured in token slots: the elements of its ``input_ids`` (rows x width when padded,
tokens when packed), what activation memory grows with. It is split (:func:`split_inputs`) by rows
when padded and at document boundaries when packed; one example longer than the budget cannot be split
and its error is raised.

**Injected fault (tests, rehearsals).** ``OomBackoff(fail_over_tokens=T)`` makes every piece of more
than ``T`` token slots fail inside the model: at the output of the middle module with parameters, in
the forward pass (``fail_stage="forward"``) or when the backward pass reaches it (``"backward"``, after
the later layers' gradients were accumulated: what a real failure in backward leaves behind), on the
ranks in ``fail_ranks`` (None: all). The environment sets the same without code changes:
``SMART_BATCHING_FAIL_OVER_TOKENS=T``, ``SMART_BATCHING_FAIL_STAGE=forward|backward``,
``SMART_BATCHING_FAIL_RANKS=1`` (comma-separated). The fault acts only while the back-off is on: the
variables set the fault of an enabled back-off and switch it on where ``oom_backoff`` is left None;
with ``oom_backoff=False`` they are ignored (:meth:`OomBackoff.coerce`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from smart_batching.errors import ConfigError
from smart_batching.units import IGNORE_INDEX

FAIL_STAGES = ("forward", "backward")
ENV_FAIL_OVER_TOKENS = "SMART_BATCHING_FAIL_OVER_TOKENS"
ENV_FAIL_STAGE = "SMART_BATCHING_FAIL_STAGE"
ENV_FAIL_RANKS = "SMART_BATCHING_FAIL_RANKS"

_OOM_MESSAGES = (
    "can't allocate memory",  # torch's DefaultCPUAllocator
    "not enough memory",  # the CPU allocator on Windows
    "mps backend out of memory",
    "cuda out of memory",  # torch before OutOfMemoryError existed
)


@dataclass(frozen=True)
class OomBackoff:
    """How to back off when a micro-batch runs out of memory (see the module docstring).

    Attributes:
        factor: The new budget is ``factor`` times the token slots of the micro-batch that failed
            (0 < factor < 1; 0.5 halves it, as Composer's ``device_train_microbatch_size="auto"`` does).
        max_tokens: A budget in token slots from the start (micro-batches over it are split before
            they run); None: no budget until a micro-batch fails.
        regrow_steps: Raise the budget again by ``1 / factor`` after this many optimizer steps with no
            failure, never to the size of the smallest micro-batch that failed (on any rank); None: never
            (the default).
        fail_over_tokens: Injected fault: pieces of more token slots fail (tests); None: no fault.
        fail_stage: Where the injected fault fires: ``"forward"`` or ``"backward"``.
        fail_ranks: Ranks whose pieces fail; None: every rank.
    """

    factor: float = 0.5
    max_tokens: int | None = None
    regrow_steps: int | None = None
    fail_over_tokens: int | None = None
    fail_stage: str = "forward"
    fail_ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.factor < 1:
            raise ConfigError(f"oom_backoff: factor={self.factor} must be between 0 and 1 (0.5 halves)")
        for name in ("max_tokens", "regrow_steps", "fail_over_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"oom_backoff: {name}={value!r} must be a positive integer or None")
        if self.fail_stage not in FAIL_STAGES:
            raise ConfigError(
                f"oom_backoff: fail_stage={self.fail_stage!r} must be one of {', '.join(FAIL_STAGES)}"
            )
        if self.fail_ranks is not None:
            object.__setattr__(self, "fail_ranks", tuple(int(r) for r in self.fail_ranks))

    @classmethod
    def coerce(cls, value: Any) -> OomBackoff | None:
        """``oom_backoff=`` as given: True (defaults), False/None (off), a dict of fields, or an
        :class:`OomBackoff`. The ``SMART_BATCHING_FAIL_*`` environment variables set the injected fault
        of an enabled back-off (and enable it when ``value`` is None).

        Raises:
            ConfigError: another type, an unknown field, or a bad environment value.
        """
        env = _fault_from_env()
        if value is None:
            value = bool(env)
        if value is False:
            return None
        if value is True:
            config = cls()
        elif isinstance(value, OomBackoff):
            config = value
        elif isinstance(value, Mapping):
            known = {f for f in cls.__dataclass_fields__}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigError(f"oom_backoff: unknown option(s) {unknown}; known: {sorted(known)}")
            config = cls(**dict(value))
        else:
            raise ConfigError(
                f"oom_backoff={value!r} must be True, False, a dict of options or an OomBackoff"
            )
        return replace(config, **env) if env else config

    def fails(self, slots: int, rank: int) -> bool:
        """Whether the injected fault makes a piece of ``slots`` token slots fail on ``rank``."""
        return (
            self.fail_over_tokens is not None
            and slots > self.fail_over_tokens
            and (self.fail_ranks is None or rank in self.fail_ranks)
        )


def _fault_from_env() -> dict[str, Any]:
    out: dict[str, Any] = {}
    raw = os.environ.get(ENV_FAIL_OVER_TOKENS, "").strip()
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ConfigError(f"{ENV_FAIL_OVER_TOKENS}={raw!r} must be a positive integer (token slots)")
        out["fail_over_tokens"] = int(raw)
    stage = os.environ.get(ENV_FAIL_STAGE, "").strip()
    if stage:
        out["fail_stage"] = stage
    ranks = os.environ.get(ENV_FAIL_RANKS, "").strip()
    if ranks:
        try:
            out["fail_ranks"] = tuple(int(r) for r in ranks.split(","))
        except ValueError:
            raise ConfigError(
                f"{ENV_FAIL_RANKS}={ranks!r} must be comma-separated ranks, e.g. 1 or 0,2"
            ) from None
    return out


@dataclass
class BackoffState:
    """What the back-off did so far; saved with each checkpoint so a resumed run splits alike.

    Attributes:
        budget: Token slots a micro-batch may hold before it is split; None: no budget yet.
        num_backoffs: Times the budget was lowered (on any rank; every rank counts the same).
        num_failures: Pieces of this rank that ran out of memory.
        num_split: Micro-batches of this rank run as more than one piece.
        failed_seconds: Time this rank spent in pieces that failed, and in re-running what a failure in
            backward lost (the back-off's cost).
        smallest_failed: Fewest token slots of a piece that failed, on any rank (re-growing stays below).
        steps_since_failure: Optimizer steps since the last back-off (for ``regrow_steps``).
        events: One entry per back-off: ``{"step", "stage", "slots", "budget", "rank"}``.
    """

    budget: int | None = None
    num_backoffs: int = 0
    num_failures: int = 0
    num_split: int = 0
    failed_seconds: float = 0.0
    smallest_failed: int | None = None
    steps_since_failure: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value in state.items():
            if key in self.__dataclass_fields__:
                setattr(self, key, list(value) if key == "events" else value)

    def lower(self, slots: int, factor: float) -> int:
        """The budget after a piece of ``slots`` token slots failed: ``floor(slots x factor)``, never above
        the budget in force."""
        new = max(1, int(slots * factor))
        if self.budget is not None:
            new = min(new, self.budget)
        return new


class InjectedOutOfMemoryError(RuntimeError):
    """The out-of-memory error :class:`OomBackoff`'s injected fault raises (a ``torch.OutOfMemoryError``
    subclass once torch is imported, see :func:`injected_error`)."""


@functools.cache
def _injected_class() -> type:
    import torch

    return type("InjectedOutOfMemoryError", (torch.OutOfMemoryError, InjectedOutOfMemoryError), {})


def injected_error(slots: int, limit: int, stage: str) -> BaseException:
    """An out-of-memory error as CUDA raises it (a ``torch.OutOfMemoryError``), marked as injected."""
    return _injected_class()(
        f"injected out-of-memory in {stage}: a piece of {slots} token slots is over fail_over_tokens={limit} "
        f"(OomBackoff / {ENV_FAIL_OVER_TOKENS})"
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is the device or host running out of memory (see the module docstring)."""
    if isinstance(exc, InjectedOutOfMemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (
        ImportError,
        AttributeError,
    ):  # pragma: no cover - torch < 2.5 has torch.cuda.OutOfMemoryError only
        pass
    if isinstance(exc, (RuntimeError, MemoryError)):
        text = str(exc).lower()
        return isinstance(exc, MemoryError) or any(m in text for m in _OOM_MESSAGES)
    return False


def free_memory() -> None:
    """Drop what a failed pass left: collect garbage (its frames held activations) and release the
    CUDA caching allocator's free blocks."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


# -- micro-batch layouts ---------------------------------------------------------------------------------


def token_slots(inputs: Mapping[str, Any]) -> int:
    """Token slots of a collated micro-batch: the elements of its ``input_ids`` (or of the first tensor)."""
    ids = inputs.get("input_ids")
    if ids is None:
        ids = next((v for v in inputs.values() if hasattr(v, "numel")), None)
    return int(ids.numel()) if ids is not None else 0


def _is_packed(inputs: Mapping[str, Any]) -> bool:
    ids = inputs.get("input_ids")
    return (
        ids is not None
        and ids.dim() == 2
        and ids.shape[0] == 1
        and "attention_mask" not in inputs
        and ("cu_seq_lens_q" in inputs or "position_ids" in inputs)
    )


def _document_bounds(inputs: Mapping[str, Any]) -> list[int]:
    """Token offsets where the documents of a packed row start, plus its end."""
    total = int(inputs["input_ids"].shape[1])
    if "cu_seq_lens_q" in inputs:
        return [int(x) for x in inputs["cu_seq_lens_q"].tolist()]
    from smart_batching.attention._segments import segment_starts_from_position_ids

    return segment_starts_from_position_ids(inputs["position_ids"][:1], 1).tolist() + [total]


def _packed_piece(inputs: Mapping[str, Any], bounds: list[int], lo: int, hi: int) -> dict[str, Any]:
    """Documents ``lo..hi-1`` of a packed row as a row of their own."""
    import torch

    a, b = bounds[lo], bounds[hi]
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        if name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            out[name] = (value[lo : hi + 1] - value[lo]).to(value.dtype)
        elif name in ("max_length_q", "max_length_k"):
            out[name] = max(bounds[d + 1] - bounds[d] for d in range(lo, hi))
        elif name == "seq_idx":
            out[name] = value[:, a:b] - value[0, a]
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == bounds[-1]:
            out[name] = value[:, a:b]
        else:
            out[name] = value
    return out


def split_inputs(inputs: Mapping[str, Any], budget: int) -> list[dict[str, Any]]:
    """Split a collated micro-batch into consecutive pieces of at most ``budget`` token slots each,
    covering the same examples in the same order.

    Padded rows (``(rows, width)`` tensors) are split by rows, keeping the width; a packed row
    (``(1, total)`` with ``cu_seq_lens_q`` or restarting ``position_ids``) at its document boundaries,
    its flash kwargs recomputed per piece; any other layout by rows of the tensors whose first
    dimension is the number of rows. A piece that cannot shrink (one row, or one document, over the
    budget) stays as it is: the caller sees a single piece come back and knows it cannot back off.

    Returns:
        The pieces (one piece, ``dict(inputs)``, when it already fits).
    """
    import torch

    if token_slots(inputs) <= budget:
        return [dict(inputs)]
    if _is_packed(inputs):
        bounds = _document_bounds(inputs)
        pieces, lo = [], 0
        for d in range(1, len(bounds) - 1):  # close a piece before the document that would overflow it
            if bounds[d + 1] - bounds[lo] > budget:
                pieces.append(_packed_piece(inputs, bounds, lo, d))
                lo = d
        pieces.append(_packed_piece(inputs, bounds, lo, len(bounds) - 1))
        return pieces
    ids = inputs.get("input_ids")
    if ids is None or ids.dim() < 2:
        return [dict(inputs)]
    rows, width = int(ids.shape[0]), int(ids[0].numel())
    per_piece = max(1, budget // max(width, 1))
    if rows <= 1:
        return [dict(inputs)]
    pieces = []
    for start in range(0, rows, per_piece):
        piece = {}
        for name, value in inputs.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
                piece[name] = value[start : start + per_piece]
            else:
                piece[name] = value
        pieces.append(piece)
    return pieces


def null_piece(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The first two tokens of the first example of a micro-batch, as a micro-batch of the same layout
    with one target token: a pass through every layer that costs almost nothing (the caller multiplies
    its loss by 0)."""
    import torch

    ids = inputs["input_ids"]
    packed = _is_packed(inputs)
    n = min(2, _document_bounds(inputs)[1] if packed else int(ids.shape[-1]))
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        if name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            out[name] = torch.tensor([0, n], dtype=value.dtype, device=value.device)
        elif name in ("max_length_q", "max_length_k"):
            out[name] = n
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == ids.shape:
            out[name] = value[:1, :n]
        elif isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == ids.shape[0]:
            out[name] = value[:1]
        else:
            out[name] = value
    if "labels" in out:  # one target whatever the prompt masking, so every layer is on the loss's path
        labels = out["input_ids"].clone()
        labels[:, 0] = IGNORE_INDEX
        out["labels"] = labels
    if "attention_mask" in out:
        out["attention_mask"] = torch.ones_like(out["attention_mask"])
    return out


# -- injected fault ----------------------------------------------------------------------------------------


def _middle_module(model: Any) -> Any:
    """The middle one of the model's modules that hold parameters of their own (where a real failure
    would strike half-way through the pass)."""
    with_params = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if not with_params:
        raise ConfigError("oom_backoff: the injected fault needs a model with parameters")
    return with_params[len(with_params) // 2]


@contextlib.contextmanager
def injected_fault(model: Any, config: OomBackoff, slots: int, rank: int) -> Iterator[None]:
    """While active, a piece of ``slots`` token slots fails inside ``model`` if ``config`` says so."""
    if not config.fails(slots, rank):
        yield
        return
    limit, stage = int(config.fail_over_tokens), config.fail_stage
    module = _middle_module(model)

    def on_backward(grad: Any) -> Any:
        raise injected_error(slots, limit, "backward")

    def on_forward(mod: Any, args: Any, output: Any) -> Any:
        if stage == "forward":
            raise injected_error(slots, limit, "forward")
        tensor = output[0] if isinstance(output, (tuple, list)) else output
        if getattr(tensor, "requires_grad", False):
            tensor.register_hook(on_backward)
        return output

    handle = module.register_forward_hook(on_forward)
    try:
        yield
    finally:
        handle.remove()


__all__ = [
    "ENV_FAIL_OVER_TOKENS",
    "ENV_FAIL_RANKS",
    "ENV_FAIL_STAGE",
    "FAIL_STAGES",
    "BackoffState",
    "InjectedOutOfMemoryError",
    "OomBackoff",
    "free_memory",
    "injected_fault",
    "is_out_of_memory",
    "null_piece",
    "split_inputs",
    "token_slots",
]
